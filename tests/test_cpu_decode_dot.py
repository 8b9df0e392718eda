"""The cpu backend's small-row bf16 dot-product path (csrc/cpu/decode_dot.h): QK and PV by
vdpbf16ps for tasks of fewer than 16 rows per KV head (decode: rows = the GQA group), bf16
caches and fp8 caches under a bf16 query, avx512_bf16 build only, never in batch-invariant mode.

Its edges: every group size 1..15 (row blocks of 8/4/2/1) and 16 (the tiled dot path's first
size, for the boundary), head sizes that are not multiples of 32 (masked column steps) up to 256,
block sizes 1 / 16 / 256 (tiles crossing blocks, a tile inside one block), odd tile tails (the
last token pair with no odd token), the variants with their lse, split and unsplit KV, NaN keys,
the HND cache layout. Everything against the float64 reference on NaN-poisoned outputs and
unused cache slots; the 8-lane avx512 build of the same case must agree too.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from paged_ops import reference
from paged_ops.testing import assert_close, assert_lse_close, make_case, named_variants, nan_like, poison, rel_err

ops = torch.ops.paged_cpu
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif("avx512_bf16" not in ops.supported_isas(),
                                reason="this CPU has no AVX-512 BF16: the path is not built to run here")


def decode(case, kw, isa=None):
    out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
    previous = ops.set_isa(isa) if isa else None
    try:
        ops.decode_attention(*case.decode_args(out), lse=lse, **kw)
    finally:
        if previous:
            ops.set_isa(previous)
    return out, lse


def ref_decode(case, kw):
    return case.reference_decode_lse(**kw)


def check(case, kw, msg=""):
    out, lse = decode(case, kw)
    ref, ref_lse = ref_decode(case, kw)
    assert_close(out, ref, BF16, msg)
    # QK's products are exact and summed in fp32, the scale on the fp32 score: lse keeps fp32's budget.
    assert_lse_close(lse, ref_lse, torch.float32, msg)
    return out


@pytest.mark.parametrize("group", range(1, 17))
@pytest.mark.parametrize("head_size", [32, 40, 72, 128, 256])
def test_groups_and_head_sizes(bf16_isa, group, head_size):
    # Lengths end mid-tile, odd and even (the last token pair without its odd token), one 5-token
    # sequence (a single short tile) and one of several tiles.
    case = make_case([77, 131, 33, 5, 300], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=BF16, seed=group * 1000 + head_size)
    check(case, {}, f"group {group}, head {head_size}")


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_block_sizes(bf16_isa, block_size, group):
    case = make_case([77, 300, 1], num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=block_size,
                     dtype=BF16, seed=block_size + group)
    check(case, {}, f"block {block_size}, group {group}")


@pytest.mark.parametrize("name", ["plain", "softcap", "window", "sinks", "alibi", "all"])
@pytest.mark.parametrize("group", [1, 3, 8, 12])
def test_variants(bf16_isa, name, group):
    case = make_case([300, 129, 40], num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=BF16, seed=7 + group)
    kw = named_variants(2 * group, name)
    out = check(case, kw, name)
    # The 8-lane build computes the same case within the same budget of the reference: the two
    # paths agree to the bf16 tolerance.
    out8, _ = decode(case, kw, isa="avx512")
    assert rel_err(out, out8.double()) <= 1e-2


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_split_and_unsplit(bf16_isa, two_threads, group, name):
    # One long sequence on 2 threads: its KV is split over tasks and merged (plan_tasks: fewer
    # tasks than threads want); 16 sequences: one task each, unsplit. Both long enough to run
    # in parallel (kMinParallelWork).
    kw = named_variants(2 * group, name, seed=group)
    for lens in ([4000], [600] * 16):
        case = make_case(lens, num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16, dtype=BF16,
                         seed=len(lens) + group)
        check(case, kw, f"{len(lens)} sequences")


def test_hnd_layout(bf16_isa):
    # Head-major caches: a token's rows of one head are block_size * ... apart, not contiguous.
    case = make_case([77, 300], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=BF16,
                     layout="HND", seed=3)
    check(case, {})


def test_nan_keys_and_values(bf16_isa):
    # A NaN in a visible key makes the rows of its sequence and KV head NaN (the reference's rule),
    # and only them; a NaN value of a visible token does too. Keys the window hides are never read.
    case = make_case([96, 96, 96], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16, seed=11)
    case.key_cache[int(case.block_tables[1, 60 // 16]), 60 % 16, 0, 3] = float("nan")
    case.value_cache[int(case.block_tables[2, 95 // 16]), 95 % 16, 1, 5] = float("nan")
    case.key_cache[int(case.block_tables[0, 2 // 16]), 2 % 16, 1, 7] = float("nan")
    kw = dict(window_left=50)  # hides key 2 of sequence 0
    out, _ = decode(case, kw)
    ref, _ = ref_decode(case, kw)
    nan_rows = ref.isnan().any(-1)
    # (KV head 0 serves query heads 0..3, KV head 1 heads 4..7)
    assert not nan_rows[0].any()
    assert nan_rows[1, :4].all() and not nan_rows[1, 4:].any()
    assert nan_rows[2, 4:].all() and not nan_rows[2, :4].any()
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert_close(out[~nan_rows].view(-1, 64), ref[~nan_rows].view(-1, 64), BF16)


def test_small_prefill_tiles(bf16_isa):
    # Prefill query tiles of fewer than 16 rows (MHA's last tile of 13 tokens, a 1-token chunk
    # after cached tokens, group 2's short tiles) take the path too.
    for heads, kv_heads in ((4, 4), (4, 2)):
        case = make_case([77, 131, 5], q_lens=[77, 3, 1], num_heads=heads, num_kv_heads=kv_heads, head_size=72,
                         block_size=16, dtype=BF16, seed=heads + kv_heads)
        out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
        ops.prefill_attention(*case.prefill_args(out, True), lse=lse)
        ref = torch.empty(case.query.shape, dtype=torch.float64)
        ref_lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
        reference.prefill_attention(ref, case.query.double(), case.key_cache, case.value_cache, case.block_tables,
                                    case.cu_seqlens_q, case.seq_lens, case.max_seqlen_q, case.scale, True,
                                    case.k_scale, case.v_scale, lse=ref_lse)
        assert_close(out, ref, BF16)
        assert_lse_close(lse, ref_lse, torch.float32)


def test_decode_takes_the_path(bf16_isa):
    # The tests above only test this path if decode takes it: its probabilities round to bf16,
    # so its bits differ from the fp32 8-lane build's, and batch-invariant mode (one code path for
    # decode and prefill rows, not this one) gives the 8-lane arithmetic's bits on this build too.
    case = make_case([300, 129], num_heads=16, num_kv_heads=2, head_size=128, block_size=16, dtype=BF16, seed=9)
    out, _ = decode(case, {})
    out8, _ = decode(case, {}, isa="avx512")
    assert not torch.equal(out, out8)
    invariant = nan_like(case.query)
    ops.decode_attention(*case.decode_args(invariant), batch_invariant=True)
    assert not torch.equal(out, invariant)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 15])
@pytest.mark.parametrize("head_size", [40, 128, 256])
def test_fp8_caches(bf16_isa, cache_dtype, scale_kind, group, head_size):
    # fp8 K/V widened to bf16 in registers (exact) under a bf16 query, scales per tensor / KV head.
    case = make_case([77, 131, 33, 5, 300], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=BF16, cache_dtype=cache_dtype, scale_kind=scale_kind,
                     seed=group * 100 + head_size)
    check(case, {}, f"{cache_dtype}, group {group}")


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_variants_split_and_nan(bf16_isa, two_threads, cache_dtype):
    kw = named_variants(8, "all", seed=2)
    for lens in ([3000], [300, 129, 40]):  # split over tasks, then not
        case = make_case(lens, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=BF16,
                         cache_dtype=cache_dtype, seed=len(lens))
        check(case, kw, f"{len(lens)} sequences")
    # A NaN byte (0x7F: NaN in both fp8 dtypes) in a visible key of sequence 1, KV head 1: its rows only.
    case = make_case([96, 96], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16,
                     cache_dtype=cache_dtype, seed=4)
    case.key_cache.view(torch.uint8)[int(case.block_tables[1, 70 // 16]), 70 % 16, 1, 9] = 0x7F
    out, _ = decode(case, {})
    ref, _ = ref_decode(case, {})
    nan_rows = ref.isnan().any(-1)
    assert nan_rows[1, 4:].all() and not nan_rows[1, :4].any() and not nan_rows[0].any()
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert_close(out[~nan_rows].view(-1, 64), ref[~nan_rows].view(-1, 64), BF16)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_decode_takes_the_path(bf16_isa, cache_dtype):
    # As test_decode_takes_the_path: the fp8 tests above test this path only if decode takes it.
    case = make_case([300, 129], num_heads=16, num_kv_heads=2, head_size=128, block_size=16, dtype=BF16,
                     cache_dtype=cache_dtype, seed=9)
    out, _ = decode(case, {})
    out8, _ = decode(case, {}, isa="avx512")
    assert not torch.equal(out, out8)

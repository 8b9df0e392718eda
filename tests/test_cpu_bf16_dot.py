"""The cpu backend's bf16 dot-product path (csrc/cpu/bf16_dot.h): QK and PV of bf16 caches by
vdpbf16ps, in the avx512_bf16 build only, for tasks of at least 16 rows per KV head (prefill
tiles, large GQA groups) and never in batch-invariant mode.

Its edges: head sizes that are not multiples of 32 (masked column steps: 8, 40, 72) and the
largest (256), tiles shorter than 32 tokens and odd (the zero padding of the transposed keys and
the interleaved values), causal and not, the variants with their lse, rows that see one key,
NaN keys, and a decode of a large GQA group. Everything against the float64 reference on NaN-poisoned outputs
and unused cache slots; the 8-lane avx512 build of the same case must agree too. fp8 caches (e4m3fn,
e5m2) under a bf16 query take the path as well, widened to bf16 in the tile's re-layout: every finite
value of each format checked elementwise, NaN bytes, scales per tensor and per head.
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


def run(case, causal, kw, isa=None):
    out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
    previous = ops.set_isa(isa) if isa else None
    try:
        ops.prefill_attention(*case.prefill_args(out, causal), lse=lse, **kw)
    finally:
        if previous:
            ops.set_isa(previous)
    return out, lse


def ref_rows(case, causal, kw):
    return case.reference_prefill_lse(causal, **kw)


@pytest.mark.parametrize("head_size", [8, 40, 72, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_head_sizes_and_tile_tails(bf16_isa, head_size, causal):
    # Sequences ending mid-tile (odd lengths), a prefill chunk after cached tokens, a decode row,
    # and MHA / GQA 4 (64 and 16+ rows per task); block 16 so tiles cross blocks.
    for heads, kv_heads in ((4, 4), (8, 2)):
        case = make_case([77, 131, 33, 5], q_lens=[77, 50, 33, 1], num_heads=heads, num_kv_heads=kv_heads,
                         head_size=head_size, block_size=16, dtype=BF16, seed=head_size + heads)
        out, lse = run(case, causal, {})
        ref, ref_lse = ref_rows(case, causal, {})
        assert_close(out, ref, BF16, f"{heads}/{kv_heads} heads")
        assert_lse_close(lse, ref_lse, torch.float32, f"{heads}/{kv_heads} heads")


@pytest.mark.parametrize("name", ["plain", "softcap", "window", "sinks", "alibi", "all"])
@pytest.mark.parametrize("causal", [True, False])
def test_variants(bf16_isa, name, causal):
    case = make_case([300, 129], q_lens=[300, 64], num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=BF16, seed=7)
    kw = named_variants(16, name)
    out, lse = run(case, causal, kw)
    ref, ref_lse = ref_rows(case, causal, kw)
    assert_close(out, ref, BF16)
    # QK is exact products summed in fp32 (the scale on the fp32 score): the lse keeps fp32's budget.
    assert_lse_close(lse, ref_lse, torch.float32)
    # The 8-lane build computes the same case within the same budget of the reference: the two
    # paths agree to the bf16 tolerance.
    out8, _ = run(case, causal, kw, isa="avx512")
    assert rel_err(out, out8.double()) <= 1e-2


def test_one_key_rows_and_nan_keys(bf16_isa):
    # window_left=0, causal: each row sees only its own key (a tile's other 31 scores masked);
    # then a NaN written into key 40 of sequence 1 makes exactly the rows that see it NaN (the
    # reference's rule), and nothing else.
    case = make_case([96, 96], q_lens=[96, 96], num_heads=8, num_kv_heads=1, head_size=64, block_size=16,
                     dtype=BF16, seed=11)
    kw = dict(window_left=0)
    out, lse = run(case, True, kw)
    ref, ref_lse = ref_rows(case, True, kw)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)

    block = int(case.block_tables[1, 40 // 16])
    case.key_cache[block, 40 % 16, 0, 3] = float("nan")
    out, lse = run(case, True, {})
    ref, ref_lse = ref_rows(case, True, {})
    nan_rows = ref.isnan().any(-1)
    assert nan_rows[96 + 40:].all() and not nan_rows[:96 + 40].any()
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert_close(out[~nan_rows].view(-1, 64), ref[~nan_rows].view(-1, 64), BF16)


def test_large_group_decode_takes_the_path_too(bf16_isa):
    # 32 query heads on one KV head: a decode task has 32 rows, enough for the dot path.
    case = make_case([1000, 37, 300], num_heads=32, num_kv_heads=1, head_size=128, block_size=16, dtype=BF16, seed=5)
    out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
    ops.decode_attention(*case.decode_args(out), lse=lse, softcap=5.0, window_left=500)
    ref = torch.empty(case.query.shape, dtype=torch.float64)
    ref_lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    reference.decode_attention(ref, case.query.double(), case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens, case.scale, case.k_scale, case.v_scale, lse=ref_lse,
                               softcap=5.0, window_left=500)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)


def test_scratch_kept_across_calls(bf16_isa):
    # Each thread keeps its Scratch from call to call (the largest task's buffers so far): calls
    # of other shapes, a NaN row, batch-invariant mode (the 8-lane path, which reads the fp32
    # query the dot path never writes) and a split decode (the fold's accumulator) in turn, each
    # against the reference, so no call can read what an earlier one left there.
    big = make_case([300, 200], q_lens=[300, 150], num_heads=16, num_kv_heads=2, head_size=256, block_size=16,
                    dtype=BF16, seed=21)
    small = make_case([70, 45], q_lens=[70, 20], num_heads=6, num_kv_heads=3, head_size=40, block_size=16,
                      dtype=BF16, seed=22)
    nan_case = make_case([96], q_lens=[96], num_heads=8, num_kv_heads=1, head_size=256, block_size=16, dtype=BF16,
                         seed=23)
    nan_case.key_cache[int(nan_case.block_tables[0, 0]), 5, 0, 7] = float("nan")

    def check_prefill(case, kw, causal=True):
        out, lse = run(case, causal, kw)
        ref, ref_lse = ref_rows(case, causal, kw)
        nan_rows = ref.isnan().any(-1)
        assert torch.equal(out.isnan().any(-1), nan_rows)
        assert_close(out[~nan_rows].view(-1, case.query.shape[-1]), ref[~nan_rows].view(-1, case.query.shape[-1]), BF16)
        assert_lse_close(lse[~nan_rows], ref_lse[~nan_rows], torch.float32)

    for step in range(2):
        check_prefill(big, {})
        check_prefill(nan_case, {})
        check_prefill(small, dict(window_left=30, sinks=torch.randn(6)))
        check_prefill(big, dict(batch_invariant=True, softcap=4.0), causal=False)
        check_prefill(small, {}, causal=False)
        decode = make_case([3000], num_heads=16, num_kv_heads=1, head_size=128, block_size=16, dtype=BF16, seed=24 + step)
        out, lse = nan_like(decode.query), poison(torch.empty(decode.query.shape[:2]))
        ops.decode_attention(*decode.decode_args(out), lse=lse)
        ref = torch.empty(decode.query.shape, dtype=torch.float64)
        ref_lse = torch.empty(decode.query.shape[:2], dtype=torch.float64)
        reference.decode_attention(ref, decode.query.double(), decode.key_cache, decode.value_cache, decode.block_tables,
                                   decode.seq_lens, decode.scale, lse=ref_lse)
        assert_close(out, ref, BF16)
        assert_lse_close(lse, ref_lse, torch.float32)


# fp8 caches under a bf16 query take the same path: each tile's rows widened to bf16 (exact for
# both formats) before the re-layout, the k/v scales folded in as on the 8-lane path.
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_bytes(dtype, finite=True):
    b = torch.arange(256, dtype=torch.uint8)
    return b[b.view(dtype).float().isfinite() == finite]


def set_token_bytes(cache, case, seq, token, kv_head, row):
    block = int(case.block_tables[seq, token // case.key_cache.shape[1]])
    cache.view(torch.uint8)[block, token % case.key_cache.shape[1], kv_head] = row


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_fp8_caches_every_value(bf16_isa, fp8, scale_kind):
    # window_left=0: each row sees only its own key, so its probability is exactly 1, its output
    # that value row times v_scale (to bf16 rounding, elementwise), and its lse that key's score
    # (exact products summed in fp32). Every finite byte of the format lies in K and V, in many
    # columns, subnormals and the largest values included: a value widened wrong fails.
    d, heads, kv_heads = 72, 8, 2  # 72: a masked column step
    case = make_case([300], q_lens=[300], num_heads=heads, num_kv_heads=kv_heads, head_size=d, block_size=16,
                     dtype=BF16, cache_dtype=fp8, scale_kind=scale_kind, seed=21)
    values = fp8_bytes(fp8)
    gen = torch.Generator().manual_seed(3)
    for t in range(300):
        for h in range(kv_heads):
            set_token_bytes(case.key_cache, case, 0, t, h, values[torch.randint(len(values), (d,), generator=gen)])
            set_token_bytes(case.value_cache, case, 0, t, h, values[(torch.arange(d) + (t * kv_heads + h) * d) % len(values)])
    kw = dict(window_left=0)
    out, lse = run(case, True, kw)
    ref, ref_lse = ref_rows(case, True, kw)
    assert torch.isfinite(ref).all()
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2.0 ** -8).all(), f"worst {(err / ref.abs().clamp_min(1e-30)).max():.3g}"
    # The lse (one score) within fp32 summation's bound: D * 2^-24 * sum of |terms|.
    q = case.query.double().view(300, kv_heads, heads // kv_heads, d)
    k = torch.stack([case.key_cache[int(case.block_tables[0, t // 16]), t % 16].double() for t in range(300)])
    ks = case.k_scale.double().view(1, -1, 1) if case.k_scale.numel() > 1 else case.k_scale.double()
    bound = (q.abs() * k.abs().unsqueeze(2)).sum(-1) * ks * case.scale * (d + 2) * 2.0 ** -24
    assert ((lse.double() - ref_lse).abs().view(300, kv_heads, -1) <= bound + 1e-30).all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_size", [72, 128])
def test_fp8_caches_with_variants_take_the_path(bf16_isa, fp8, head_size):
    case = make_case([300, 129], q_lens=[300, 64], num_heads=16, num_kv_heads=4, head_size=head_size, block_size=16,
                     dtype=BF16, cache_dtype=fp8, scale_kind="head", seed=head_size)
    kw = named_variants(16, "all")
    out, lse = run(case, True, kw)
    ref, ref_lse = ref_rows(case, True, kw)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)
    # The 8-lane build (fp32 probabilities) agrees within bf16's budget but not bit for bit:
    # the bf16 probabilities show that the dot path ran.
    out8, _ = run(case, True, kw, isa="avx512")
    assert rel_err(out, out8.double()) <= 1e-2
    assert not torch.equal(out, out8)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("which", ["k", "v"])
def test_fp8_nan_bytes_in_a_tile(bf16_isa, fp8, which):
    # Every NaN byte of the format, one per (sequence, position) in the middle of a tile: NaN
    # exactly in the rows the reference's are (a NaN key: the rows that see it; a NaN value: every
    # row of the sequence's KV head, as 0 * NaN in the reference's sum, non-causal so the kernel's
    # rows all read that tile), the others within the budget.
    nan_bytes = fp8_bytes(fp8, finite=False)
    nan_bytes = nan_bytes[nan_bytes.view(fp8).float().isnan()]
    causal = which == "k"
    n = len(nan_bytes)
    case = make_case([96] * n, q_lens=[96] * n, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=BF16, cache_dtype=fp8, seed=13)
    cache = case.key_cache if which == "k" else case.value_cache
    for s, byte in enumerate(nan_bytes.tolist()):
        block = int(case.block_tables[s, (40 + s) // 16])
        cache.view(torch.uint8)[block, (40 + s) % 16, 1, 5] = byte
    out, lse = run(case, causal, {})
    ref, ref_lse = ref_rows(case, causal, {})
    nan_rows = ref.isnan().any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert_close(out[~nan_rows].view(-1, 64), ref[~nan_rows].view(-1, 64), BF16)

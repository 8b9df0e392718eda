"""The cpu backend's bf16 dot-product path (csrc/cpu/bf16_dot.h): QK and PV of bf16 caches by
vdpbf16ps, in the avx512_bf16 build only, for tasks of at least 16 rows per KV head (prefill
tiles, large GQA groups) and never in batch-invariant mode.

Its edges: head sizes that are not multiples of 32 (masked column steps: 8, 40, 72) and the
largest (256), tiles shorter than 32 tokens and odd (the zero padding of the transposed keys and
the interleaved values), causal and not, the variants with their lse, rows that see one key,
NaN keys, and a decode of a large GQA group. Everything against the float64 reference on NaN-poisoned outputs
and unused cache slots; the 8-lane avx512 build of the same case must agree too.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from paged_ops import reference
from paged_ops.testing import assert_close, assert_lse_close, make_case, nan_like, poison, rel_err

ops = torch.ops.paged_cpu
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif("avx512_bf16" not in ops.supported_isas(),
                                reason="this CPU has no AVX-512 BF16: the path is not built to run here")


@pytest.fixture
def bf16_isa():
    previous = ops.set_isa("avx512_bf16")
    yield
    ops.set_isa(previous)


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
    ref = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    reference.prefill_attention(ref, case.query.double(), case.key_cache, case.value_cache, case.block_tables,
                                case.cu_seqlens_q, case.seq_lens, case.max_seqlen_q, case.scale, causal,
                                case.k_scale, case.v_scale, lse=lse, **kw)
    return ref, lse


def variants(num_heads, name, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "plain": {},
        "softcap": dict(softcap=3.0),
        "window": dict(window_left=45),
        "sinks": dict(sinks=torch.randn(num_heads, generator=g) * 2),
        "alibi": dict(alibi_slopes=torch.rand(num_heads, generator=g) * 0.1),
        "all": dict(softcap=2.0, window_left=70, sinks=torch.randn(num_heads, generator=g),
                    alibi_slopes=torch.rand(num_heads, generator=g) * 0.1),
    }[name]


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
    kw = variants(16, name)
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

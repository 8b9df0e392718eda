"""The cpu backend at keys and values of different head sizes and heads up to 576 (#24 item 1, MLA),
on each of its own paths and every ISA build this machine runs (tests/test_attention_head_sizes.py
holds the contract's cases for every backend, on the default build only).

The kernel (csrc/cpu/attention.h) reads queries and keys at Dk and values, accumulators, partial
outputs and out at Dv; each of its micro-kernels is reached by its own shapes (as
tests/test_cpu_contract_edges.py's PV_PATHS): the 8/16-lane fp32 kernels (fp32 and fp16 queries,
and every build without AVX-512 BF16), decode_dot.h's small rows (bf16 or fp8 caches under a bf16
query, fewer than 16 rows per KV head), bf16_dot.h's re-laid tiles (16+ rows) and their AMX tiles
(the amx builds), each with the fp8 widening where the cache is fp8. Around them: split-KV partials
and their merge, the batch-invariant chunks and their fold, values with inf / NaN elements that
only some rows see, and the absorbed latent (value_cache a view of key_cache's first Dv columns).
"""
from __future__ import annotations

import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import (assert_bits_equal, assert_close, assert_lse_close, bits, make_case, make_variants,
                               poison)

from .test_cpu_contract_edges import assert_rows_like_reference, store

cpu = paged_ops.backend("cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (query dtype, cache dtype, q_len (None: decode), num_heads, num_kv_heads): per KV head a task has
# q_len * group rows (decode: the group).
PATHS = {
    "fp32-decode": (F32, None, None, 16, 1),
    "fp16-prefill": (F16, None, 20, 4, 2),
    "bf16-small": (BF16, None, None, 8, 1),
    "bf16-dot-16": (BF16, None, None, 16, 1),
    "bf16-dot-128": (BF16, None, None, 128, 1),
    "bf16-prefill": (BF16, None, 40, 2, 2),
    "e4m3-small": (BF16, E4M3, None, 4, 1),
    "e5m2-dot": (BF16, E5M2, 24, 4, 2),
    "e4m3-fp16": (F16, E4M3, None, 16, 1),
}
# (Dk, Dv, value_in_key, block_size, layout): the absorbed latent, DeepSeek's non-absorbed prefill
# heads, sizes that are not multiples of 32 (the dot paths' column masks, the AMX QK tail), the
# smallest value head under the largest key head.
SHAPES = {
    "576-512-latent": (576, 512, True, 16, "NHD"),
    "192-128": (192, 128, False, 3, "NHD"),
    "136-72": (136, 72, False, 1, "HND"),
    "576-8": (576, 8, False, 64, "NHD"),
    "40-24-latent": (40, 24, True, 7, "HND"),
}


def build(path, shape, seq_lens=(1, 37, 100), seed=0, **kw):
    dtype, cache_dtype, q_len, heads, kv_heads = PATHS[path]
    dk, dv, in_key, block_size, layout = SHAPES[shape]
    q_lens = None if q_len is None else [min(q_len, n) for n in seq_lens]
    return make_case(list(seq_lens), q_lens, num_heads=heads, num_kv_heads=kv_heads, head_size=dk,
                     value_head_size=dv, value_in_key=in_key, block_size=block_size, dtype=dtype,
                     cache_dtype=cache_dtype, layout=layout, seed=seed, **kw), q_len is None


def run(case, decode, causal=True, **kw):
    """(out, lse) of the cpu backend, both NaN before the call."""
    out, lse = case.new_out(), poison(torch.empty(case.query.shape[:2]))
    if decode:
        cpu.decode_attention(*case.decode_args(out), lse=lse, **kw)
    else:
        cpu.prefill_attention(*case.prefill_args(out, causal), lse=lse, **kw)
    return out, lse


def expected(case, decode, causal=True, **kw):
    kw = {k: v for k, v in kw.items() if k != "batch_invariant"}
    return case.reference_decode_lse(**kw) if decode else case.reference_prefill_lse(causal, **kw)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("path", list(PATHS))
def test_paths_at_key_and_value_head_sizes(isa, path, shape):
    case, decode = build(path, shape)
    before = [bits(case.key_cache).clone(), bits(case.value_cache).clone()]
    out, lse = run(case, decode)
    ref, ref_lse = expected(case, decode)
    assert out.shape[-1] == SHAPES[shape][1]
    assert_close(out, ref, case.dtype, f"{isa} {path} {shape}")
    assert_lse_close(lse, ref_lse, case.dtype, f"{isa} {path} {shape}")
    for got, want in zip([bits(case.key_cache), bits(case.value_cache)], before):
        assert torch.equal(got, want), "the kernel wrote a cache"


SPLIT_VARIANTS = {"plain": dict(), "sinks-softcap": dict(sinks=True, softcap=3.0),
                  "window-alibi": dict(window_left=700, alibi=True)}


@pytest.mark.parametrize("shape", ["576-512-latent", "192-128", "136-72"])
@pytest.mark.parametrize("path,variants", [("fp32-decode", "plain"), ("bf16-small", "sinks-softcap"),
                                           ("bf16-dot-16", "window-alibi"), ("bf16-dot-128", "plain"),
                                           ("bf16-prefill", "plain"), ("e5m2-dot", "sinks-softcap")])
def test_split_kv_partials(isa, two_threads, path, variants, shape):
    """Few long sequences on two threads: their KV is split, each split's partial rows (Dv wide)
    merged by log-sum-exp (merge_splits)."""
    case, decode = build(path, shape, seq_lens=(2100, 1300), seed=1)
    variants = make_variants(case.query.shape[1], seed=1, **SPLIT_VARIANTS[variants])
    out, lse = run(case, decode, **variants)
    ref, ref_lse = expected(case, decode, **variants)
    assert_close(out, ref, case.dtype, f"{isa} {path} {shape}")
    assert_lse_close(lse, ref_lse, case.dtype, f"{isa} {path} {shape}")


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("shape", ["576-512-latent", "192-128", "136-72"])
def test_batch_invariant_prefill_rows_equal_decode(isa, threads, num_threads, shape):
    """Batch-invariant mode over several 512-key chunks (folded in one task, or tasks of their own
    on two threads): a sequence's prefill rows are bitwise its decode rows at the same positions,
    alone or in a batch, and right."""
    threads(num_threads)
    dk, dv, in_key, block_size, layout = SHAPES[shape]
    case = make_case([1200, 90], [6, 3], num_heads=16, num_kv_heads=1 if in_key else 2, head_size=dk,
                     value_head_size=dv, value_in_key=in_key, block_size=block_size, dtype=BF16, layout=layout,
                     seed=2)
    out, lse = run(case, False, batch_invariant=True)
    assert_close(out, case.reference_prefill(), BF16, f"{isa} {shape}")
    last = [5, 8]  # each sequence's last prefill row: position seq_len - 1
    d_out, d_lse = case.new_out()[last], poison(torch.empty(2, 16))
    cpu.decode_attention(d_out, case.query[last], case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                         case.scale, None, None, lse=d_lse, batch_invariant=True)
    assert_bits_equal(d_out, out[last], "decode rows vs prefill rows")
    assert_bits_equal(d_lse, lse[last], "decode lse vs prefill lse")
    one = case.new_out()[:1]
    cpu.decode_attention(one, case.query[5:6], case.key_cache, case.value_cache, case.block_tables[:1],
                         case.seq_lens[:1], case.scale, None, None, batch_invariant=True)
    assert_bits_equal(one, d_out[:1], "a decode row alone vs in a batch")


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path", ["fp32-decode", "fp16-prefill", "bf16-prefill", "e5m2-dot"])
def test_hidden_non_finite_values_at_value_head_size(isa, path, batch_invariant):
    """Values with inf / NaN elements in columns past 64 of a Dv = 128 row (the copy that hides
    them is Dv wide), seen by some rows of a causal prefill only: the rows that cannot see them
    stay finite and right, the others are non-finite where the reference is (the decode paths'
    shapes run as a prefill of 8 rows here)."""
    dtype, cache_dtype, q_len, heads, kv_heads = PATHS[path]
    q_len = q_len or 8
    case = make_case([40, 70], [q_len, q_len], num_heads=heads, num_kv_heads=kv_heads, head_size=192,
                     value_head_size=128, block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=3)
    base = 40 - q_len
    store(case.value_cache, case.block_tables, 0, base + q_len - 1, math.inf, head=0, columns=slice(100, 104))
    store(case.value_cache, case.block_tables, 1, 69, math.nan, head=kv_heads - 1, columns=127)
    out, lse = run(case, False, batch_invariant=batch_invariant)
    ref, ref_lse = expected(case, False)
    assert_rows_like_reference(out, lse, ref, ref_lse, dtype, f"{isa} {path}")


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path", ["fp32-decode", "bf16-small", "bf16-dot-16", "e4m3-small"])
def test_latent_with_non_finite_rope_columns(isa, path, batch_invariant):
    """The absorbed latent: an inf in a RoPE column (past Dv = 512: read by QK only) of a key a
    window hides, and a NaN in a latent column (QK and PV) of another hidden key, never reach a row;
    the same NaN in a key the rows see makes them NaN, as the reference."""
    dtype, cache_dtype, _, heads, _ = PATHS[path]
    case = make_case([300, 50], num_heads=heads, num_kv_heads=1, head_size=576, value_head_size=512,
                     value_in_key=True, block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=4)
    kw = dict(window_left=100, batch_invariant=batch_invariant)
    store(case.key_cache, case.block_tables, 0, 150, math.inf, columns=slice(540, 541))
    store(case.key_cache, case.block_tables, 0, 198, math.nan, columns=slice(7, 8))  # just outside the window
    out, lse = run(case, True, **kw)
    ref, ref_lse = expected(case, True, **kw)
    assert ref.isfinite().all()
    assert_close(out, ref, dtype, f"{isa} {path}")
    assert_lse_close(lse, ref_lse, dtype, f"{isa} {path}")
    store(case.key_cache, case.block_tables, 1, 20, math.nan, columns=slice(300, 301))
    out, lse = run(case, True, **kw)
    ref, ref_lse = expected(case, True, **kw)
    assert out[1].isnan().all() and ref[1].isnan().all()
    assert_close(out[0], ref[0], dtype, f"{isa} {path}")


def test_direct_call_with_value_head_size_above_the_key_s():
    """The cpu namespace's own op does not validate (the public op refuses Dv > Dk): at Dv > Dk it
    still reads only its tensors and computes the same attention as the reference's formula."""
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(6, 16, 1, 64, generator=g).to(BF16)
    vc = torch.randn(6, 16, 1, 576, generator=g).to(BF16)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    for heads in (4, 16):
        q = torch.randn(2, heads, 64, generator=g).to(BF16)
        out = torch.full((2, heads, 576), math.nan, dtype=BF16)
        torch.ops.paged_cpu.decode_attention(out, q, kc, vc, table, lens, 0.125, None, None)
        for s in range(2):
            n = int(lens[s])
            rows = table[s].long().repeat_interleave(16)[:n], torch.arange(n) % 16
            want = reference.attention(q[s:s + 1].double(), kc[rows].double(), vc[rows].double(), 0.125, True)
            assert_close(out[s:s + 1], want, BF16)

"""The cpu backend at the extremes of its sizes: zero-length sequences, zero heads, sizes past
int32 and contexts past 2^30 tokens. Each case crashed or gave a silent error before its fix
(issue #12 items 1-4):

1. prefill with a sequence of seq_len = 0 (and so q_len = 0) divided by a zero split length;
2. reshape_and_cache (and attention) with 0 KV heads divided by zero in the kernel;
3. sizes narrowed to int: a stride-0 cache view with block_size 2^32 + 16 was read as 16;
4. very long contexts: int32 overflow in the task planner left `out` unwritten above 2^30 tokens,
   and the fp32 running sums drifted with the length (1e8 tokens of V == 1 gave 0.64).

The long-context tests use caches of a few real blocks that the block table repeats: a context
of N tokens costs a table of N / block_size ids and no more cache memory, and its exact answer is
the float64 reference over one copy of the repeated blocks (softmax over a multiset repeated k
times equals softmax over one copy).
"""
from __future__ import annotations

import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_close, make_case, nan_like, rel_err

cpu = paged_ops.backend("cpu")


# -- 1. seq_len = 0 ------------------------------------------------------------------------------

def test_prefill_of_a_sequence_with_no_tokens_after_another():
    # Sequence 1 has seq_len 0 and q_len 0 (0 <= q_len <= seq_len): the smallest call that divided
    # by a zero split length.
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(4, 4, 1, 16, generator=g), torch.randn(4, 4, 1, 16, generator=g)
    q = torch.randn(2, 1, 16, generator=g)
    args = (q, kc, vc, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 2, 2], dtype=torch.int32),
            torch.tensor([5, 0], dtype=torch.int32), 2, 0.25, True, None, None)
    out = nan_like(q)
    cpu.prefill_attention(out, *args)
    ref = torch.empty(q.shape, dtype=torch.float64)
    reference.prefill_attention(ref, q.double(), *args[1:])
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_empty_sequences_between_others(threads, num_threads, dtype):
    # Empty sequences first, in the middle and last, next to short and long ones; the long
    # one pushes the call over the threading threshold (and into split KV with 2 threads).
    case = make_case([0, 37, 0, 900, 5, 0], [0, 4, 0, 3, 5, 0], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=dtype, seed=3)
    out = nan_like(case.query)
    threads(num_threads)
    cpu.prefill_attention(*case.prefill_args(out))
    assert_close(out, case.reference_prefill(), dtype)


# -- 2. zero KV heads ----------------------------------------------------------------------------
# Validation rejects 0 heads; the kernels must not divide by zero when called directly anyway.

def test_reshape_and_cache_kernel_with_zero_kv_heads():
    k = torch.randn(3, 0, 16)
    c = torch.zeros(4, 4, 0, 16)
    torch.ops.paged_cpu.reshape_and_cache(k, k, c, c.clone(), torch.tensor([0, 1, 2]), None, None)


def test_attention_kernels_with_zero_heads():
    kc = torch.zeros(4, 4, 0, 16)
    q = torch.empty(2, 0, 16)
    table, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    torch.ops.paged_cpu.decode_attention(torch.empty_like(q), q, kc, kc, table, lens, 0.25, None, None)
    torch.ops.paged_cpu.prefill_attention(torch.empty_like(q), q, kc, kc, table, torch.tensor([0, 1, 2], dtype=torch.int32),
                                          lens, 1, 0.25, True, None, None)


# -- 3. sizes past int32 -------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_block_size_past_int32(op):
    # Two blocks of 2^32 + 16 tokens each, every token of a block the same row (stride 0).
    # Narrowed to int, block_size became 16: position 16 of sequence 0 then read table entry 1,
    # which is sequence 1's block. Called on the kernel directly: whether validation accepts such
    # a size is the op's business; the kernel must address it right.
    block_size = 2**32 + 16
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(2, 1, 1, 8, generator=g).expand(2, block_size, 1, 8)
    vc = torch.randn(2, 1, 1, 8, generator=g).expand(2, block_size, 1, 8)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    q = torch.randn(2, 2, 8, generator=g)
    out = nan_like(q)
    if op == "decode":
        torch.ops.paged_cpu.decode_attention(out, q, kc, vc, table, lens, 0.3, None, None)
    else:
        torch.ops.paged_cpu.prefill_attention(out, q, kc, vc, table, torch.tensor([0, 1, 2], dtype=torch.int32),
                                              lens, 1, 0.3, True, None, None)
    expected = torch.empty(q.shape, dtype=torch.float64)
    reference.decode_attention(expected, q.double(), kc, vc, table, lens, 0.3)
    assert_close(out, expected, torch.float32)


# -- 4. long contexts ----------------------------------------------------------------------------

def repeated_context(seq_len, block_size, num_real_blocks, head_size, num_heads, seed):
    """A cache of a few random blocks, a table that cycles through them for seq_len tokens, a query,
    and the exact float64 answer. seq_len is a multiple of num_real_blocks * block_size."""
    assert seq_len % (num_real_blocks * block_size) == 0
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_real_blocks, block_size, 1, head_size, generator=g)
    vc = torch.randn(num_real_blocks, block_size, 1, head_size, generator=g) + 0.5  # answer far from 0
    table = torch.arange(seq_len // block_size, dtype=torch.int64).remainder(num_real_blocks)
    table = table.to(torch.int32).unsqueeze(0)
    query = torch.randn(1, num_heads, head_size, generator=g)
    scale = head_size ** -0.5
    expected = torch.empty(query.shape, dtype=torch.float64)
    one_copy = num_real_blocks * block_size
    reference.decode_attention(expected, query.double(), kc, vc, table[:, :num_real_blocks],
                               torch.tensor([one_copy], dtype=torch.int32), scale)
    return (query, kc, vc, table, torch.tensor([seq_len], dtype=torch.int32), scale), expected


@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_1e8_tokens_exact_answer(threads, num_threads):
    # 10^8 tokens (1.25e8: a multiple of the repeated 64-token pattern), one query head over one KV
    # head of size 8. fp32 running sums stalled at 2^24 and gave errors of percents here; the
    # error must not grow with length: within 1e-6 of the exact answer, as for short contexts.
    args, expected = repeated_context(125_000_000, 16, 4, 8, 1, seed=11)
    out = nan_like(args[0])
    threads(num_threads)
    cpu.decode_attention(out, *args, None, None)
    err = rel_err(out, expected)
    assert err <= 1e-6, f"relative error {err:.3g} at 1.25e8 tokens with {num_threads} thread(s)"


@pytest.mark.parametrize("num_threads,seq_len", [(1, 2**30 + 2**17), (2, 2**31 - 2**17)])
def test_decode_past_2_30_tokens(threads, num_threads, seq_len):
    # The planner computed kv_len + per_split in int: past 2^30 tokens (one thread, one split)
    # or ~1.9e9 (two threads, 8 splits) it planned no task and returned with out unwritten.
    # Large blocks keep the table small; two real blocks of 2^16 tokens repeat.
    args, expected = repeated_context(seq_len, 2**16, 2, 8, 1, seed=12)
    out = nan_like(args[0])
    threads(num_threads)
    cpu.decode_attention(out, *args, None, None)
    assert not math.isnan(rel_err(out, expected)), "out was left unwritten (NaN poison)"
    err = rel_err(out, expected)
    assert err <= 1e-6, f"relative error {err:.3g} at {seq_len} tokens with {num_threads} thread(s)"

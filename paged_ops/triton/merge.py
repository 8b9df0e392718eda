"""merge_attention_states and merge_states: attention over disjoint key sets from attention over
each (cascade / shared-prefix attention, split contexts), as paged_ops.reference defines them.

Grid: (token, head block). Memory bound: a program merges HEADS_PER_PROGRAM (token, head) rows,
reading each state's row and lse once. In fp32, relative to m = max of the lses:
out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m), out_lse = m + ln(sum).
NaN/inf as the reference: a state with lse -inf contributes nothing, even a NaN out; all -inf
(or no state at all) give out 0 and lse -inf (m is taken as 0 then, and the empty sum's row is
0, not 0 / 0); a +inf or NaN lse makes the row NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard, next_pow2, round_bf16
from ._tiles import store_rows


@triton.jit
def _merge_kernel(out_ptr, out_lse_ptr, prefix_ptr, prefix_lse_ptr, suffix_ptr, suffix_lse_ptr, num_heads,
                  o_stride_token, o_stride_head, p_stride_token, p_stride_head, s_stride_token, s_stride_head,
                  HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                  WRITE_LSE: tl.constexpr, ROUND_BF16: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_mask = heads < num_heads
    heads = heads.to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    mask = head_mask[:, None] & (dims < HEAD_SIZE)[None, :]
    # lses: [num_tokens, num_heads] contiguous
    a = tl.load(prefix_lse_ptr + token * num_heads + heads, mask=head_mask, other=0.0)
    b = tl.load(suffix_lse_ptr + token * num_heads + heads, mask=head_mask, other=0.0)
    # Not tl.maximum: which operand it returns for a NaN differs between Triton versions. With a
    # comparison, a NaN a gives m = b and a NaN b gives m = NaN; either way a weight is NaN.
    m = tl.where(a > b, a, b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both -inf: weights 0 and 0, ln 0 = -inf
    wa = tl.exp(a - m)
    wb = tl.exp(b - m)
    total = wa + wb
    x = tl.load(prefix_ptr + token * p_stride_token + heads[:, None] * p_stride_head + dims[None, :],
                mask=mask, other=0.0).to(tl.float32)
    y = tl.load(suffix_ptr + token * s_stride_token + heads[:, None] * s_stride_head + dims[None, :],
                mask=mask, other=0.0).to(tl.float32)
    # A side at -inf contributes nothing, even a NaN out (what attention over no keys leaves).
    x = tl.where((a == float("-inf"))[:, None], 0.0, wa[:, None] * x)
    y = tl.where((b == float("-inf"))[:, None], 0.0, wb[:, None] * y)
    # total is 0 only when both sides are -inf: an empty row, out 0 (not 0 * 1/0).
    merged = (x + y) * tl.where(total == 0.0, 0.0, 1.0 / total)[:, None]
    store_rows(out_ptr + token * o_stride_token + heads[:, None] * o_stride_head + dims[None, :], merged, mask,
               ROUND_BF16)
    if WRITE_LSE:
        tl.store(out_lse_ptr + token * num_heads + heads, m + tl.log(total), mask=head_mask)


def merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """out, prefix_out, suffix_out: [num_tokens, num_heads, head_size] (one float dtype, last dim
    contiguous); prefix_lse, suffix_lse, out_lse (optional): float32 [num_tokens, num_heads],
    contiguous. See paged_ops.reference.merge_attention_states."""
    num_tokens, num_heads, head_size = out.shape
    if num_tokens == 0 or num_heads == 0:
        return
    head_pad = next_pow2(head_size)
    # ~1024 elements a program: a whole row of 256 wide heads, or several narrow heads.
    heads_per_program = min(next_pow2(num_heads), max(1, 1024 // head_pad))
    grid = (num_tokens, triton.cdiv(num_heads, heads_per_program))
    with device_guard(out):
        _merge_kernel[grid](
            out, out if out_lse is None else out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse, num_heads,
            out.stride(0), out.stride(1), prefix_out.stride(0), prefix_out.stride(1),
            suffix_out.stride(0), suffix_out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, HEADS_PER_PROGRAM=heads_per_program,
            WRITE_LSE=out_lse is not None, ROUND_BF16=round_bf16(out.dtype), num_warps=4)


@triton.jit(do_not_specialize=["num_states", "num_heads", "o_stride_token", "o_stride_head", "s_stride_token",
                               "s_stride_state", "s_stride_head", "l_stride_token", "l_stride_state",
                               "l_stride_head"])
def _merge_states_kernel(out_ptr, out_lse_ptr, states_ptr, states_lse_ptr, num_states, num_heads,
                         o_stride_token, o_stride_head, s_stride_token, s_stride_state, s_stride_head,
                         l_stride_token, l_stride_state, l_stride_head,
                         HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                         WRITE_LSE: tl.constexpr, ROUND_BF16: tl.constexpr):
    # Two passes over the states' lses (the max, then the weights) and one over their rows: every
    # weight relative to the final max, so no running rescale of the accumulator.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_mask = heads < num_heads
    heads = heads.to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    mask = head_mask[:, None] & (dims < HEAD_SIZE)[None, :]
    lse_rows = states_lse_ptr + token * l_stride_token + heads * l_stride_head
    state_rows = states_ptr + token * s_stride_token + heads[:, None] * s_stride_head + dims[None, :]
    m = tl.full([HEADS_PER_PROGRAM], float("-inf"), tl.float32)
    for i in range(0, num_states):
        lse = tl.load(lse_rows + i * l_stride_state, mask=head_mask, other=float("-inf"))
        m = tl.where(lse > m, lse, m)  # a NaN lse is skipped here and poisons its weight below
    m = tl.where(m == float("-inf"), 0.0, m)  # every state -inf (or none): weights 0, ln 0 = -inf
    total = tl.zeros([HEADS_PER_PROGRAM], tl.float32)
    acc = tl.zeros([HEADS_PER_PROGRAM, HEAD_PAD], tl.float32)
    for i in range(0, num_states):
        lse = tl.load(lse_rows + i * l_stride_state, mask=head_mask, other=float("-inf"))
        w = tl.exp(lse - m)  # +inf lse: exp(inf - inf) = NaN, a NaN row as specified
        total += w
        x = tl.load(state_rows + i * s_stride_state, mask=mask, other=0.0).to(tl.float32)
        # A state at -inf contributes nothing, even a NaN out (attention over no keys).
        acc += tl.where((lse == float("-inf"))[:, None], 0.0, w[:, None] * x)
    merged = acc * tl.where(total == 0.0, 0.0, 1.0 / total)[:, None]
    store_rows(out_ptr + token * o_stride_token + heads[:, None] * o_stride_head + dims[None, :], merged, mask,
               ROUND_BF16)
    if WRITE_LSE:
        tl.store(out_lse_ptr + token * num_heads + heads, m + tl.log(total), mask=head_mask)


def merge_states(out, out_lse, states, states_lse) -> None:
    """N-way merge (FlashInfer's merge_states). out: [num_tokens, num_heads, head_size] (float32,
    float16 or bfloat16, last dim contiguous); out_lse (optional): float32 [num_tokens, num_heads],
    contiguous; states: [num_tokens, num_states, num_heads, head_size] of out's dtype, last dim
    contiguous; states_lse: float32 [num_tokens, num_states, num_heads], any strides.
    See paged_ops.reference.merge_states."""
    num_tokens, num_heads, head_size = out.shape
    num_states = states.shape[1]
    if num_tokens == 0 or num_heads == 0:
        return
    head_pad = next_pow2(head_size)
    heads_per_program = min(next_pow2(num_heads), max(1, 1024 // head_pad))
    grid = (num_tokens, triton.cdiv(num_heads, heads_per_program))
    with device_guard(out):
        _merge_states_kernel[grid](
            out, out if out_lse is None else out_lse, states, states_lse, num_states, num_heads,
            out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2),
            states_lse.stride(0), states_lse.stride(1), states_lse.stride(2),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, HEADS_PER_PROGRAM=heads_per_program,
            WRITE_LSE=out_lse is not None, ROUND_BF16=round_bf16(out.dtype), num_warps=4)

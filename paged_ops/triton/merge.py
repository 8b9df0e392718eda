"""merge_attention_states: attention over two disjoint key sets from attention over each
(cascade / shared-prefix attention, split contexts), as paged_ops.reference defines it.

Grid: (token, head block). Memory bound: a program merges HEADS_PER_PROGRAM (token, head) rows,
reading each side's row and lse once. In fp32, relative to m = max(a, b) of the two lses:
out = (e^(a-m) prefix_out + e^(b-m) suffix_out) / (e^(a-m) + e^(b-m)), out_lse = m + ln(sum).
NaN/inf as the reference: a side with lse -inf contributes nothing, even a NaN out (attention
over no keys leaves one); both -inf give a NaN row (0 / 0) and lse -inf (m is taken as 0 then);
a +inf or NaN lse makes the row NaN.
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
    m = tl.where(m == float("-inf"), 0.0, m)  # both -inf: weights 0 and 0, 0 / 0 = NaN, ln 0 = -inf
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
    merged = (x + y) * (1.0 / total)[:, None]
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

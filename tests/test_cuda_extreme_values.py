"""The CUDA kernels (csrc/kernels), run by the emulator (cuda_emu), at the extremes of their values
and sizes: fp8 K/V past fp16's range, non-finite queries, launch hints and windows past int32 / at
the int64 maximum, block sizes past int32, a merge side over no keys.

Each test failed before its fix (issue #11 "Wrong results", issue #12 item 5):
  * the tensor-core prefill staged dequantized fp8 K/V as fp16, so K or V beyond 65504 after the
    scale became inf and the scores NaN;
  * max_seqlen_q was narrowed to int and sized the grid: a max_seqlen_q smaller than a real q_len
    (or one past 2^31) left query rows unwritten;
  * prefill turned a NaN or inf query row into zeros (fmaxf drops NaN, then `l > 0 ? 1 / l : 0`);
  * decode's plan sized a windowed row's partitions by window_left + 1, which wraps for
    window_left = 2^63 - 1 ("no window" spelled as the int64 maximum): in the batch-invariant mode
    (always split) the row got one 256-token partition and lost the rest of its keys;
  * merge_attention_states multiplied a -inf side's out by its weight 0: that out is NaN after
    attention over no keys, so the merged row was NaN instead of the other side.
The same kernels run on a GPU (tests/test_cuda_gpu.py); the emulator runs them on CPU tensors.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

emu = paged_ops.backend("cuda_emu")


def _refill_fp8(case, seq_lens, block_size, k_mag, v_mag, k_scale, v_scale, seed=0):
    """Rewrite the live tokens of an fp8 case with K/V of magnitude ~k_mag/v_mag under new scales."""
    g = torch.Generator().manual_seed(seed)
    case.k_scale = torch.tensor([k_scale], dtype=torch.float32)
    case.v_scale = torch.tensor([v_scale], dtype=torch.float32)
    kv_heads, head_size = case.key_cache.shape[2], case.key_cache.shape[3]
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = case.block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, kv_heads, head_size, generator=g) * k_mag
        v = torch.randn(n, kv_heads, head_size, generator=g) * v_mag
        reference.reshape_and_cache(k.to(case.dtype), v.to(case.dtype), case.key_cache, case.value_cache, slots,
                                    case.k_scale, case.v_scale)


# e5m2 holds up to 57344 and e4m3fn up to 448: with these scales most live K/V values exceed fp16's
# 65504 once scaled (e5m2 x 2 reaches 114688, e4m3fn x 300 reaches 134400), which the fp32 scores
# and outputs hold exactly.
@pytest.mark.parametrize("cache_dtype,k_scale,v_scale,mag", [
    (torch.float8_e5m2, 2.0, 2.0, 1.0e5), (torch.float8_e4m3fn, 300.0, 300.0, 1.0e5),
    (torch.float8_e5m2, 2.0, 0.5, 1.0e5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_tensor_cores_fp8_beyond_fp16_range(dtype, cache_dtype, k_scale, v_scale, mag):
    seq_lens, q_lens, bs = [70, 33], [70, 5], 16
    case = make_case(seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=bs,
                     dtype=torch.float16, cache_dtype=cache_dtype, seed=3)
    case.dtype = dtype
    case.query = case.query.to(dtype)
    _refill_fp8(case, seq_lens, bs, mag, mag / 8, k_scale, v_scale)
    case.scale = 0.1 / mag  # scores of order 1: a smooth softmax, not one-hot
    out = nan_like(case.query)
    emu.prefill_attention(*case.prefill_args(out))  # fp16/bf16 queries: the tensor-core kernel by default
    assert_close(out, case.reference_prefill(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # CUDA-core and tensor-core kernels
@pytest.mark.parametrize("max_seqlen_q", [1, 7, 2**32 + 1, 2**40])
def test_prefill_every_row_computed_whatever_max_seqlen_q(dtype, max_seqlen_q):
    # max_seqlen_q is a launch hint: rows past it (too small a hint) or a hint past int32 must not
    # leave rows unwritten. Called on the backend's own op, which trusts its caller (no validation).
    case = make_case([90, 40, 3], q_lens=[90, 1, 3], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=11)
    out = nan_like(case.query)
    args = list(case.prefill_args(out))
    args[7] = max_seqlen_q
    torch.ops.paged_cuda_emu.prefill_attention(*args)
    assert_close(out, case.reference_prefill(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_prefill_nonfinite_query_row_is_nan_like_reference(dtype, bad):
    case = make_case([40, 20], q_lens=[40, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=5)
    case.query[3, 1, :] = bad       # every dim of one head of one row
    case.query[45, 2, 7] = bad      # a single dim of another row
    out = nan_like(case.query)
    emu.prefill_attention(*case.prefill_args(out))
    ref = case.reference_prefill()
    nan_ref = torch.isnan(ref)
    assert nan_ref.any(), "the reference gives NaN for these rows"
    assert torch.equal(torch.isnan(out), nan_ref), "NaN rows differ from the reference's"
    assert_close(out[~nan_ref], ref[~nan_ref], dtype)


# ---- sizes past the kernels' 32-bit index are rejected, not narrowed (issue #12 item 3) -----------

def test_backend_op_rejects_block_size_past_int32():
    # The backend's own op (no public validation in front): a stride-0 view with 2^32 + 16 slots per
    # block used to be narrowed to 16 and read/written past the tensor.
    kc = torch.ones(1, 1, 1, 8).expand(1, 2**32 + 16, 1, 8)
    q = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="block_size"):
        torch.ops.paged_cuda_emu.decode_attention(torch.empty_like(q), q, kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                                                  torch.ones(1, dtype=torch.int32), 1.0, None, None)
    with pytest.raises(ValueError, match="block_size"):
        torch.ops.paged_cuda_emu.reshape_and_cache(q, q, kc, kc, torch.zeros(1, dtype=torch.int64), None, None)


@pytest.mark.parametrize("window_left", [2**63 - 1, 2**62])
def test_window_past_int64_range_in_batch_invariant_decode(window_left):
    case = make_case([700, 30], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32, seed=1)
    out = nan_like(case.query)
    emu.decode_attention(*case.decode_args(out), window_left=window_left, batch_invariant=True)
    assert_close(out, case.reference_prefill(), case.dtype)  # a window past every length is no window


def test_merge_ignores_the_out_of_a_side_at_minus_inf():
    g = torch.Generator().manual_seed(0)
    prefix_out, suffix_out = torch.randn(2, 2, 3, 64, generator=g)  # [num_tokens, num_heads, head_size]
    prefix_lse, suffix_lse = torch.randn(2, 2, 3, generator=g)
    prefix_lse[0], prefix_out[0] = -float("inf"), float("nan")  # attention over no keys: lse -inf, out NaN
    suffix_lse[1, 2], suffix_out[1, 2] = -float("inf"), float("nan")
    out, out_lse = nan_like(prefix_out), torch.full_like(prefix_lse, float("nan"))
    emu.merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)
    assert torch.equal(out[0], suffix_out[0]) and torch.equal(out_lse[0], suffix_lse[0])
    assert torch.equal(out[1, 2], prefix_out[1, 2]) and torch.equal(out_lse[1, 2], prefix_lse[1, 2])

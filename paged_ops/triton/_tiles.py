"""Device helpers shared by the decode and prefill kernels."""
import triton
import triton.language as tl


# fp8 cache formats (constexpr FP8_FORMAT); caches in these formats are passed as uint8 views.
FP8_NONE = tl.constexpr(0)
FP8_E4M3 = tl.constexpr(1)
FP8_E5M2 = tl.constexpr(2)


@triton.jit
def fp8_bits_to_float(x, FP8_FORMAT: tl.constexpr):
    """Exact fp32 value of fp8 bits (uint8), without Triton's fp8 types.

    Triton lacks e4m3fn on pre-Hopper GPUs, so the cache bytes are decoded by hand: e5m2 is
    the top byte of an fp16; e4m3fn's bits shifted into fp16 position are the value / 2^8
    (fp16's exponent bias is 8 larger), subnormals included. Both are exact. fp8 NaN/inf are
    not special-cased: stored values come from a saturating cast, and unused slots are masked.
    """
    x = x.to(tl.uint16)
    if FP8_FORMAT == FP8_E5M2:
        return (x << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        half = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * 256.0


@triton.jit
def locate_tokens(table_row_ptr, pos, valid, KV_BLOCK_SIZE: tl.constexpr):
    """(block id, offset in block) of token positions ``pos`` [BLOCK_N], via the block table.

    Per-token lookup, so any block size works (1, 3, 256...); KV_BLOCK_SIZE is a constexpr so
    the division is a shift for powers of two. Entries past seq_len may be garbage: invalid
    positions read no table entry and get block 0 (their K/V loads are masked anyway).
    """
    block_ids = tl.load(table_row_ptr + pos // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_ids, (pos % KV_BLOCK_SIZE).to(tl.int64)


@triton.jit
def load_kv_tile(cache_ptr, block_ids, offsets, valid, kv_head, dims, dim_mask,
                 stride_b, stride_t, stride_h, FP8_FORMAT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """K or V rows of the located tokens: [BLOCK_N, HEAD_PAD] in COMPUTE_DTYPE.

    block_ids, offsets, valid: [BLOCK_N]; dims, dim_mask: [HEAD_PAD]. Invalid rows and padded
    columns load 0 without touching memory: unused cache slots may hold NaN.
    """
    rows = block_ids * stride_b + offsets * stride_t + kv_head * stride_h
    tile = tl.load(cache_ptr + rows[:, None] + dims[None, :],
                   mask=valid[:, None] & dim_mask[None, :], other=0)
    if FP8_FORMAT != FP8_NONE:
        tile = fp8_bits_to_float(tile, FP8_FORMAT)
    return tile.to(COMPUTE_DTYPE)


@triton.jit
def online_softmax_step(q, k, v, s_mask, m_i, l_i, acc, qk_scale,
                        COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One flash-attention step over a KV tile, in base 2.

    q: [BLOCK_M, HEAD_PAD], k/v: [BLOCK_N, HEAD_PAD], s_mask: [BLOCK_M, BLOCK_N] (visible);
    m_i, l_i: [BLOCK_M] running max / sum; acc: [BLOCK_M, HEAD_PAD] fp32.
    Every row must see at least one position in its first tile so m_i is finite after it:
    then hidden positions get p = exp2(-inf) = 0 exactly, and v is 0 (not NaN) there.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_scale(scale_ptr, kv_head, PER_HEAD: tl.constexpr):
    """Dequantization scale of one KV head (1.0 is passed for non-fp8 caches)."""
    if PER_HEAD:
        return tl.load(scale_ptr + kv_head)
    else:
        return tl.load(scale_ptr)

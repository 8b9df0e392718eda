"""Cache-writing ops: ``reshape_and_cache`` (with fused fp8 quantization), MLA's
``concat_and_cache_mla`` (the same kernel on the latent cache's two column ranges),
``copy_blocks``, ``swap_blocks``."""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._common import device_guard, is_fp8, next_pow2, scale_arg
from .fp8 import FP8_FORMATS, saturating_fp8_bits


@triton.jit
def _write_one(src_ptr, cache_ptr, scale_ptr, token, slot_block, slot_offset, heads, dims, head_mask, mask,
               src_stride_token, src_stride_head,
               cache_stride_block, cache_stride_token, cache_stride_head,
               QUANTIZE: tl.constexpr, PER_HEAD_SCALE: tl.constexpr,
               FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    # heads (int64: heads * stride never wraps), head_mask: [BLOCK_H, 1]; dims: [1, HEAD_PAD];
    # mask: [BLOCK_H, HEAD_PAD]
    x = tl.load(src_ptr + token * src_stride_token + heads * src_stride_head + dims, mask=mask, other=0.0)
    dst = (cache_ptr + slot_block * cache_stride_block + slot_offset * cache_stride_token
           + heads * cache_stride_head + dims)
    if QUANTIZE:
        if PER_HEAD_SCALE:
            scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)  # [BLOCK_H, 1]
        else:
            scale = tl.load(scale_ptr)
        y = tl.math.div_rn(x.to(tl.float32), scale)  # the contract asks for a true division
        tl.store(dst, saturating_fp8_bits(y, FP8_MAX, MANT, BIAS), mask=mask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
        key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
        k_scale_ptr, v_scale_ptr,
        num_kv_heads, block_size,
        key_stride_token, key_stride_head, value_stride_token, value_stride_head,
        k_stride_block, k_stride_token, k_stride_head,
        v_stride_block, v_stride_token, v_stride_head,
        QUANTIZE: tl.constexpr, K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,
        FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
        HEAD_SIZE: tl.constexpr, VALUE_HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr):
    # One program: one token, BLOCK_H of its KV heads, the whole head (padded to HEAD_PAD, the
    # wider of K's and V's). The head sizes are constexpr so the column masks are known at
    # compile time (vectorized rows).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token: nothing to cache
        return
    slot_block = slot // block_size
    slot_offset = slot % block_size
    # int64: in a head-major cache of a few G elements, heads * cache_stride_head passes 2^31.
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    head_mask = heads < num_kv_heads
    mask = head_mask & (dims < HEAD_SIZE)
    value_mask = head_mask & (dims < VALUE_HEAD_SIZE)
    _write_one(key_ptr, key_cache_ptr, k_scale_ptr, token, slot_block, slot_offset, heads, dims, head_mask, mask,
               key_stride_token, key_stride_head, k_stride_block, k_stride_token, k_stride_head,
               QUANTIZE, K_PER_HEAD, FP8_MAX, MANT, BIAS)
    _write_one(value_ptr, value_cache_ptr, v_scale_ptr, token, slot_block, slot_offset, heads, dims, head_mask,
               value_mask,
               value_stride_token, value_stride_head, v_stride_block, v_stride_token, v_stride_head,
               QUANTIZE, V_PER_HEAD, FP8_MAX, MANT, BIAS)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter new tokens' K/V into their cache slots; fp8 caches get ``saturate(x / scale)``.

    key, value: [num_tokens, num_kv_heads, head_size] (value's head size may differ: MLA)
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] (any strides)
    slot_mapping: [num_tokens] int64, negative = skip
    """
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = key_cache.shape[1]
    quantize = is_fp8(key_cache.dtype)
    fp8_max, mant, bias = FP8_FORMATS.get(key_cache.dtype, (0.0, 0, 0))
    # Per tensor or per KV head (no sequences here), K and V each their own form.
    k_scale_t, _, k_head_stride = scale_arg(k_scale, key)
    v_scale_t, _, v_head_stride = scale_arg(v_scale, key)
    k_per_head, v_per_head = k_head_stride != 0, v_head_stride != 0
    # fp8 bits are produced by integer rounding and stored through a byte view.
    kc = key_cache.view(torch.uint8) if quantize else key_cache
    vc = value_cache.view(torch.uint8) if quantize else value_cache

    value_head_size = value.shape[2]
    head_pad = next_pow2(max(head_size, value_head_size))
    # A few thousand elements per program: enough work per program, bounded registers.
    block_h = min(next_pow2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    with device_guard(key):
        _reshape_and_cache_kernel[grid](
            key, value, kc, vc, slot_mapping, k_scale_t, v_scale_t,
            num_kv_heads, block_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            QUANTIZE=quantize, K_PER_HEAD=k_per_head, V_PER_HEAD=v_per_head,
            FP8_MAX=fp8_max, MANT=mant, BIAS=bias,
            HEAD_SIZE=head_size, VALUE_HEAD_SIZE=value_head_size, BLOCK_H=block_h, HEAD_PAD=head_pad)


def concat_and_cache_mla(latent, rope, latent_cache, slot_mapping, scale=None) -> None:
    """MLA's latent cache write: latent [num_tokens, kv_lora_rank] and rope [num_tokens, rope_dim]
    into the two column ranges of latent_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]:
    reshape_and_cache's one launch, with the latent as K and the RoPE part as V."""
    rank = latent.shape[1]
    reshape_and_cache(latent.unsqueeze(1), rope.unsqueeze(1), latent_cache[..., :rank], latent_cache[..., rank:],
                      slot_mapping, scale, scale)


# ---------------------------------------------------------------------------------------------
# copy_blocks: every layer in one launch through a table of base addresses.

@triton.jit
def _copy_blocks_kernel(base_addr_ptr, block_stride_ptr, block_words_ptr, mapping_ptr,
                        WORD_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    # Grid: (pair, cache, chunk). A block is a dense run of `block_words` words starting at
    # base + id * block_stride (both in words); caches may differ in size and stride.
    pair = tl.program_id(0).to(tl.int64)
    cache = tl.program_id(1)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    block_stride = tl.load(block_stride_ptr + cache)
    block_words = tl.load(block_words_ptr + cache)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_words
    base = tl.load(base_addr_ptr + cache)
    if WORD_BYTES == 8:
        ptr = base.to(tl.pointer_type(tl.int64))
    elif WORD_BYTES == 4:
        ptr = base.to(tl.pointer_type(tl.int32))
    elif WORD_BYTES == 2:
        ptr = base.to(tl.pointer_type(tl.int16))
    else:
        ptr = base.to(tl.pointer_type(tl.int8))
    words = tl.load(ptr + src * block_stride + offs, mask=mask)
    tl.store(ptr + dst * block_stride + offs, words, mask=mask)


def _block_is_dense(cache: torch.Tensor) -> bool:
    """True when cache[b] occupies one gap-free range of memory (NHD, HND, any inner permutation)."""
    dims = sorted(zip(cache.stride()[1:], cache.shape[1:]))
    expected = 1
    for stride, size in dims:
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=64)
def _address_table(device: torch.device, bases: tuple, block_strides: tuple, block_words: tuple) -> torch.Tensor:
    """[3, num_caches] int64 on the device: base addresses, block strides and block sizes (in words).
    Built once per set of caches (an engine's caches live as long as it does): a host-to-device copy
    from pageable memory per call would sync the host with the stream and cannot be captured in a
    CUDA graph. The table is a function of its key alone, so a freed cache's address taken by
    another cache of the same geometry gets the right table."""
    return torch.tensor([bases, block_strides, block_words], dtype=torch.int64).to(device)


def copy_blocks(key_caches: list, value_caches: list, block_mapping: torch.Tensor) -> None:
    """``cache[dst] = cache[src]`` for every (src, dst) row and every layer, in one launch.

    block_mapping: [n, 2] int64 on the caches' device; dst ids are distinct and never a src,
    so the order of the copies does not matter.
    """
    caches = [*key_caches, *value_caches]
    dense = [c for c in caches if _block_is_dense(c)]
    for c in caches:
        if not _block_is_dense(c):  # exotic strides: a gather/scatter per cache is still correct
            c[block_mapping[:, 1]] = c[block_mapping[:, 0]]
    if not dense:
        return
    # Widest word that divides every block's address, size and stride.
    word = 16
    for c in dense:
        word = math.gcd(word, c.data_ptr(), c.stride(0) * c.element_size(),
                        math.prod(c.shape[1:]) * c.element_size())
    word = min(word, 8)
    table = _address_table(dense[0].device, tuple(c.data_ptr() for c in dense),
                           tuple(c.stride(0) * c.element_size() // word for c in dense),
                           tuple(math.prod(c.shape[1:]) * c.element_size() // word for c in dense))
    max_words = max(math.prod(c.shape[1:]) * c.element_size() // word for c in dense)
    block = min(4096, next_pow2(max_words))
    grid = (block_mapping.shape[0], len(dense), triton.cdiv(max_words, block))
    with device_guard(dense[0]):
        _copy_blocks_kernel[grid](table[0], table[1], table[2], block_mapping.contiguous(),
                                  WORD_BYTES=word, BLOCK=block)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[d] = src[s]`` for every (s, d) row; src and dst may live on different devices.

    One gather on the source device, one transfer, one scatter on the destination device:
    this is a bandwidth-bound copy where a custom kernel would buy nothing.
    block_mapping: [n, 2] int64 on CPU.
    """
    # fp8 index kernels are not available everywhere; the bytes are what we move anyway.
    if src.element_size() == 1:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    src_ids = block_mapping[:, 0].to(src.device)
    dst_ids = block_mapping[:, 1].to(dst.device)
    blocks = src.index_select(0, src_ids).to(dst.device)
    dst.index_copy_(0, dst_ids, blocks)

"""Input validation for every op, run before any backend sees the tensors.

Shape, dtype and device checks are free and always run. Checks that read tensor contents
(block ids, slots, copy/swap indices, seq_lens against the block table) always run on CPU
tensors; on CUDA tensors they need a device sync, so they run only with ``PAGED_OPS_CHECK=1``.
Every failure is a ValueError naming the argument, so callers catch one exception type.
"""
from __future__ import annotations

import os

import numpy as np
import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_SIZE = 256


def _fail(msg: str):
    raise ValueError(msg)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        _fail(msg)


def _reads_contents(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or os.environ.get("PAGED_OPS_CHECK", "0") == "1"


def _tensor(name: str, t, ndim: int | None = None, dtypes=None, device=None) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        _check(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        _check(t.dtype in dtypes, f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if device is not None:
        _check(t.device == device, f"{name} is on {t.device} but must be on {device} (like the other tensors)")


def _index_tensor(name: str, t, dtype: torch.dtype, ndim: int, device) -> None:
    _tensor(name, t, ndim, (dtype,), device)
    _check(t.is_contiguous(), f"{name} must be contiguous")


def _unit_stride(name: str, t: torch.Tensor) -> None:
    _check(t.stride(-1) == 1 or t.shape[-1] == 1, f"{name} must be contiguous in its last (head_size) dimension")


def _head_size(name: str, head_size: int) -> None:
    _check(head_size % 8 == 0 and 0 < head_size <= MAX_HEAD_SIZE,
           f"{name}: head_size {head_size} is not supported (must be a multiple of 8, at most {MAX_HEAD_SIZE})")


def _caches(key_cache, value_cache, device=None) -> None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(name, c, 4, FLOAT_DTYPES + FP8_DTYPES, device)
        _unit_stride(name, c)
    _check(key_cache.shape == value_cache.shape,
           f"key_cache shape {tuple(key_cache.shape)} != value_cache shape {tuple(value_cache.shape)}")
    _check(key_cache.dtype == value_cache.dtype,
           f"key_cache dtype {key_cache.dtype} != value_cache dtype {value_cache.dtype}")
    _check(key_cache.device == value_cache.device, "key_cache and value_cache must be on the same device")
    _check(key_cache.shape[1] >= 1, "block_size (key_cache.shape[1]) must be >= 1")
    _head_size("key_cache", key_cache.shape[3])


def _scales(cache_dtype, num_kv_heads: int, device, k_scale, v_scale) -> None:
    if cache_dtype not in FP8_DTYPES:
        _check(k_scale is None and v_scale is None,
               f"k_scale/v_scale are only for fp8 caches; the cache dtype is {cache_dtype}")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check(s is not None, f"{name} is required for an fp8 ({cache_dtype}) cache")
        _tensor(name, s, None, (torch.float32,), device)
        _check(s.is_contiguous(), f"{name} must be contiguous")
        _check(s.numel() in (1, num_kv_heads),
               f"{name} must have 1 (per tensor) or num_kv_heads={num_kv_heads} (per head) elements, got {s.numel()}")
    _check(k_scale.numel() == v_scale.numel(), "k_scale and v_scale must both be per tensor or both per head")


def _query_out(out, query, key_cache, out_name="out") -> None:
    device = key_cache.device
    _tensor("query", query, 3, FLOAT_DTYPES, device)
    _tensor(out_name, out, 3, (query.dtype,), device)
    _check(out.shape == query.shape, f"{out_name} shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    _unit_stride("query", query)
    _unit_stride(out_name, out)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    _check(head_size == key_cache.shape[3],
           f"query head_size {head_size} != key_cache head_size {key_cache.shape[3]}")
    _check(num_heads % num_kv_heads == 0,
           f"query num_heads {num_heads} is not a multiple of the cache's num_kv_heads {num_kv_heads}")
    _check(key_cache.dtype in (query.dtype,) + FP8_DTYPES,
           f"key_cache dtype {key_cache.dtype} must be the query dtype {query.dtype} or an fp8 dtype")


def _block_tables(block_tables, seq_lens, num_seqs: int, num_blocks: int, block_size: int, device) -> None:
    _index_tensor("block_tables", block_tables, torch.int32, 2, device)
    _index_tensor("seq_lens", seq_lens, torch.int32, 1, device)
    _check(block_tables.shape[0] == num_seqs,
           f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} sequences")
    _check(seq_lens.shape[0] == num_seqs, f"seq_lens has {seq_lens.shape[0]} entries but there are {num_seqs} sequences")
    if num_seqs == 0 or not _reads_contents(seq_lens):
        return
    # numpy on the host copies: these run on every call, and a dozen tiny torch ops cost ~100 us.
    lens = seq_lens.cpu().numpy().astype(np.int64)
    _check(bool((lens >= 0).all()), "seq_lens must be >= 0")
    capacity = block_tables.shape[1] * block_size
    _check(int(lens.max()) <= capacity,
           f"seq_lens max {int(lens.max())} exceeds what block_tables covers "
           f"({block_tables.shape[1]} blocks x block_size {block_size} = {capacity})")
    # Only the entries a sequence actually uses must be valid block ids.
    used = np.arange(block_tables.shape[1])[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_tables.cpu().numpy()[used]
    if ids.size:
        _check(int(ids.min()) >= 0 and int(ids.max()) < num_blocks,
               f"block_tables holds a block id outside the cache [0, {num_blocks}): "
               f"min {int(ids.min())}, max {int(ids.max())}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    _caches(key_cache, value_cache)
    device = key_cache.device
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    for name, x in (("key", key), ("value", value)):
        _tensor(name, x, 3, FLOAT_DTYPES, device)
        _unit_stride(name, x)
        _check(x.shape[1:] == key_cache.shape[2:],
               f"{name} is [num_tokens, {x.shape[1]}, {x.shape[2]}] but the cache holds "
               f"[num_kv_heads={num_kv_heads}, head_size={head_size}]")
    _check(key.shape == value.shape, f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    _check(key.dtype == value.dtype, f"key dtype {key.dtype} != value dtype {value.dtype}")
    _check(key_cache.dtype in (key.dtype,) + FP8_DTYPES,
           f"key_cache dtype {key_cache.dtype} must be the key dtype {key.dtype} or an fp8 dtype")
    _index_tensor("slot_mapping", slot_mapping, torch.int64, 1, device)
    _check(slot_mapping.shape[0] == key.shape[0],
           f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    _scales(key_cache.dtype, num_kv_heads, device, k_scale, v_scale)
    if slot_mapping.numel() and _reads_contents(slot_mapping):
        top = int(slot_mapping.max())
        _check(top < num_blocks * block_size,
               f"slot_mapping holds slot {top}, outside the cache ({num_blocks} blocks x {block_size} slots)")


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale) -> None:
    _caches(key_cache, value_cache)
    _query_out(out, query, key_cache)
    _scales(key_cache.dtype, key_cache.shape[2], key_cache.device, k_scale, v_scale)
    _block_tables(block_tables, seq_lens, query.shape[0], key_cache.shape[0], key_cache.shape[1], key_cache.device)
    if query.shape[0] and _reads_contents(seq_lens):
        _check(int(seq_lens.min()) >= 1, "seq_lens must be >= 1 for decode (each query token attends to itself)")


def prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, scale, causal, k_scale, v_scale) -> None:
    _caches(key_cache, value_cache)
    _query_out(out, query, key_cache)
    _scales(key_cache.dtype, key_cache.shape[2], key_cache.device, k_scale, v_scale)
    device = key_cache.device
    _index_tensor("cu_seqlens_q", cu_seqlens_q, torch.int32, 1, device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    _check(num_seqs >= 0, "cu_seqlens_q must have num_seqs + 1 entries")
    _block_tables(block_tables, seq_lens, num_seqs, key_cache.shape[0], key_cache.shape[1], device)
    if not _reads_contents(cu_seqlens_q):
        return
    cu = cu_seqlens_q.cpu().to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    _check(int(cu[0]) == 0 and int(cu[-1]) == query.shape[0],
           f"cu_seqlens_q must start at 0 and end at total_q_tokens={query.shape[0]}, got {int(cu[0])}..{int(cu[-1])}")
    _check(bool((q_lens >= 0).all()), "cu_seqlens_q must be non-decreasing")
    if num_seqs:
        _check(bool((q_lens <= seq_lens.cpu().to(torch.int64)).all()),
               "each sequence's query length (from cu_seqlens_q) must be <= its seq_len: "
               "seq_lens count the new tokens, whose K/V must already be in the cache")
        _check(int(max_seqlen_q) >= int(q_lens.max()),
               f"max_seqlen_q={max_seqlen_q} is smaller than the longest query ({int(q_lens.max())})")


def quantize_fp8(out, input, scale) -> None:
    _tensor("input", input, None, FLOAT_DTYPES)
    _tensor("out", out, None, FP8_DTYPES, input.device)
    _fp8_pair(out, input, scale)


def dequantize_fp8(out, input, scale) -> None:
    _tensor("input", input, None, FP8_DTYPES)
    _tensor("out", out, None, FLOAT_DTYPES, input.device)
    _fp8_pair(out, input, scale)


def _fp8_pair(out, input, scale) -> None:
    _check(out.shape == input.shape, f"out shape {tuple(out.shape)} != input shape {tuple(input.shape)}")
    _check(out.is_contiguous() and input.is_contiguous(), "out and input must be contiguous")
    _tensor("scale", scale, None, (torch.float32,), input.device)
    _check(scale.numel() == 1, f"scale must have exactly 1 element (per-tensor scale), got {scale.numel()}")


def _block_mapping(block_mapping, device, src_blocks: int, dst_blocks: int, distinct_dst: bool) -> None:
    _tensor("block_mapping", block_mapping, 2, (torch.int64,))
    _check(block_mapping.device.type == "cpu" or block_mapping.device == device,
           f"block_mapping must be on the CPU or on {device}, not {block_mapping.device}")
    _check(block_mapping.shape[1] == 2, f"block_mapping must be [n, 2] (src, dst) pairs, got {tuple(block_mapping.shape)}")
    _check(block_mapping.is_contiguous(), "block_mapping must be contiguous")
    if not block_mapping.numel() or not _reads_contents(block_mapping):
        return
    pairs = block_mapping.cpu()
    src, dst = pairs[:, 0], pairs[:, 1]
    _check(bool(((src >= 0) & (src < src_blocks)).all()),
           f"block_mapping source ids must be in [0, {src_blocks}), got {int(src.min())}..{int(src.max())}")
    _check(bool(((dst >= 0) & (dst < dst_blocks)).all()),
           f"block_mapping destination ids must be in [0, {dst_blocks}), got {int(dst.min())}..{int(dst.max())}")
    if distinct_dst:
        _check(dst.unique().numel() == dst.numel(), "block_mapping destination ids must be distinct")
        _check(not bool(torch.isin(dst, src).any()), "block_mapping destination ids must not also be sources")


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    _check(isinstance(key_caches, (list, tuple)) and isinstance(value_caches, (list, tuple)),
           "key_caches and value_caches must be lists of tensors (one per layer)")
    _check(len(key_caches) == len(value_caches),
           f"key_caches has {len(key_caches)} layers but value_caches has {len(value_caches)}")
    _check(len(key_caches) > 0, "key_caches must hold at least one layer")
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        _tensor(f"key_caches[{i}]", k, 4, FLOAT_DTYPES + FP8_DTYPES, key_caches[0].device)
        _tensor(f"value_caches[{i}]", v, 4, FLOAT_DTYPES + FP8_DTYPES, key_caches[0].device)
        _check(k.shape[0] == key_caches[0].shape[0] and v.shape[0] == key_caches[0].shape[0],
               f"layer {i}'s caches have {k.shape[0]}/{v.shape[0]} blocks; every layer needs {key_caches[0].shape[0]}")
        _unit_stride(f"key_caches[{i}]", k)
        _unit_stride(f"value_caches[{i}]", v)
    _block_mapping(block_mapping, key_caches[0].device, key_caches[0].shape[0], key_caches[0].shape[0], True)


def swap_blocks(src, dst, block_mapping) -> None:
    _tensor("src", src, 4, FLOAT_DTYPES + FP8_DTYPES)
    _tensor("dst", dst, 4, (src.dtype,))
    _check(src.shape[1:] == dst.shape[1:],
           f"src blocks {tuple(src.shape[1:])} and dst blocks {tuple(dst.shape[1:])} differ in shape")
    _unit_stride("src", src)
    _unit_stride("dst", dst)
    _tensor("block_mapping", block_mapping, 2, (torch.int64,))
    _check(block_mapping.device.type == "cpu", f"block_mapping must be on the CPU, not {block_mapping.device}")
    _block_mapping(block_mapping, torch.device("cpu"), src.shape[0], dst.shape[0], False)

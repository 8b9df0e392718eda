"""Paged decode attention (one query token per sequence), flash-decoding style.

Grid: (seq, kv_head, split). One program handles a KV head's whole query group: the group's
query heads are packed into the M dimension of ``tl.dot`` (padded to >= 16) so every KV tile
is loaded once per group instead of once per query head. When seqs x kv_heads cannot fill
the GPU, each sequence's KV is cut into ``num_splits`` partitions processed by different
programs; a second kernel merges the partial results by their log-sum-exp.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import autotune
from ._common import (INTERPRET, compute_dtype, device_guard, device_name, dot_precision,
                      fp8_format, head_pad, is_fp8, kv_view, next_pow2, num_sms, round_bf16, row_align, scale_arg,
                      tl_dtype)
from ._tiles import load_kv_tile, load_scale, locate_tokens, online_softmax_step, store_rows

_LOG2E = 1.4426950408889634


# Arguments that change from step to step of a serving engine are not specialized: Triton
# would otherwise compile a variant for each value that is 1 or a multiple of 16 (the table
# width, the split count and the partition size all change with the batch's longest sequence),
# i.e. compile stalls mid-serving and compiles during CUDA-graph capture.
@triton.jit(do_not_specialize=["partition_size", "num_splits", "block_table_stride"])
def _decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, part_out_ptr, part_lse_ptr,
        qk_scale_log2, partition_size, num_splits,
        q_stride_token, q_stride_head, o_stride_token, o_stride_head,
        k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
        block_table_stride,
        GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
        K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr, FP8_FORMAT: tl.constexpr,
        COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
        ROW_ALIGN: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_PAD: tl.constexpr):
    # Shapes are constexpr: masks against HEAD_SIZE then have compile-time constancy, which
    # is what lets Triton vectorize the K/V row loads.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP_SIZE
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    if start >= seq_len:  # partition past this sequence's end: the reducer never reads it
        return
    end = tl.minimum(start + partition_size, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP_SIZE
    # The query heads sharing this KV head; int64 so head * stride never wraps.
    heads = (kv_head * GROUP_SIZE + rows).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE

    # q: [BLOCK_M, HEAD_PAD]; padded rows are 0 and simply never stored.
    q_rows = tl.multiple_of(seq * q_stride_token + heads * q_stride_head, ROW_ALIGN)
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(COMPUTE_DTYPE)
    # fp8 caches: k_scale folds into the score scale, v_scale into the final output.
    qk_scale = qk_scale_log2 * load_scale(k_scale_ptr, kv_head, K_PER_HEAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_tables_ptr + seq * block_table_stride
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_ids, offsets = locate_tokens(table_row, pos, valid, KV_BLOCK_SIZE)
        k = load_kv_tile(k_cache_ptr, block_ids, offsets, valid, kv_head, dims, dim_mask,
                         k_stride_block, k_stride_token, k_stride_head, FP8_FORMAT, COMPUTE_DTYPE, ROW_ALIGN)
        v = load_kv_tile(v_cache_ptr, block_ids, offsets, valid, kv_head, dims, dim_mask,
                         v_stride_block, v_stride_token, v_stride_head, FP8_FORMAT, COMPUTE_DTYPE, ROW_ALIGN)
        m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                            COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16)

    out = acc * (load_scale(v_scale_ptr, kv_head, V_PER_HEAD) / l_i[:, None])
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # part_out: [num_seqs, num_heads, num_splits, head_size] fp32; part_lse: [.., num_splits]
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)
    else:
        out_rows = tl.multiple_of(seq * o_stride_token + heads * o_stride_head, ROW_ALIGN)
        store_rows(out_ptr + out_rows[:, None] + dims[None, :], out, out_mask, ROUND_BF16)


@triton.jit(do_not_specialize=["partition_size", "num_splits"])
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
                          partition_size, num_splits, o_stride_token, o_stride_head,
                          HEAD_SIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
                          SPLIT_CHUNK: tl.constexpr, HEAD_PAD: tl.constexpr):
    # Grid: (seq, head). Merge the partitions that hold tokens, weighted by exp2(lse - max).
    # SPLIT_CHUNK partitions at a time: batch-1 long-context decode uses hundreds of splits,
    # and holding them all ([splits, HEAD_PAD] fp32) spills registers.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size)
    first = (seq * num_heads + head) * num_splits  # part_lse / part_out row of split 0
    chunk = tl.arange(0, SPLIT_CHUNK)
    lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_parts, SPLIT_CHUNK):
        lse = tl.load(part_lse_ptr + first + c + chunk, mask=c + chunk < num_parts, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    m = tl.max(lse_max, 0)
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE
    weight_sum = tl.zeros([SPLIT_CHUNK], tl.float32)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for c in range(0, num_parts, SPLIT_CHUNK):
        splits = first + c + chunk
        split_mask = c + chunk < num_parts
        w = tl.exp2(tl.load(part_lse_ptr + splits, mask=split_mask, other=float("-inf")) - m)
        weight_sum += w
        parts = tl.load(part_out_ptr + splits[:, None] * HEAD_SIZE + dims[None, :],
                        mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(parts * w[:, None], 0)
    store_rows(out_ptr + seq * o_stride_token + head * o_stride_head + dims, acc / tl.sum(weight_sum, 0), dim_mask,
               ROUND_BF16)


# ---------------------------------------------------------------------------------------------
# Host side: configs, split heuristic, launch.

# Partitions merged per step of the reduce kernel (a fixed size: one compiled variant for any
# split count).
REDUCE_SPLIT_CHUNK = 16

# Under the interpreter: one fixed config (no tuning), 32-token tiles keep it quick.
DEFAULT_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}


def default_config(head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> dict:
    """Config used when tuning is off (interpreter, PAGED_OPS_TRITON_AUTOTUNE=0) or finds nothing.

    Chosen from sm_80 and sm_90 ahead-of-time compiles without spills (tests/test_triton_compile.py):
    true-fp32 dots run on FMA units and need smaller tiles or more warps than 16-bit tensor-core
    dots, and decoding fp8 bytes to fp32 operands costs registers on top.
    """
    if INTERPRET:
        return dict(DEFAULT_CONFIG)
    pad = head_pad(head_size)
    if dtype == torch.float32 and cache_dtype is not None and is_fp8(cache_dtype):
        # Pipelining the byte loads (num_stages 2) takes every register and still spills.
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "split_scale": 1.0}
    if dtype == torch.float32 and pad > 64:
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "split_scale": 1.0}
    if pad == 128 and cache_dtype is not None and is_fp8(cache_dtype):
        # fp8 bytes widened to 128-wide 16-bit rows: 64-token tiles spill a few bytes (4 warps on
        # sm_80, 8 warps on sm_90).
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}
    return {"BLOCK_N": 64 if pad <= 128 else 32, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}


def max_len_bound(block_tables: torch.Tensor, block_size: int) -> int:
    """Upper bound on every seq_len known without a device sync (keeps decode graph-capturable)."""
    return max(1, block_tables.shape[1] * block_size)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, block_n: int,
                      sms: int, split_scale: float = 1.0) -> int:
    """Flash-decoding split count: enough programs to cover ~2 waves of SMs, but never a
    partition shorter than one tile (FlashInfer/FA2 use the same occupancy argument)."""
    programs = num_seqs * num_kv_heads
    target = max(1, int(2 * sms * split_scale))
    if programs >= target:
        return 1
    return max(1, min(math.ceil(target / programs), math.ceil(max_len / block_n)))


def partition_for(max_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(partition_size, num_splits): whole tiles per partition, no empty trailing split."""
    partition = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
    return partition, math.ceil(max_len / partition)


def tuning_key(query, key_cache, block_tables) -> tuple:
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = max_len_bound(block_tables, block_size)
    return (block_size, head_size, num_heads, num_kv_heads, next_pow2(max_len),
            next_pow2(num_seqs * num_kv_heads), str(query.dtype), str(key_cache.dtype),
            autotune.cache_layout(key_cache))


def _candidates(head_size: int, dtype: torch.dtype) -> list[dict]:
    # split_scale changes only the grid (no recompilation), so it is cheap to sweep; tile
    # configs that exceed shared memory fail to compile and are skipped by the tuner.
    wide = head_pad(head_size) * (2 if dtype == torch.float32 else 1) > 128
    block_ns = (16, 32, 64) if wide else (32, 64, 128)
    return [{"BLOCK_N": bn, "num_warps": w, "num_stages": st, "split_scale": ss}
            for bn in block_ns for w in (4, 8) for st in (2, 3) for ss in (0.5, 1.0, 2.0)]


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     k_scale=None, v_scale=None, softcap=0.0, window_left=-1, sinks=None,
                     alibi_slopes=None, lse=None, batch_invariant=False) -> None:
    """out[s] = softmax(scale * q[s] K_s^T) V_s over the first seq_lens[s] cached tokens.

    out, query: [num_seqs, num_heads, head_size]; caches: [num_blocks, block_size, num_kv_heads,
    head_size] (any strides); block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32.
    """
    # TODO(#13, triton): the variants in the kernels; until then only the plain call runs here.
    if softcap or window_left >= 0 or sinks is not None or alibi_slopes is not None or lse is not None or batch_invariant:
        raise NotImplementedError("paged_triton: softcap/window_left/sinks/alibi_slopes/lse/batch_invariant "
                                  "not yet implemented")
    key = tuning_key(query, key_cache, block_tables)

    def bench(config):
        return autotune.benchmark_ms(lambda: run_decode(
            out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, config))

    head_size, dtype = query.shape[2], query.dtype
    config = autotune.TUNERS["decode_attention"].choose(
        device_name(query.device), key, default_config(head_size, dtype, key_cache.dtype),
        _candidates(head_size, dtype), bench)
    run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, config)


def config_for(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
               k_scale=None, v_scale=None) -> dict:
    """The config a decode_attention call with these arguments would use, plus its split
    count (``num_splits``); runs and benchmarks nothing."""
    head_size, dtype = query.shape[2], query.dtype
    config = autotune.TUNERS["decode_attention"].lookup(
        device_name(query.device), tuning_key(query, key_cache, block_tables)) or default_config(
            head_size, dtype, key_cache.dtype)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = max_len_bound(block_tables, block_size)
    splits = choose_num_splits(query.shape[0], num_kv_heads, max_len, config["BLOCK_N"],
                               num_sms(query.device), config.get("split_scale", 1.0))
    return dict(config, num_splits=partition_for(max_len, splits, config["BLOCK_N"])[1])


def run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
               k_scale, v_scale, config: dict, num_splits: int | None = None) -> int:
    """Launch with an explicit config; ``num_splits`` forces the split count. Returns the split count used."""
    num_seqs = query.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_n = config["BLOCK_N"]
    max_len = max_len_bound(block_tables, block_size)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_len, block_n,
                                       num_sms(query.device), config.get("split_scale", 1.0))
    partition, num_splits = partition_for(max_len, num_splits, block_n)
    with device_guard(query):
        _launch_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                       config, num_splits, partition)
    return num_splits


def _launch_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                   config, num_splits, partition) -> None:
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    k_scale_t, k_per_head = scale_arg(k_scale, query)
    v_scale_t, v_per_head = scale_arg(v_scale, query)
    cdtype = compute_dtype(query.dtype)
    head_dim_pad = head_pad(head_size)
    split = num_splits > 1
    if split:
        # partials: [num_seqs, num_heads, num_splits, head_size] and their base-2 LSEs
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused: SPLIT=False never touches them
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, query, kv_view(key_cache), kv_view(value_cache), block_tables, seq_lens,
        k_scale_t, v_scale_t, part_out, part_lse,
        scale * _LOG2E, partition, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP_SIZE=group_size, HEAD_SIZE=head_size, KV_BLOCK_SIZE=block_size,
        K_PER_HEAD=k_per_head, V_PER_HEAD=v_per_head, FP8_FORMAT=fp8_format(key_cache.dtype),
        COMPUTE_DTYPE=tl_dtype(cdtype), DOT_PRECISION=dot_precision(cdtype),
        ROUND_BF16=round_bf16(query.dtype),
        ROW_ALIGN=row_align(*query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3],
                            *value_cache.stride()[:3]),
        SPLIT=split,
        BLOCK_M=max(16, next_pow2(group_size)), BLOCK_N=config["BLOCK_N"], HEAD_PAD=head_dim_pad,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, partition, num_splits,
            out.stride(0), out.stride(1), HEAD_SIZE=head_size, ROUND_BF16=round_bf16(query.dtype),
            SPLIT_CHUNK=REDUCE_SPLIT_CHUNK, HEAD_PAD=head_dim_pad, num_warps=4)

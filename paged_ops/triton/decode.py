"""Paged decode attention (one query token per sequence), flash-decoding style.

Grid: (seq, kv_head x head block, split). One program handles a KV head's query group (or, for
groups wider than the accumulator allows, BLOCK_M heads of it: block_rows): the heads are packed
into the M dimension of ``tl.dot`` (padded to >= 16) so every KV tile is loaded once per program
for all the heads it serves instead of once per query head. Absorbed MLA (one latent KV head,
16-128 query heads, value = the latent's first 512 columns) is this with V taken from the K tile
(V_FROM_K): each latent row is read once per program. When seqs x kv_heads cannot fill
the GPU, each sequence's KV is cut into ``num_splits`` partitions processed by different
programs; a second kernel merges the partial results by their log-sum-exp.

Variants (constexpr flags, see _common.Variants): soft-cap and ALiBi on the scores, a sliding
window (partitions cover the window only: keys before it are never read), sinks (one more logit
in the denominator, added once: at the row's end, or in the reduce when split), the lse output.
The batch-invariant mode (run_rows) runs decode and prefill rows alike through this kernel with
VARLEN_ROWS: fixed-size partitions from each row's first visible key, always reduced.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import autotune
from ._common import (INTERPRET, LOG2E, HeadDims, compute_dtype, device_guard, device_name, dot_precision,
                      fp8_format, is_fp8, kv_view, next_pow2, num_sms, round_bf16, row_align, scale_arg,
                      tl_dtype, value_is_key_main, Variants)
from ._tiles import (attend_tiles, finish_and_store, head_dims, join_sink, load_q, load_scale, row_lse, store_rows,
                     visible_keys)

PLAIN = Variants()  # no variant: the plain kernel


@triton.jit
def _find_row_sequence(cu_seqlens_q_ptr, num_seqs, row):
    """The sequence owning query row ``row``: the last s with cu_seqlens_q[s] <= row (sequences
    with no query rows share their cu value with the next one and are skipped)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _row_keys(row, seq_lens_ptr, cu_seqlens_q_ptr, num_seqs, causal, window_left, window_right,
              VARLEN_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """(sequence, position p, first visible key, end of visible keys) of query row ``row``: the
    keys [kv_lo, kv_hi) of visible_keys (empty when kv_lo >= kv_hi).

    Decode (VARLEN_ROWS False): row = sequence, p = seq_len - 1, causal. VARLEN_ROWS
    (batch-invariant mode, decode and prefill alike): rows are prefill rows, p = seq_len - q_len
    + i, ``causal`` the call's (0 or 1); a causal row at p sees keys < p + 1, which makes it the
    decode of a sequence of p + 1 tokens, bit for bit.
    """
    if VARLEN_ROWS:
        seq = _find_row_sequence(cu_seqlens_q_ptr, num_seqs, row).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq)
        pos = seq_len - (tl.load(cu_seqlens_q_ptr + seq + 1) - row)
        kv_lo, last = visible_keys(pos, seq_len, causal != 0, window_left, window_right, HAS_WINDOW,
                                   HAS_WINDOW_RIGHT)
    else:
        seq = row
        seq_len = tl.load(seq_lens_ptr + seq)
        pos = seq_len - 1
        kv_lo, last = visible_keys(pos, seq_len, True, window_left, window_right, HAS_WINDOW, False)
    return seq, pos, kv_lo, last + 1


# Arguments that change from step to step of a serving engine are not specialized: Triton
# would otherwise compile a variant for each value that is 1 or a multiple of 16 (the table
# width, the split count and the partition size all change with the batch's longest sequence),
# i.e. compile stalls mid-serving and compiles during CUDA-graph capture. The same holds for
# the batch size, the window and the causal flag (0 or 1) of the row-wise (batch-invariant) mode.
@triton.jit(do_not_specialize=["partition_size", "num_splits", "block_table_stride", "num_seqs", "row_offset",
                               "causal", "window_left", "window_right", "k_scale_seq_stride",
                               "k_scale_head_stride", "v_scale_seq_stride", "v_scale_head_stride"])
def _decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
        k_scale_ptr, v_scale_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, alibi_slopes_ptr, lse_ptr,
        qk_scale_log2, softcap_log2, inv_softcap, window_left, window_right, partition_size, num_splits, num_seqs,
        row_offset, causal, k_scale_seq_stride, k_scale_head_stride, v_scale_seq_stride, v_scale_head_stride,
        q_stride_token, q_stride_head, o_stride_token, o_stride_head,
        k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
        block_table_stride,
        GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
        FP8_FORMAT: tl.constexpr,
        COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
        ROW_ALIGN: tl.constexpr, SPLIT: tl.constexpr, VARLEN_ROWS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
        WRITE_LSE: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_MAIN: tl.constexpr, HEAD_REST: tl.constexpr,
        VALUE_SIZE: tl.constexpr, VALUE_PAD: tl.constexpr, V_FROM_K: tl.constexpr):
    # Shapes are constexpr: masks against HEAD_SIZE / VALUE_SIZE then have compile-time constancy,
    # which is what lets Triton vectorize the K/V row loads. q and K: HEAD_SIZE columns as the
    # key_split tiles HEAD_MAIN + HEAD_REST; V, out and the partials: VALUE_SIZE (<= HEAD_SIZE).
    HEAD_BLOCKS: tl.constexpr = (GROUP_SIZE + BLOCK_M - 1) // BLOCK_M  # programs per KV head
    local_row = tl.program_id(0).to(tl.int64)  # row within this launch (the partials' index)
    row = row_offset + local_row  # query row: a sequence (decode) or a prefill row (VARLEN_ROWS)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    num_heads = (tl.num_programs(1) // HEAD_BLOCKS) * GROUP_SIZE
    seq, pos_q, kv_lo, kv_hi = _row_keys(row, seq_lens_ptr, cu_seqlens_q_ptr, num_seqs, causal, window_left,
                                         window_right, VARLEN_ROWS, HAS_WINDOW, HAS_WINDOW_RIGHT)
    # Partitions cover the visible keys only: a window skips every block before it. Every key of
    # [start, end) is visible to every row of the program (they are one query token's heads), so
    # a hidden key's K or V is never even loaded (masked loads give 0 past end).
    start = kv_lo + split * partition_size
    if SPLIT:
        if start >= kv_hi:  # partition past this row's keys: the reducer never reads it
            return
    # Unsplit, the one program of a row without keys (seq_len 0) runs no tile and writes out 0,
    # lse -inf (or the sink's): finish_rows.
    end = tl.minimum(start + partition_size, kv_hi)

    in_group = head_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = in_group < GROUP_SIZE
    # The query heads sharing this KV head (this program's block of them); int64 so head *
    # stride never wraps.
    heads = (kv_head * GROUP_SIZE + in_group).to(tl.int64)
    dims = head_dims(HEAD_SIZE, HEAD_MAIN, HEAD_REST, VALUE_SIZE, VALUE_PAD)
    _, _, _, _, v_dims, v_mask = dims

    # q: [BLOCK_M, HEAD_MAIN] (+ [BLOCK_M, HEAD_REST]); padded rows are 0 and simply never stored.
    q_rows = tl.multiple_of(row * q_stride_token + heads * q_stride_head, ROW_ALIGN)
    q = load_q(q_ptr, q_rows, row_mask, dims, COMPUTE_DTYPE, HEAD_REST)
    # fp8 caches: k_scale folds into the score scale, v_scale into the final output.
    qk_scale = qk_scale_log2 * load_scale(k_scale_ptr, seq, kv_head, k_scale_seq_stride, k_scale_head_stride)
    if HAS_ALIBI:  # slope * (j - p) in base 2: [BLOCK_M]
        alibi = tl.load(alibi_slopes_ptr + heads, mask=row_mask, other=0.0) * LOG2E
    else:
        alibi = 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_PAD], tl.float32)
    # Every position of [start, end) is visible to every row (one query token's heads): the fast
    # path, whose first tile is never empty.
    rows_keys = (pos_q + tl.zeros([BLOCK_M], tl.int32), alibi, 0, window_left, window_right, kv_lo, kv_hi)
    kv = (block_tables_ptr + seq * block_table_stride, kv_head, k_cache_ptr, (k_stride_block, k_stride_token,
          k_stride_head), v_cache_ptr, (v_stride_block, v_stride_token, v_stride_head))
    m_i, l_i, acc, _ = attend_tiles(start, end, end, m_i, l_i, acc, 0, q, rows_keys,
                                    (qk_scale, softcap_log2, inv_softcap), kv, dims,
                                    KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16, ROW_ALIGN,
                                    HAS_SOFTCAP, HAS_ALIBI, False, True, HAS_WINDOW, False, BLOCK_N, HEAD_REST,
                                    V_FROM_K)

    out_mask = row_mask[:, None] & v_mask[None, :]
    v_scale = load_scale(v_scale_ptr, seq, kv_head, v_scale_seq_stride, v_scale_head_stride)
    if SPLIT:
        # part_out: [rows, num_heads, num_splits, value_size] fp32; part_lse: [.., num_splits]. The
        # sink joins once, in the reduce. A partition that exists holds keys: l_i >= 1.
        out = acc * (v_scale / l_i[:, None])
        part = (local_row * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * VALUE_SIZE + v_dims[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)
    else:
        # lse: [rows, num_heads] float32, natural log
        out_rows = tl.multiple_of(row * o_stride_token + heads * o_stride_head, ROW_ALIGN)
        finish_and_store(acc, m_i, l_i, v_scale, out_ptr, out_rows, v_dims, out_mask, lse_ptr, row * num_heads + heads,
                         sinks_ptr, heads, row_mask, HAS_SINKS, WRITE_LSE, ROUND_BF16)


@triton.jit(do_not_specialize=["partition_size", "num_splits", "num_seqs", "row_offset", "causal", "window_left",
                               "window_right"])
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, cu_seqlens_q_ptr, sinks_ptr, lse_ptr,
                          window_left, window_right, partition_size, num_splits, num_seqs, row_offset, causal,
                          o_stride_token, o_stride_head,
                          VALUE_SIZE: tl.constexpr, ROUND_BF16: tl.constexpr, VARLEN_ROWS: tl.constexpr,
                          HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr,
                          HAS_WINDOW_RIGHT: tl.constexpr, SPLIT_CHUNK: tl.constexpr, VALUE_PAD: tl.constexpr):
    # Grid: (row, head). Merge the partitions that hold tokens, weighted by exp2(lse - max), in
    # one fixed order for a row (its partition count depends on the row alone).
    # SPLIT_CHUNK partitions at a time: batch-1 long-context decode uses hundreds of splits,
    # and holding them all ([splits, VALUE_PAD] fp32) spills registers.
    local_row = tl.program_id(0).to(tl.int64)
    row = row_offset + local_row
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    _, _, kv_lo, kv_hi = _row_keys(row, seq_lens_ptr, cu_seqlens_q_ptr, num_seqs, causal, window_left,
                                   window_right, VARLEN_ROWS, HAS_WINDOW, HAS_WINDOW_RIGHT)
    num_parts = tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), partition_size)  # 0 for a row without keys
    first = (local_row * num_heads + head) * num_splits  # part_lse / part_out row of split 0
    chunk = tl.arange(0, SPLIT_CHUNK)
    lse_max = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_parts, SPLIT_CHUNK):
        lse = tl.load(part_lse_ptr + first + c + chunk, mask=c + chunk < num_parts, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    m = tl.max(lse_max, 0)
    if HAS_SINKS:  # the sink joins the denominator once, here (finish_rows' rules)
        sink = tl.load(sinks_ptr + head)
        m, w_sink = join_sink(m, sink * LOG2E)
    else:
        sink = 0.0
        # No partition (a row without keys): weights 0, not exp2(-inf - -inf).
        m = tl.where(m == float("-inf"), 0.0, m)
    dims = tl.arange(0, VALUE_PAD)
    dim_mask = dims < VALUE_SIZE
    weight_sum = tl.zeros([SPLIT_CHUNK], tl.float32)
    acc = tl.zeros([VALUE_PAD], tl.float32)
    for c in range(0, num_parts, SPLIT_CHUNK):
        splits = first + c + chunk
        split_mask = c + chunk < num_parts
        w = tl.exp2(tl.load(part_lse_ptr + splits, mask=split_mask, other=float("-inf")) - m)
        weight_sum += w
        parts = tl.load(part_out_ptr + splits[:, None] * VALUE_SIZE + dims[None, :],
                        mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(parts * w[:, None], 0)
    total = tl.sum(weight_sum, 0)
    if HAS_SINKS:
        total += w_sink
    # total 0: no key and no sink weight, out 0 and lse -inf.
    merged = tl.where(total == 0.0, 0.0, acc / total)
    store_rows(out_ptr + row * o_stride_token + head * o_stride_head + dims, merged, dim_mask,
               ROUND_BF16)
    if WRITE_LSE:
        tl.store(lse_ptr + row * num_heads + head, row_lse(m + tl.log2(total), num_parts <= 0, sink, HAS_SINKS))


# ---------------------------------------------------------------------------------------------
# Host side: configs, split heuristic, launch.

# Partitions merged per step of the reduce kernel (a fixed size: one compiled variant for any
# split count).
REDUCE_SPLIT_CHUNK = 16

# Under the interpreter: one fixed config (no tuning), 32-token tiles keep it quick.
DEFAULT_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}


def _plain_default_config(head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                          value_head_size: int | None = None) -> dict:
    """Config used when tuning is off (interpreter, PAGED_OPS_TRITON_AUTOTUNE=0) or finds nothing.

    Chosen from sm_80 and sm_90 ahead-of-time compiles without spills (tests/test_triton_compile.py):
    true-fp32 dots run on FMA units and need smaller tiles or more warps than 16-bit tensor-core
    dots, and decoding fp8 bytes to fp32 operands costs registers on top. Keyed by the wider of
    the K and V tiles (HeadDims.config_pad; head_pad(head_size) when Dk == Dv).
    """
    if INTERPRET:
        return dict(DEFAULT_CONFIG)
    pad = HeadDims(head_size, value_head_size or head_size).config_pad
    fp8_cache = cache_dtype is not None and is_fp8(cache_dtype)
    if pad > 256:
        # MLA's 576-wide latent (512 + 64 tiles) and values up to 576 (a 1024-wide accumulator):
        # fewer keys per tile, 8 warps so the q tile, the K tile and the accumulator spread over
        # more registers (block_rows also caps the heads per program by the value width).
        if dtype == torch.float32:
            return {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1, "split_scale": 1.0}
        return {"BLOCK_N": 16 if fp8_cache else 32, "num_warps": 8, "num_stages": 2, "split_scale": 1.0}
    if dtype == torch.float32 and fp8_cache:
        # Pipelining the byte loads (num_stages 2) takes every register and still spills.
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "split_scale": 1.0}
    if dtype != torch.float32 and not fp8_cache and pad == 256 and (value_head_size or head_size) != head_size:
        # DeepSeek's 192 (128 + 64) / 128 with 4 warps: ptxas held sm_80 at 80 registers and spilled
        # 8 B; 8 warps take 64 (sm_80) / 74 (sm_90), none
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "split_scale": 1.0}
    if dtype == torch.float32 and pad > 64:
        # num_stages 2 spilled 8 B on sm_90 once issue #27's kernel changes were in
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "split_scale": 1.0}
    if pad == 128 and fp8_cache:
        # fp8 bytes widened to 128-wide 16-bit rows: 64-token tiles spill a few bytes (4 warps on
        # sm_80, 8 warps on sm_90).
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}
    # 16-bit 64-wide rows: 64-token tiles spilled 20 B on sm_90 (bf16) with issue #27's finish_rows
    narrow_16bit = pad <= 64 and dtype != torch.float32
    return {"BLOCK_N": 32 if pad > 128 or narrow_16bit else 64, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}


def default_config(head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                   variants: Variants = PLAIN, value_head_size: int | None = None) -> dict:
    """_plain_default_config, with smaller tiles where the variants' per-score work (the cap's
    tanh, ALiBi's bias, the window's mask) made the sm_80/sm_90 compile spill
    (tests/test_triton_compile.py, variant matrix): fp32 rows of 256 spilled 24 B with 32-key
    tiles. A fixed function of the shapes and flags, so the batch-invariant mode may use it.
    value_head_size: Dv (default head_size)."""
    config = _plain_default_config(head_size, dtype, cache_dtype, value_head_size)
    if INTERPRET or not variants.heavy_scores:
        return config
    pad = HeadDims(head_size, value_head_size or head_size).config_pad
    fp8_cache = cache_dtype is not None and is_fp8(cache_dtype)
    if dtype == torch.float32 and not fp8_cache and pad > 128:
        config["BLOCK_N"] = 16
    if dtype == torch.float32 and fp8_cache and pad == 128:
        config["BLOCK_N"] = 16  # 32-key tiles spilled 8 B on sm_90 with every variant on (#27's masking)
    return config


# The fp32 accumulator of one decode program ([BLOCK_M, VALUE_PAD]) is held to this many elements
# per warp (64 registers a thread): a group wider than that is served by several programs.
ACC_ELEMENTS_PER_WARP = 2048


def block_rows(group_size: int, value_pad: int, num_warps: int) -> int:
    """BLOCK_M of the decode kernel: the query heads one program serves (>= 16, tl.dot's M).

    The whole GQA group while its accumulator fits ACC_ELEMENTS_PER_WARP: every K/V tile is then
    read once for all the group's heads. Wider, the group is cut into blocks of this many heads
    (grid axis 1 = KV heads x blocks), each block a program reading the tile once for its
    heads: absorbed MLA's 16 heads x 512 values take one program (4 warps: 16 x 512 = 8192
    elements), its 128 heads 8 programs of 16 (4 warps) or 4 of 32 (8 warps); without the cap a
    128 x 512 fp32 accumulator would be 256 registers a thread at 8 warps and spill. A function of
    the shapes and num_warps only, so the batch-invariant mode's fixed config fixes it too."""
    return min(max(16, next_pow2(group_size)), max(16, ACC_ELEMENTS_PER_WARP * num_warps // value_pad))


def max_len_bound(block_tables: torch.Tensor, block_size: int) -> int:
    """Upper bound on every seq_len known without a device sync (keeps decode graph-capturable)."""
    return max(1, block_tables.shape[1] * block_size)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, block_n: int,
                      sms: int, split_scale: float = 1.0) -> int:
    """Flash-decoding split count: enough programs to cover ~2 waves of SMs, but never a
    partition shorter than one tile (FlashInfer/FA2 use the same occupancy argument).
    num_kv_heads: the programs of one sequence (KV heads x head blocks, block_rows)."""
    programs = num_seqs * num_kv_heads
    target = max(1, int(2 * sms * split_scale))
    if programs >= target:
        return 1
    return max(1, min(math.ceil(target / programs), math.ceil(max_len / block_n)))


def programs_per_sequence(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          config: dict) -> int:
    """Decode programs of one sequence (one split): KV heads x head blocks (block_rows)."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = block_rows(group, HeadDims.of(query, value_cache).value_pad, config["num_warps"])
    return num_kv_heads * math.ceil(group / rows)


def partition_for(max_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(partition_size, num_splits): whole tiles per partition, no empty trailing split."""
    partition = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
    return partition, math.ceil(max_len / partition)


def visible_bound(max_len: int, variants: Variants, causal: bool = True) -> int:
    """Upper bound on the keys one row reads: a causal window holds window_left + 1 keys at most,
    a non-causal one with both edges window_left + 1 + window_right."""
    if variants.has_window and causal:
        return max(1, min(max_len, variants.window_left + 1))
    if variants.has_window and variants.has_window_right:
        return max(1, min(max_len, variants.window_left + 1 + variants.window_right))
    return max_len


def value_key(query, key_cache, value_cache) -> tuple:
    """The part of a tuning key for values of their own head size (MLA): () when Dv == Dk and
    the caches are apart, so those calls keep their stored configs; else ("v<Dv>") and
    "-latent" when V is read from the K tile (value_is_key_main: another kernel)."""
    if value_cache is None:
        return ()
    dims = HeadDims.of(query, value_cache)
    latent = value_is_key_main(key_cache, value_cache, dims)
    if dims.value_size == dims.head_size and not latent:
        return ()
    return (f"v{dims.value_size}" + ("-latent" if latent else ""),)


def tuning_key(query, key_cache, block_tables, variants: Variants = PLAIN, value_cache=None) -> tuple:
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = max_len_bound(block_tables, block_size)
    return (block_size, head_size, num_heads, num_kv_heads, next_pow2(max_len),
            next_pow2(num_seqs * num_kv_heads), str(query.dtype), str(key_cache.dtype),
            autotune.cache_layout(key_cache)) + value_key(query, key_cache, value_cache) + variants.key()


def _candidates(head_size: int, dtype: torch.dtype, value_head_size: int | None = None) -> list[dict]:
    # split_scale changes only the grid (no recompilation), so it is cheap to sweep; tile
    # configs that exceed shared memory fail to compile and are skipped by the tuner.
    pad = HeadDims(head_size, value_head_size or head_size).config_pad
    wide = pad * (2 if dtype == torch.float32 else 1) > 128
    block_ns = (16, 32) if pad > 256 else (16, 32, 64) if wide else (32, 64, 128)
    return [{"BLOCK_N": bn, "num_warps": w, "num_stages": st, "split_scale": ss}
            for bn in block_ns for w in (4, 8) for st in (2, 3) for ss in (0.5, 1.0, 2.0)]


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     k_scale=None, v_scale=None, softcap=0.0, window_left=-1, sinks=None,
                     alibi_slopes=None, lse=None, batch_invariant=False, window_right=-1) -> None:
    """out[s] = softmax(scale * q[s] K_s^T) V_s over the first seq_lens[s] cached tokens, with the
    variants of paged_ops.reference.attention.

    query: [num_seqs, num_heads, head_size]; out: [num_seqs, num_heads, value_head_size]; caches:
    [num_blocks, block_size, num_kv_heads, head_size / value_head_size] (any strides; value_cache
    may be a view into key_cache, as absorbed MLA's key_cache[..., :512]); block_tables:
    [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
    lse: [num_seqs, num_heads] float32. batch_invariant: the row-wise path (run_rows) that prefill
    rows take too, with a fixed config and split size. window_right changes nothing (decode is
    causal: a row stops at its own position). A sequence of 0 tokens gets out 0, lse -inf.
    """
    variants = Variants(float(softcap), int(window_left), sinks, alibi_slopes, lse)  # window_right: no effect
    if batch_invariant:
        # Sequence s is query row s: cu_seqlens_q = 0, 1, ..., num_seqs (built on the device, no sync).
        rows = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        run_rows(out, query, key_cache, value_cache, block_tables, seq_lens, rows, True, scale, k_scale, v_scale,
                 variants)
        return
    key = tuning_key(query, key_cache, block_tables, variants, value_cache)

    def bench(config):
        return autotune.benchmark_ms(lambda: run_decode(
            out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, config,
            variants=variants))

    head_size, dtype, value_size = query.shape[2], query.dtype, value_cache.shape[3]
    config = autotune.TUNERS["decode_attention"].choose(
        device_name(query.device), key, default_config(head_size, dtype, key_cache.dtype, variants, value_size),
        _candidates(head_size, dtype, value_size), bench)
    run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, config,
               variants=variants)


def config_for(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
               k_scale=None, v_scale=None, softcap=0.0, window_left=-1, sinks=None, alibi_slopes=None, lse=None,
               batch_invariant=False, window_right=-1) -> dict:
    """The config a decode_attention call with these arguments would use, plus its split
    count (``num_splits``); runs and benchmarks nothing."""
    variants = Variants(float(softcap), int(window_left), sinks, alibi_slopes, lse)
    head_size, dtype, value_size = query.shape[2], query.dtype, value_cache.shape[3]
    block_size = key_cache.shape[1]
    if batch_invariant:
        config = default_config(head_size, dtype, key_cache.dtype, variants, value_size)
        bound = visible_bound(max_len_bound(block_tables, block_size), variants)
        return dict(config, num_splits=math.ceil(bound / BATCH_INVARIANT_PARTITION))
    config = autotune.TUNERS["decode_attention"].lookup(
        device_name(query.device), tuning_key(query, key_cache, block_tables, variants, value_cache)) or default_config(
            head_size, dtype, key_cache.dtype, variants, value_size)
    max_len = visible_bound(max_len_bound(block_tables, block_size), variants)
    splits = choose_num_splits(query.shape[0], programs_per_sequence(query, key_cache, value_cache, config), max_len,
                               config["BLOCK_N"], num_sms(query.device), config.get("split_scale", 1.0))
    return dict(config, num_splits=partition_for(max_len, splits, config["BLOCK_N"])[1])


def run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
               k_scale, v_scale, config: dict, num_splits: int | None = None, variants: Variants = PLAIN) -> int:
    """Launch with an explicit config; ``num_splits`` forces the split count. Returns the split count used."""
    num_seqs = query.shape[0]
    block_size = key_cache.shape[1]
    block_n = config["BLOCK_N"]
    # Splits are planned over the keys a row can see: with a window, that is the window.
    max_len = visible_bound(max_len_bound(block_tables, block_size), variants)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, programs_per_sequence(query, key_cache, value_cache, config),
                                       max_len, block_n, num_sms(query.device), config.get("split_scale", 1.0))
    partition, num_splits = partition_for(max_len, num_splits, block_n)
    with device_guard(query):
        _launch_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                       config, num_splits, partition, variants)
    return num_splits


# Batch-invariant mode: every row is split into partitions of this many keys (a multiple of every
# BLOCK_N in use), counted from its first visible key, whatever the batch, and always reduced by
# the reduce kernel (even one partition), so a row's bits depend on the row alone.
BATCH_INVARIANT_PARTITION = 256
# Partial results of one launch in the mode ([rows, num_heads, num_splits, value_head_size] fp32)
# are kept under this size by launching the rows in chunks (a long prefill against a long table).
BATCH_INVARIANT_SCRATCH_BYTES = 256 << 20


def run_rows(out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, causal, scale,
             k_scale, v_scale, variants: Variants = PLAIN, config: dict | None = None) -> int:
    """The batch-invariant path of decode and prefill: each query row (token) is one decode-style
    row (_row_keys) over fixed partitions of BATCH_INVARIANT_PARTITION keys, then the reduce.
    The default config of the shapes, never a tuned one (``config`` only for tests). Returns the
    split count of the grid (the rows' own partition counts depend on each row alone)."""
    num_rows, num_heads, head_size = query.shape
    value_size = value_cache.shape[3]
    block_size = key_cache.shape[1]
    variants = variants.for_causal(causal)
    config = config or default_config(head_size, query.dtype, key_cache.dtype, variants, value_size)
    partition = BATCH_INVARIANT_PARTITION
    if partition % config["BLOCK_N"]:
        raise ValueError(f"BLOCK_N {config['BLOCK_N']} must divide the batch-invariant partition {partition}")
    bound = visible_bound(max_len_bound(block_tables, block_size), variants, causal)
    num_splits = math.ceil(bound / partition)
    rows_per_launch = max(1, BATCH_INVARIANT_SCRATCH_BYTES // (num_heads * num_splits * value_size * 4))
    with device_guard(query):
        for row_offset in range(0, num_rows, rows_per_launch):
            _launch_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                           config, num_splits, partition, variants,
                           rows=(cu_seqlens_q, bool(causal), row_offset, min(rows_per_launch, num_rows - row_offset)))
    return num_splits


def _launch_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                   config, num_splits, partition, variants: Variants, rows=None) -> None:
    """rows: None (decode: row = sequence, every row in one launch, split iff num_splits > 1) or
    (cu_seqlens_q, causal, row_offset, num_rows) for the row-wise mode (always split + reduce)."""
    num_heads = query.shape[1]
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    dims = HeadDims.of(query, value_cache)
    block_m = block_rows(group_size, dims.value_pad, config["num_warps"])
    head_blocks = math.ceil(group_size / block_m)
    k_scale_t, k_seq_stride, k_head_stride = scale_arg(k_scale, query)
    v_scale_t, v_seq_stride, v_head_stride = scale_arg(v_scale, query)
    cdtype = compute_dtype(query.dtype)
    if rows is None:
        cu_seqlens_q, causal, row_offset, num_rows = seq_lens, True, 0, query.shape[0]
        split = num_splits > 1
    else:
        cu_seqlens_q, causal, row_offset, num_rows = rows
        split = True
    if split:
        # partials: [num_rows, num_heads, num_splits, value_head_size] and their base-2 LSEs
        part_out = torch.empty(num_rows, num_heads, num_splits, dims.value_size, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused: SPLIT=False never touches them
    sinks_t, alibi_t, lse_t = variants.pointers(k_scale_t)
    softcap_log2, inv_softcap, window_left, window_right = variants.values()
    flags = variants.flags()
    _decode_kernel[(num_rows, num_kv_heads * head_blocks, num_splits)](
        out, query, kv_view(key_cache), kv_view(value_cache), block_tables, seq_lens, cu_seqlens_q,
        k_scale_t, v_scale_t, part_out, part_lse, sinks_t, alibi_t, lse_t,
        scale * LOG2E.value, softcap_log2, inv_softcap, window_left, window_right, partition, num_splits, num_seqs,
        row_offset, int(causal), k_seq_stride, k_head_stride, v_seq_stride, v_head_stride,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP_SIZE=group_size, KV_BLOCK_SIZE=block_size,
        FP8_FORMAT=fp8_format(key_cache.dtype),
        COMPUTE_DTYPE=tl_dtype(cdtype), DOT_PRECISION=dot_precision(cdtype),
        ROUND_BF16=round_bf16(query.dtype),
        ROW_ALIGN=row_align(*query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3],
                            *value_cache.stride()[:3]),
        SPLIT=split, VARLEN_ROWS=rows is not None, **flags,
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], **dims.constexprs(),
        V_FROM_K=value_is_key_main(key_cache, value_cache, dims),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if split:
        _decode_reduce_kernel[(num_rows, num_heads)](
            out, part_out, part_lse, seq_lens, cu_seqlens_q, sinks_t, lse_t,
            window_left, window_right, partition, num_splits, num_seqs, row_offset, int(causal),
            out.stride(0), out.stride(1), VALUE_SIZE=dims.value_size, ROUND_BF16=round_bf16(query.dtype),
            VARLEN_ROWS=rows is not None, HAS_WINDOW=flags["HAS_WINDOW"], HAS_SINKS=flags["HAS_SINKS"],
            WRITE_LSE=flags["WRITE_LSE"], HAS_WINDOW_RIGHT=flags["HAS_WINDOW_RIGHT"],
            SPLIT_CHUNK=REDUCE_SPLIT_CHUNK, VALUE_PAD=dims.value_pad, num_warps=reduce_warps(dims.value_pad))


def reduce_warps(value_pad: int) -> int:
    """num_warps of the reduce kernel: its [SPLIT_CHUNK, VALUE_PAD] fp32 chunk of partials is 64
    registers a thread at 4 warps up to 512 columns; a 1024-wide one (Dv up to 576) takes 8."""
    return 4 if value_pad <= 512 else 8

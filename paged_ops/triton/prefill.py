"""Paged varlen prefill attention (flash-attention tiling over the block table).

Grid: (query tile, kv_head x head block). Like decode, a program handles one KV head's query
group: its M rows are (query token, head-in-group) pairs, row r = token r // HEAD_TILE, head
r % HEAD_TILE, so each K/V tile is gathered once per group, and q_len = 1 rows (decode tokens mixed
into a prefill batch) still fill the M dimension. A query tile holds BLOCK_Q = BLOCK_M // HEAD_TILE
tokens. HEAD_TILE is the group, or for a group wider than BLOCK_M (absorbed MLA's 16-128 heads
on one latent, whose 512-wide accumulator rows cap BLOCK_M) BLOCK_M heads of it, one program per
block of heads. Keys are HEAD_SIZE wide (key_split's main + remainder tiles), values and out
VALUE_SIZE (MLA: Dv <= Dk; V_FROM_K: V is the K main tile, value_cache a view of key_cache).

Query tiles of all sequences are numbered in one flat grid axis without a host sync (as vLLM's
unified attention does): sequence s owns tiles [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1),
at least cdiv(q_len, BLOCK_Q) of them, so the grid is total_q // BLOCK_Q + num_seqs programs and a
batch of one long prompt plus many decode rows does not launch long-prompt-many tiles per row.
Each program finds its sequence by binary search over cu_seqlens_q.

Causal masking is bottom-right aligned (query i sees KV 0 .. ctx + i with ctx = seq_len - q_len,
i.e. the cached context of chunked prefill); KV tiles past the tile's last visible position
are never visited, nor (sliding window) tiles before its first row's window.

Variants as in decode (constexpr flags, _common.Variants). In the batch-invariant mode prefill
does not use this kernel: every row goes through decode.run_rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import autotune
from ._common import (INTERPRET, LOG2E, HeadDims, compute_dtype, device_guard, device_name, dot_precision,
                      fp8_format, is_fp8, kv_view, next_pow2, round_bf16, row_align, scale_arg, tl_dtype,
                      value_is_key_main, Variants)
from ._tiles import (FP8_NONE, attend_tiles, finish_and_store, fp8_bits_to_float, head_dims, load_q, load_scale,
                     soft_cap, store_rows, visible_keys)
from . import decode
from .decode import PLAIN


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence owning flat query tile ``tile``: the last s with cu[s] // BLOCK_Q + s <= tile."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _add_hidden_nonfinite_values(lo, hi, out_ptr, out_offs, io_mask, lse2, v_scale, q, rows, scores, kv, dims,
                                 KV_BLOCK_SIZE: tl.constexpr, FP8_FORMAT: tl.constexpr,
                                 COMPUTE_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                                 HAS_ALIBI: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                                 HAS_WINDOW_RIGHT: tl.constexpr, HEAD_REST: tl.constexpr):
    """Adds to the stored rows p * v (IEEE) of every key in [lo, hi) that is hidden from some
    row and holds a non-finite V (the keys the masked tiles read as 0), for exactly the rows that
    see it; p = exp2(s - lse) * v_scale, the weight the row's normalized output gives the key.
    q, rows, scores, kv, dims: attend_tiles' tuples. Runs only when the loop met such a key, after the
    rows are stored, one key at a time: the KV loop's registers stay those of the plain step (an
    accumulator carried into this pass made true-fp32 kernels spill)."""
    q_abs, alibi, seq_len, window_left, window_right, all_lo, all_hi = rows
    qk_scale, softcap_log2, inv_softcap = scores
    table_row, kv_head, k_cache_ptr, k_strides, v_cache_ptr, v_strides = kv
    q_main, q_rest = q
    k_dims, k_mask, r_dims, r_mask, v_dims, v_mask = dims
    for j in range(lo, hi):
        block_j = tl.load(table_row + j // KV_BLOCK_SIZE).to(tl.int64)
        offset_j = block_j * 0 + j % KV_BLOCK_SIZE  # int64 (j is a plain int under the interpreter)
        v_j = tl.load(v_cache_ptr + block_j * v_strides[0] + offset_j * v_strides[1]
                      + kv_head.to(tl.int64) * v_strides[2] + v_dims, mask=v_mask, other=0)
        if FP8_FORMAT != FP8_NONE:
            v_j = fp8_bits_to_float(v_j, FP8_FORMAT)
        v_j = v_j.to(COMPUTE_DTYPE).to(tl.float32)
        bad = (tl.max(tl.where(tl.abs(v_j) < float("inf"), 0, 1), 0) > 0) & ((j < all_lo) | (j >= all_hi))
        if bad:
            k_row = k_cache_ptr + block_j * k_strides[0] + offset_j * k_strides[1] + kv_head.to(tl.int64) * k_strides[2]
            k_j = tl.load(k_row + k_dims, mask=k_mask, other=0)
            if FP8_FORMAT != FP8_NONE:
                k_j = fp8_bits_to_float(k_j, FP8_FORMAT)
            s_j = tl.sum(q_main.to(tl.float32) * k_j.to(COMPUTE_DTYPE).to(tl.float32)[None, :], 1)
            if HEAD_REST > 0:
                k_r = tl.load(k_row + r_dims, mask=r_mask, other=0)
                if FP8_FORMAT != FP8_NONE:
                    k_r = fp8_bits_to_float(k_r, FP8_FORMAT)
                s_j += tl.sum(q_rest.to(tl.float32) * k_r.to(COMPUTE_DTYPE).to(tl.float32)[None, :], 1)
            s_j = s_j * qk_scale
            if HAS_SOFTCAP:
                s_j = soft_cap(s_j, softcap_log2, inv_softcap)
            if HAS_ALIBI:
                s_j += alibi * (j - q_abs).to(tl.float32)
            row_lo, row_hi = visible_keys(q_abs, seq_len, CAUSAL, window_left, window_right, HAS_WINDOW,
                                          HAS_WINDOW_RIGHT)
            sees_j = (row_lo <= j) & (j <= row_hi)  # [BLOCK_M]
            p_j = tl.exp2(s_j - lse2) * v_scale
            out_rows = tl.load(out_ptr + out_offs[:, None] + v_dims[None, :], mask=io_mask, other=0.0).to(tl.float32)
            out_rows += tl.where(sees_j[:, None], p_j[:, None] * v_j[None, :], 0.0)
            store_rows(out_ptr + out_offs[:, None] + v_dims[None, :], out_rows, io_mask, ROUND_BF16)


# The batch size and the block-table width change from step to step of a serving engine: not
# specialized, or Triton compiles a variant whenever one of them is 1 or a multiple of 16 (the
# windows and scale strides likewise: one variant for every window size and scale form).
@triton.jit(do_not_specialize=["num_seqs", "block_table_stride", "window_left", "window_right",
                               "k_scale_seq_stride", "k_scale_head_stride", "v_scale_seq_stride",
                               "v_scale_head_stride"])
def _prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, alibi_slopes_ptr, lse_ptr,
        qk_scale_log2, softcap_log2, inv_softcap, window_left, window_right, num_seqs,
        k_scale_seq_stride, k_scale_head_stride, v_scale_seq_stride, v_scale_head_stride,
        q_stride_token, q_stride_head, o_stride_token, o_stride_head,
        k_stride_block, k_stride_token, k_stride_head, v_stride_block, v_stride_token, v_stride_head,
        block_table_stride,
        GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
        CAUSAL: tl.constexpr, FP8_FORMAT: tl.constexpr,
        COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
        WRITE_LSE: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, FAST_TILES: tl.constexpr,
        ROW_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_MAIN: tl.constexpr,
        HEAD_REST: tl.constexpr, VALUE_SIZE: tl.constexpr, VALUE_PAD: tl.constexpr, V_FROM_K: tl.constexpr,
        HEAD_TILE: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // HEAD_TILE
    HEAD_BLOCKS: tl.constexpr = (GROUP_SIZE + HEAD_TILE - 1) // HEAD_TILE  # programs per KV head and tile
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_tile_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:  # a sequence's spare tile (its tile count is an upper bound)
        return
    seq = seq.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk (negative: more queries than keys)

    rows = tl.arange(0, BLOCK_M)
    q_pos = q_tile_start + rows // HEAD_TILE  # position within this sequence's queries
    q_abs = context + q_pos  # position p in the sequence
    in_group = head_block * HEAD_TILE + rows % HEAD_TILE
    heads = (kv_head * GROUP_SIZE + in_group).to(tl.int64)  # int64: head * stride never wraps
    row_mask = (rows < BLOCK_Q * HEAD_TILE) & (q_pos < q_len) & (in_group < GROUP_SIZE)
    # compile-time constancy of the column masks: lets Triton vectorize row loads
    dims = head_dims(HEAD_SIZE, HEAD_MAIN, HEAD_REST, VALUE_SIZE, VALUE_PAD)
    _, _, _, _, v_dims, v_mask = dims
    io_mask = row_mask[:, None] & v_mask[None, :]  # out: [BLOCK_M, VALUE_PAD]

    # q: [BLOCK_M, HEAD_MAIN] (+ [BLOCK_M, HEAD_REST])
    q_rows = (q_begin + q_pos).to(tl.int64)
    q_offs = tl.multiple_of(q_rows * q_stride_token + heads * q_stride_head, ROW_ALIGN)
    q = load_q(q_ptr, q_offs, row_mask, dims, COMPUTE_DTYPE, HEAD_REST)
    qk_scale = qk_scale_log2 * load_scale(k_scale_ptr, seq, kv_head, k_scale_seq_stride, k_scale_head_stride)
    if HAS_ALIBI:  # slope * (j - p) in base 2: [BLOCK_M]
        alibi = tl.load(alibi_slopes_ptr + heads, mask=row_mask, other=0.0) * LOG2E
    else:
        alibi = 0.0

    # The keys some row of the tile sees, [kv_start, kv_end), and those every row sees, [all_lo,
    # all_hi), from its first and last rows' visible_keys (the bounds grow with the position):
    # tiles outside the first are never read (the cost follows the windows and the diagonal, not
    # the context), tiles inside the second take the unmasked fast path.
    p_first = context + q_tile_start
    p_last = context + tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    kv_start, first_hi = visible_keys(p_first, seq_len, CAUSAL, window_left, window_right, HAS_WINDOW,
                                      HAS_WINDOW_RIGHT)
    all_lo, last_hi = visible_keys(p_last, seq_len, CAUSAL, window_left, window_right, HAS_WINDOW,
                                   HAS_WINDOW_RIGHT)
    kv_end = last_hi + 1
    all_hi = first_hi + 1
    num_tiles = tl.cdiv(tl.maximum(kv_end - kv_start, 0), BLOCK_N)
    head_tiles = tl.minimum(tl.cdiv(tl.maximum(all_lo - kv_start, 0), BLOCK_N), num_tiles)
    full_tiles = tl.where(kv_end <= all_hi, num_tiles,
                          tl.minimum(tl.maximum(all_hi - kv_start, 0) // BLOCK_N, num_tiles))
    full_end = kv_start + tl.maximum(head_tiles, full_tiles) * BLOCK_N
    head_end = kv_start + head_tiles * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_PAD], tl.float32)
    rows_keys = (q_abs, alibi, seq_len, window_left, window_right, all_lo, all_hi)
    scores = (qk_scale, softcap_log2, inv_softcap)
    kv = (block_tables_ptr + seq * block_table_stride, kv_head, k_cache_ptr, (k_stride_block, k_stride_token,
          k_stride_head), v_cache_ptr, (v_stride_block, v_stride_token, v_stride_head))
    hidden_nonfinite = 0  # keys hidden from some row with a non-finite V, read as 0 by the loop
    if FAST_TILES:
        # Tiles before the last row's window starts (only with a window), tiles every row sees
        # whole (the fast path), tiles past the first row's last key (the causal diagonal, the
        # right window's edge).
        if HAS_WINDOW:
            m_i, l_i, acc, hidden_nonfinite = attend_tiles(
                kv_start, head_end, kv_end, m_i, l_i, acc, hidden_nonfinite, q, rows_keys, scores, kv, dims,
                KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16, ROW_ALIGN, HAS_SOFTCAP,
                HAS_ALIBI, True, CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT, BLOCK_N, HEAD_REST, V_FROM_K)
        m_i, l_i, acc, hidden_nonfinite = attend_tiles(
            head_end, full_end, kv_end, m_i, l_i, acc, hidden_nonfinite, q, rows_keys, scores, kv, dims,
            KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16, ROW_ALIGN, HAS_SOFTCAP,
            HAS_ALIBI, False, CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT, BLOCK_N, HEAD_REST, V_FROM_K)
        if CAUSAL or HAS_WINDOW_RIGHT:
            m_i, l_i, acc, hidden_nonfinite = attend_tiles(
                full_end, kv_end, kv_end, m_i, l_i, acc, hidden_nonfinite, q, rows_keys, scores, kv, dims,
                KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16, ROW_ALIGN, HAS_SOFTCAP,
                HAS_ALIBI, True, CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT, BLOCK_N, HEAD_REST, V_FROM_K)
    else:
        # One loop, every tile masked: true-fp32 (FMA) dots keep their registers only so.
        m_i, l_i, acc, hidden_nonfinite = attend_tiles(
            kv_start, kv_end, kv_end, m_i, l_i, acc, hidden_nonfinite, q, rows_keys, scores, kv, dims,
            KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE, DOT_PRECISION, ROUND_BF16, ROW_ALIGN, HAS_SOFTCAP,
            HAS_ALIBI, True, CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT, BLOCK_N, HEAD_REST, V_FROM_K)

    # rows without keys: out 0, lse -inf (or the sink); lse: [total_q, num_heads] float32, natural log
    v_scale = load_scale(v_scale_ptr, seq, kv_head, v_scale_seq_stride, v_scale_head_stride)
    out_offs = tl.multiple_of(q_rows * o_stride_token + heads * o_stride_head, ROW_ALIGN)
    num_heads = (tl.num_programs(1) // HEAD_BLOCKS) * GROUP_SIZE
    lse2 = finish_and_store(acc, m_i, l_i, v_scale, out_ptr, out_offs, v_dims, io_mask,
                            lse_ptr, q_rows * num_heads + heads, sinks_ptr, heads, row_mask,
                            HAS_SINKS, WRITE_LSE, ROUND_BF16)
    if hidden_nonfinite > 0:  # poisoned or overflowed values only
        _add_hidden_nonfinite_values(kv_start, kv_end, out_ptr, out_offs, io_mask, lse2, v_scale, q, rows_keys,
                                     scores, kv, dims, KV_BLOCK_SIZE, FP8_FORMAT, COMPUTE_DTYPE,
                                     ROUND_BF16, HAS_SOFTCAP, HAS_ALIBI, CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT,
                                     HEAD_REST)


def fast_tiles(query_dtype: torch.dtype) -> bool:
    """Constexpr FAST_TILES of the prefill kernel: tiles every row of the query tile sees whole
    take a loop of their own without masks (16-bit dots). True-fp32 dots (FMA units) spilled
    hundreds of bytes per thread on sm_80 and sm_90 with more than one KV loop in the kernel
    (aot.compile_launch), so fp32 keeps one loop whose tiles all take the masked step."""
    return query_dtype != torch.float32


# Under the interpreter: one fixed config (no tuning).
DEFAULT_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _plain_default_config(head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                          value_head_size: int | None = None) -> dict:
    """Config used when tuning is off (interpreter, PAGED_OPS_TRITON_AUTOTUNE=0) or finds nothing.

    Chosen from sm_80 and sm_90 ahead-of-time compiles to fit shared memory without register
    spills (tests/test_triton_compile.py): true-fp32 dots run on FMA units and need much smaller
    tiles than 16-bit tensor-core dots, and decoding fp8 bytes to fp32 operands costs registers.
    Keyed by the wider of the K and V tiles (HeadDims.config_pad: head_pad(head_size) when Dk ==
    Dv; DeepSeek's 192 / 128 takes the 256-wide configs, its q and K tiles being 128 + 64).
    """
    if INTERPRET:
        return dict(DEFAULT_CONFIG)
    pad = HeadDims(head_size, value_head_size or head_size).config_pad
    fp8_cache = cache_dtype is not None and is_fp8(cache_dtype)
    if pad > 256:
        # MLA's 576-wide latent (512 + 64 tiles, values up to 576): few keys per tile and 8 warps,
        # rows of 512 fp32 accumulator columns in 16-32-row tiles (run_prefill cuts wide groups)
        if dtype == torch.float32 or fp8_cache:
            return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if dtype == torch.float32 and fp8_cache:
        # Pipelining the byte loads (num_stages 2) takes every register and still spills; with
        # issue #27's masked-tile handling 32 x 16 at 128-wide rows spilled 12 B on sm_90.
        if pad <= 64:
            return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
        if pad <= 128:
            return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}  # 32 x 256: sm_80 spilled
    if dtype == torch.float32:
        # 64-row tiles spilled 0.5-2 KB per thread on sm_90 once the masked tiles' handling of
        # hidden non-finite values (issue #27) was in the kernel; 32 x 16 spill nowhere.
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if pad > 128:  # 256-wide rows: smaller KV tiles, more warps for the accumulator; with #27's
        # masked tiles 64 x 32 spilled 44 B (sm_80), and fp8 caches 20-72 B at 64 x 32 and 32 x 32
        if fp8_cache:  # 8 warps (128 registers each) spilled 8-12 B on sm_90, 1 or 2 stages
            return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
        return {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if pad > 64:  # 128-wide rows: 64 x 64 tiles spill on sm_80 (with 4 and with 8 warps), 64 x 32
        # with 4 warps too once the masked tiles' non-finite handling (issue #27) was in
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if fp8_cache:  # 64-wide rows widened from fp8 bytes: 64 x 64 spilled 152 B on sm_80 with #27's tiles
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def default_config(head_size: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                   variants: Variants = PLAIN, value_head_size: int | None = None) -> dict:
    """_plain_default_config, with smaller tiles or more warps where the variants' per-score work
    (the cap's tanh, ALiBi's bias, the window's mask) made the sm_80 compile spill
    (tests/test_triton_compile.py, variant matrix: fp32 rows of 64/128 spilled 8/20 B, 16-bit
    queries on fp8 caches 4-216 B). value_head_size: Dv (default head_size)."""
    config = _plain_default_config(head_size, dtype, cache_dtype, value_head_size)
    pad = HeadDims(head_size, value_head_size or head_size).config_pad
    if INTERPRET or not variants.heavy_scores or pad > 256:
        return config
    fp8_cache = cache_dtype is not None and is_fp8(cache_dtype)
    if dtype == torch.float32 and not fp8_cache:
        # 64 x 16 tiles spilled 12 B at head 64 on sm_90; with the one tile loop (attend_tiles) 32 x 16
        # spilled 8-12 B with every variant at head 64 (sm_80, sm_90) and 256 (sm_90), 16 x 16 nowhere
        config["BLOCK_M"] = 16
    elif dtype != torch.float32 and fp8_cache and pad <= 128:
        config["num_warps"] = 8
        config["BLOCK_N"] = min(config["BLOCK_N"], 32)
    elif dtype != torch.float32 and pad > 128:  # every variant at 256: sm_80 spilled 36 B, fp8 64-192 B
        if fp8_cache:  # the variant matrix's compile-checked config
            config.update(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=2)
        else:
            config["BLOCK_N"] = 16
    return config


def _candidates(head_size: int, dtype: torch.dtype, value_head_size: int | None = None) -> list[dict]:
    # Each candidate is a compile on first use, so the sweep stays small (<= 16). Tiles that
    # exceed shared memory fail to compile and the tuner skips them; the filter drops configs
    # whose fp32 accumulator alone ([BLOCK_M, VALUE_PAD]) would take over 128 registers per thread.
    dims = HeadDims(head_size, value_head_size or head_size)
    pad = dims.value_pad
    if dims.config_pad > 256:  # MLA's latent: 576-wide q / K rows, 16-32 rows, 16-32 keys
        grid = [(bm, bn, w, st) for bm in (16, 32) for bn in (16, 32) for w in (4, 8) for st in (1, 2)]
    elif dtype == torch.float32:  # FMA dots: small tiles only
        grid = [(bm, bn, w, 2) for bm in (32, 64) for bn in (16, 32) for w in (4, 8)]
    else:
        grid = [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for st in (2, 3)]
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            for bm, bn, w, st in grid if bm * pad // (32 * w) <= 128]


def tuning_key(query, key_cache, block_tables, max_seqlen_q: int, causal: bool, variants: Variants = PLAIN,
               value_cache=None) -> tuple:
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = block_tables.shape[1] * block_size
    return (block_size, head_size, num_heads, num_kv_heads, next_pow2(max_seqlen_q),
            next_pow2(max_len), bool(causal), str(query.dtype), str(key_cache.dtype),
            autotune.cache_layout(key_cache)) + decode.value_key(query, key_cache, value_cache) + variants.key()


def prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, scale, causal, k_scale=None, v_scale=None, softcap=0.0,
                      window_left=-1, sinks=None, alibi_slopes=None, lse=None, batch_invariant=False,
                      window_right=-1) -> None:
    """Varlen attention of each sequence's new query rows over its first seq_lens[s] cached tokens,
    with the variants of paged_ops.reference.attention.

    query: [total_q, num_heads, head_size]; out: [total_q, num_heads, value_head_size] (value_cache's
    head size, <= head_size; value_cache may be a view into key_cache); cu_seqlens_q: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32 (including the new tokens); block_tables: [num_seqs, max_blocks] int32;
    lse: [total_q, num_heads] float32. batch_invariant: every row goes through decode's row-wise
    path (decode.run_rows), so a causal row at position p gives the bits of a decode of p + 1 tokens.
    """
    variants = Variants(float(softcap), int(window_left), sinks, alibi_slopes, lse,
                        int(window_right)).for_causal(bool(causal))
    if batch_invariant:
        if query.shape[0]:
            decode.run_rows(out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, causal,
                            scale, k_scale, v_scale, variants)
        return
    key = tuning_key(query, key_cache, block_tables, max_seqlen_q, causal, variants, value_cache)
    value_size = value_cache.shape[3]

    def bench(config):
        return autotune.benchmark_ms(lambda: run_prefill(
            out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
            max_seqlen_q, scale, causal, k_scale, v_scale, config, variants))

    config = autotune.TUNERS["prefill_attention"].choose(
        device_name(query.device), key,
        default_config(query.shape[2], query.dtype, key_cache.dtype, variants, value_size),
        _candidates(query.shape[2], query.dtype, value_size), bench)
    run_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                max_seqlen_q, scale, causal, k_scale, v_scale, config, variants)


def config_for(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
               max_seqlen_q, scale, causal, k_scale=None, v_scale=None, softcap=0.0, window_left=-1, sinks=None,
               alibi_slopes=None, lse=None, batch_invariant=False, window_right=-1) -> dict:
    """The config a prefill_attention call with these arguments would use; runs nothing. In the
    batch-invariant mode: decode's fixed row-wise config, with its split count."""
    variants = Variants(float(softcap), int(window_left), sinks, alibi_slopes, lse,
                        int(window_right)).for_causal(bool(causal))
    value_size = value_cache.shape[3]
    if batch_invariant:
        config = decode.default_config(query.shape[2], query.dtype, key_cache.dtype, variants, value_size)
        bound = decode.visible_bound(decode.max_len_bound(block_tables, key_cache.shape[1]), variants, causal)
        return dict(config, num_splits=-(-bound // decode.BATCH_INVARIANT_PARTITION))
    key = tuning_key(query, key_cache, block_tables, max_seqlen_q, causal, variants, value_cache)
    return dict(autotune.TUNERS["prefill_attention"].lookup(device_name(query.device), key)
                or default_config(query.shape[2], query.dtype, key_cache.dtype, variants, value_size))


def query_tile_rows(group_size: int, value_pad: int, config: dict) -> tuple[int, int]:
    """(BLOCK_M, HEAD_TILE) of a launch: the config's BLOCK_M raised to hold the whole GQA group
    (every K/V tile then read once for the group) as long as the accumulator stays within
    decode.block_rows' budget; HEAD_TILE the heads a row block holds (the group, or BLOCK_M
    heads of a wider one: absorbed MLA's 128 heads on one 512-wide latent value)."""
    block_m = max(config["BLOCK_M"], decode.block_rows(group_size, value_pad, config["num_warps"]))
    return block_m, min(group_size, block_m)


def run_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                max_seqlen_q, scale, causal, k_scale, v_scale, config: dict, variants: Variants = PLAIN) -> None:
    """Launch with an explicit config."""
    num_seqs = seq_lens.shape[0]
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    dims = HeadDims.of(query, value_cache)
    block_m, head_tile = query_tile_rows(group_size, dims.value_pad, config)
    # max_seqlen_q is only a hint (unchecked on CUDA tensors): the grid below does not depend on
    # it, so no row is left unwritten when it is too small. Only no rows at all means no work.
    if query.shape[0] == 0:
        return
    variants = variants.for_causal(bool(causal))
    k_scale_t, k_seq_stride, k_head_stride = scale_arg(k_scale, query)
    v_scale_t, v_seq_stride, v_head_stride = scale_arg(v_scale, query)
    sinks_t, alibi_t, lse_t = variants.pointers(k_scale_t)
    softcap_log2, inv_softcap, window_left, window_right = variants.values()
    cdtype = compute_dtype(query.dtype)
    # Flat query-tile axis (see the module docstring): an upper bound that needs no host sync.
    grid = (query.shape[0] // (block_m // head_tile) + num_seqs, num_kv_heads * -(-group_size // head_tile))
    with device_guard(query):
        _prefill_kernel[grid](
            out, query, kv_view(key_cache), kv_view(value_cache), block_tables, cu_seqlens_q, seq_lens,
            k_scale_t, v_scale_t, sinks_t, alibi_t, lse_t,
            scale * LOG2E.value, softcap_log2, inv_softcap, window_left, window_right, num_seqs,
            k_seq_stride, k_head_stride, v_seq_stride, v_head_stride,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
            GROUP_SIZE=group_size, KV_BLOCK_SIZE=block_size,
            CAUSAL=bool(causal),
            FP8_FORMAT=fp8_format(key_cache.dtype),
            COMPUTE_DTYPE=tl_dtype(cdtype), DOT_PRECISION=dot_precision(cdtype),
            ROUND_BF16=round_bf16(query.dtype), **variants.flags(), FAST_TILES=fast_tiles(query.dtype),
            ROW_ALIGN=row_align(*query.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3],
                                *value_cache.stride()[:3]),
            BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], **dims.constexprs(),
            V_FROM_K=value_is_key_main(key_cache, value_cache, dims), HEAD_TILE=head_tile,
            num_warps=config["num_warps"], num_stages=config["num_stages"])

"""Device helpers shared by the decode and prefill kernels: which keys a row sees (visible_keys),
the walk over KV tiles (attend_tiles) and how a row ends (finish_rows, finish_and_store)."""
import triton
import triton.language as tl

from ._common import LN2, LOG2E


# fp8 cache formats (constexpr FP8_FORMAT); caches in these formats are passed as uint8 views.
FP8_NONE = tl.constexpr(0)
FP8_E4M3 = tl.constexpr(1)
FP8_E5M2 = tl.constexpr(2)


@triton.jit
def fp8_bits_to_float(x, FP8_FORMAT: tl.constexpr):
    """Exact fp32 value of fp8 bits (uint8), without Triton's fp8 types.

    Triton lacks e4m3fn on pre-Hopper GPUs, so the cache bytes are decoded by hand: e5m2 is
    the top byte of an fp16 (so its inf and NaN bytes are fp16's inf and NaN); e4m3fn's bits
    shifted into fp16 position are the value / 2^8 (fp16's exponent bias is 8 larger),
    subnormals included. Both are exact. e4m3fn has no inf and one NaN per sign (0x7F / 0xFF),
    which the shift would turn into +-480: it is mapped to NaN, as torch's cast does, so a NaN
    written into a cache propagates like in every other backend.
    """
    x = x.to(tl.uint16)
    if FP8_FORMAT == FP8_E5M2:
        return (x << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        half = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)
        return tl.where((x & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0)


@triton.jit
def visible_keys(pos, seq_len, causal, window_left, window_right,
                 HAS_WINDOW: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr):
    """The keys [lo, hi] (inclusive; none when lo > hi) that the query row at position ``pos`` (=
    seq_len - q_len + i) of a sequence of seq_len keys sees: the rule of
    paged_ops.reference.attention, spelled visible_keys in csrc/attention_rules.h too.

    lo = pos - window_left (HAS_WINDOW), at least 0, else 0; hi = pos if ``causal``, else
    pos + window_right (HAS_WINDOW_RIGHT), at most seq_len - 1, else seq_len - 1. pos: a scalar
    or [BLOCK_M]; causal: a constexpr or a runtime bool. A causal row with pos < 0 (more queries
    than keys) and every row of seq_len 0 see nothing.
    """
    if HAS_WINDOW:
        lo = tl.maximum(pos - window_left, 0)
    else:
        lo = 0
    if HAS_WINDOW_RIGHT:
        right = tl.minimum(pos + window_right, seq_len - 1)
    else:
        right = seq_len - 1
    return lo, tl.where(causal, pos, right)


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
def kv_rows(block_ids, offsets, kv_head, strides, ROW_ALIGN: tl.constexpr):
    """Element offsets of the located tokens' rows of one KV head: [BLOCK_N] int64.

    strides: (block, token, head). ROW_ALIGN: see row_align()."""
    # int64 throughout: a head-major cache of a few G elements puts kv_head * stride_head past 2^31.
    rows = block_ids * strides[0] + offsets * strides[1] + kv_head.to(tl.int64) * strides[2]
    return tl.multiple_of(rows, ROW_ALIGN)


@triton.jit
def load_rows(cache_ptr, rows, valid, dims, dim_mask, FP8_FORMAT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """Columns ``dims`` of K or V rows (kv_rows): [BLOCK_N, len(dims)] in COMPUTE_DTYPE.

    valid: [BLOCK_N]; dims, dim_mask: the tile's columns. Invalid rows and padded columns load 0
    without touching memory: unused cache slots may hold NaN.
    """
    tile = tl.load(cache_ptr + rows[:, None] + dims[None, :],
                   mask=valid[:, None] & dim_mask[None, :], other=0)
    if FP8_FORMAT != FP8_NONE:
        tile = fp8_bits_to_float(tile, FP8_FORMAT)
    return tile.to(COMPUTE_DTYPE)


@triton.jit
def load_q(q_ptr, q_rows, row_mask, dims, COMPUTE_DTYPE: tl.constexpr, HEAD_REST: tl.constexpr):
    """(q_main, q_rest) of query rows at element offsets q_rows [BLOCK_M]: the key_split tiles
    (dims: head_dims' tuple); without a remainder (HEAD_REST 0) q_rest is q_main, never read.
    Padded rows and columns are 0."""
    k_dims, k_mask, r_dims, r_mask, _, _ = dims
    q = tl.load(q_ptr + q_rows[:, None] + k_dims[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0).to(COMPUTE_DTYPE)
    if HEAD_REST > 0:
        q_rest = tl.load(q_ptr + q_rows[:, None] + r_dims[None, :], mask=row_mask[:, None] & r_mask[None, :],
                         other=0.0).to(COMPUTE_DTYPE)
    else:
        q_rest = q
    return q, q_rest


@triton.jit
def head_dims(HEAD_SIZE: tl.constexpr, HEAD_MAIN: tl.constexpr, HEAD_REST: tl.constexpr,
              VALUE_SIZE: tl.constexpr, VALUE_PAD: tl.constexpr):
    """(k_dims, k_mask, r_dims, r_mask, v_dims, v_mask): the columns of the key main tile
    [HEAD_MAIN], of the key remainder tile [HEAD_REST] (from HEAD_MAIN on; with HEAD_REST 0 the
    main tile's, never read) and of V / out [VALUE_PAD], with their masks against HEAD_SIZE and
    VALUE_SIZE (constexprs: the masks have compile-time constancy, which is what lets Triton
    vectorize the row loads). See _common.key_split."""
    k_dims = tl.arange(0, HEAD_MAIN)
    k_mask = k_dims < HEAD_SIZE
    if HEAD_REST > 0:
        r_dims = HEAD_MAIN + tl.arange(0, HEAD_REST)
        r_mask = r_dims < HEAD_SIZE
    else:
        r_dims = k_dims
        r_mask = k_mask
    v_dims = tl.arange(0, VALUE_PAD)
    v_mask = v_dims < VALUE_SIZE
    return k_dims, k_mask, r_dims, r_mask, v_dims, v_mask


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest-even bf16, kept in fp32 (NaN stays NaN).

    Under the interpreter bf16 dots are widened to fp32 (see _common.compute_dtype) and its
    fp32 -> bf16 cast truncates: this puts back the rounding a GPU does to the softmax weights
    before the P @ V dot and to the stored output, so interpreter tests measure the GPU's error.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _tanh_series(x2):
    """p(x^2) with tanh(x) = x + x * x^2 * p(x^2) for |x| < 0.55: the odd Taylor series through
    x^17 (its next term is < 1e-7 of the value there)."""
    poly = -929569.0 / 638512875.0 + x2 * (6404582.0 / 10854718875.0)
    poly = 21844.0 / 6081075.0 + x2 * poly
    poly = -1382.0 / 155925.0 + x2 * poly
    poly = 62.0 / 2835.0 + x2 * poly
    poly = -17.0 / 315.0 + x2 * poly
    poly = 2.0 / 15.0 + x2 * poly
    return -1.0 / 3.0 + x2 * poly


@triton.jit
def _tanh_far(x):
    """tanh(x) for |x| >= 0.55 as (1 - e^-2|x|) / (1 + e^-2|x|), which has no cancellation once
    e^-2|x| <= 1/3."""
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))  # e^(-2|x|)
    far = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -far, far)


@triton.jit
def tanh(x):
    """tanh of fp32 ``x`` to a few ulps, the same code compiled and interpreted (libdevice's tanh
    does not run under the interpreter).

    |x| < 0.55: the odd series (_tanh_series), else the exponential form (_tanh_far). The
    exponential form alone would lose up to ~1e-7 absolute near 0, i.e. softcap * 1e-7 in a
    capped logit: a visible share of the fp32 budget at Gemma 2's cap of 50.
    """
    x2 = x * x
    return tl.where(tl.abs(x) < 0.55, x + x * x2 * _tanh_series(x2), _tanh_far(x))


@triton.jit
def soft_cap(s, cap_log2, inv_cap):
    """cap * tanh(s / cap) of base-2 scores ``s`` with cap = softcap * log2(e) (``cap_log2``),
    i.e. the natural-log cap softcap * tanh(s / softcap) times log2(e); inv_cap = 1 / softcap.

    s / cap is formed as (s * ln 2) * (1 / softcap): 1 / (softcap * log2(e)) is subnormal for
    caps near 2^126 (flushed to 0 on a GPU: every capped score 0). Below |x| = 0.55 the cap is
    applied as s + s * x^2 * p(x^2), which is cap * tanh(x) without the round trip through
    s / cap: where x^2 underflows (a huge cap) the score passes through exactly.
    """
    x = (s * LN2) * inv_cap
    x2 = x * x
    return tl.where(tl.abs(x) < 0.55, s + s * x2 * _tanh_series(x2), cap_log2 * _tanh_far(x))


@triton.jit
def score_tile(q, k, q_rest, k_rest, qk_scale, softcap_log2, inv_softcap, DOT_PRECISION: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HEAD_REST: tl.constexpr):
    """Scores of a tile in base 2 (natural score * log2(e)): [BLOCK_M, BLOCK_N].

    q: [BLOCK_M, HEAD_MAIN], k: [BLOCK_N, HEAD_MAIN], and with HEAD_REST the remainder columns
    q_rest [BLOCK_M, HEAD_REST], k_rest [BLOCK_N, HEAD_REST], accumulated into the same scores
    (key_split); qk_scale = scale * k_scale * log2(e).
    HAS_SOFTCAP: soft_cap with softcap_log2 = softcap * log2(e), inv_softcap = 1 / softcap.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HEAD_REST > 0:
        s = tl.dot(q_rest, tl.trans(k_rest), s, input_precision=DOT_PRECISION)
    s = s * qk_scale
    if HAS_SOFTCAP:
        s = soft_cap(s, softcap_log2, inv_softcap)
    return s


@triton.jit
def online_softmax_weights(s, s_mask, m_i, l_i, COMPUTE_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
                           MAY_BE_EMPTY: tl.constexpr):
    """The softmax half of one flash-attention step over a KV tile, in base 2: (m_new, l_new,
    alpha, p), after which acc = acc * alpha[:, None] + p @ v.

    s: [BLOCK_M, BLOCK_N] base-2 scores (score_tile, plus any bias), s_mask: [BLOCK_M, BLOCK_N]
    (visible); m_i, l_i: [BLOCK_M] running max / sum; p: [BLOCK_M, BLOCK_N] in COMPUTE_DTYPE, the
    dot's operand. ROUND_BF16: see round_to_bf16 (True only under the interpreter for bf16
    queries). Without MAY_BE_EMPTY every row must see at least one position in its first tile so
    m_i is finite after it: then hidden positions get p = exp2(-inf) = 0 exactly, and v is 0 (not
    NaN) there. MAY_BE_EMPTY (masked tiles: a row's window may start tiles after its tile's first
    row's, a row may see no key at all) subtracts 0 instead of a still -inf max, so such rows keep
    m -inf, l 0, acc 0.
    """
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ROUND_BF16:  # interpreter, bf16 query: the GPU's bf16 P operand
        p_op = round_to_bf16(p)
    else:
        p_op = p.to(COMPUTE_DTYPE)
    return m_new, l_i, alpha, p_op


@triton.jit
def attend_tiles(start, end, kv_end, m_i, l_i, acc, hidden_nonfinite, q, rows, scores, kv, dims,
                 KV_BLOCK_SIZE: tl.constexpr, FP8_FORMAT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, ROUND_BF16: tl.constexpr, ROW_ALIGN: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_REST: tl.constexpr, V_FROM_K: tl.constexpr):
    """The flash loop of decode and prefill: the KV tiles [start, end) (steps of BLOCK_N, keys
    below kv_end) folded into the rows' running max m_i, sum l_i and accumulator acc ([BLOCK_M],
    [BLOCK_M], [BLOCK_M, VALUE_PAD] fp32). Returns (m_i, l_i, acc, hidden_nonfinite).

    q: (q_main, q_rest) from load_q, in COMPUTE_DTYPE; dims: head_dims' tuple (key main and
    remainder columns, value columns; HEAD_REST 0: no remainder). V_FROM_K: V is the K main tile
    itself (value_cache is key_cache's first VALUE_SIZE columns, _common.value_is_key_main): each
    latent row is read once, for the scores and the values. The tuples:
      rows = (q_abs, alibi, seq_len, window_left, window_right, all_lo, all_hi): each row's position
        p and ALiBi slope (base 2; unused without HAS_ALIBI) ([BLOCK_M] each), what visible_keys
        needs besides them (with CAUSAL, HAS_WINDOW, HAS_WINDOW_RIGHT; read by MASKED tiles only),
        and the keys [all_lo, all_hi) every row sees;
      scores = (qk_scale, softcap_log2, inv_softcap): see score_tile;
      kv = (table_row, kv_head, k_cache_ptr, (k strides: block, token, head), v_cache_ptr, (v ...)).

    Not MASKED (the fast path): every row sees every key of [start, min(end, kv_end)), and sees a
    key in the range's first tile. MASKED: the tiles hold keys hidden from some row; each row's
    visible_keys bounds that can cut a tile are compared (a left window; the causal diagonal or a
    right window), rows may see nothing yet (MAY_BE_EMPTY), and a hidden
    key's V must not reach a row that cannot see it: p = 0 there, but 0 * inf and 0 * NaN are NaN
    in P @ V. So a key outside [all_lo, all_hi) whose V holds a non-finite value is read as 0 by
    the dot, for every row, and counted in hidden_nonfinite: the caller adds p * v back for
    exactly the rows that see it (prefill's _add_hidden_nonfinite_values). Finite values take the
    plain path (0 * finite = 0 exactly), and so does a non-finite V every row sees.
    """
    q_abs, alibi, seq_len, window_left, window_right, all_lo, all_hi = rows
    qk_scale, softcap_log2, inv_softcap = scores
    table_row, kv_head, k_cache_ptr, k_strides, v_cache_ptr, v_strides = kv
    q_main, q_rest = q
    k_dims, k_mask, r_dims, r_mask, v_dims, v_mask = dims
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        block_ids, offsets = locate_tokens(table_row, pos, valid, KV_BLOCK_SIZE)
        k_rows = kv_rows(block_ids, offsets, kv_head, k_strides, ROW_ALIGN)
        k = load_rows(k_cache_ptr, k_rows, valid, k_dims, k_mask, FP8_FORMAT, COMPUTE_DTYPE)
        if HEAD_REST > 0:
            k_rest = load_rows(k_cache_ptr, k_rows, valid, r_dims, r_mask, FP8_FORMAT, COMPUTE_DTYPE)
        else:
            k_rest = k
        if V_FROM_K:
            v = k
        else:
            v = load_rows(v_cache_ptr, kv_rows(block_ids, offsets, kv_head, v_strides, ROW_ALIGN), valid, v_dims,
                          v_mask, FP8_FORMAT, COMPUTE_DTYPE)
        s = score_tile(q_main, k, q_rest, k_rest, qk_scale, softcap_log2, inv_softcap, DOT_PRECISION, HAS_SOFTCAP,
                       HEAD_REST)
        if HAS_ALIBI:  # slope * (j - p)
            s += alibi[:, None] * (pos[None, :] - q_abs[:, None]).to(tl.float32)
        visible = valid[None, :]
        if MASKED:
            # Bounds formed here from q_abs, not carried through the loop: two more live [BLOCK_M]
            # vectors made fp32 prefill with every variant spill on sm_80.
            row_lo, row_hi = visible_keys(q_abs, seq_len, CAUSAL, window_left, window_right, HAS_WINDOW,
                                          HAS_WINDOW_RIGHT)
            if HAS_WINDOW:
                visible = visible & (pos[None, :] >= row_lo[:, None])
            if CAUSAL or HAS_WINDOW_RIGHT:
                visible = visible & (pos[None, :] <= row_hi[:, None])
        m_i, l_i, alpha, p = online_softmax_weights(s, visible, m_i, l_i, COMPUTE_DTYPE, ROUND_BF16, MASKED)
        if MASKED:
            nonfinite = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0, 1), 1) > 0  # [BLOCK_N]
            bad = nonfinite & ((pos < all_lo) | (pos >= all_hi))  # hidden from some row (past kv_end: loaded 0)
            v = tl.where(bad[:, None], 0.0, v).to(COMPUTE_DTYPE)
        acc = acc * alpha[:, None]  # scaled before the count: that order took fewer registers (fp32, sm_80)
        if MASKED:
            hidden_nonfinite += tl.sum(bad.to(tl.int32), 0)
        acc += tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_i, l_i, acc, hidden_nonfinite


@triton.jit
def join_sink(m, sink_log2):
    """(m', w_sink): the running max ``m`` joined with a sink (a logit with no value, base 2),
    and the sink's weight relative to it. As in the reference: a -inf sink is no sink, a NaN
    sink leaves m' = m and makes its weight (so the row) NaN; m' is 0 where both are -inf (no
    key, no sink: weights 0, not NaN), and the sink as the max weighs 1 exactly (exp2(inf - inf)
    would be NaN for a +inf sink)."""
    m = tl.where(sink_log2 > m, sink_log2, m)
    m = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.where(sink_log2 == m, 1.0, tl.exp2(sink_log2 - m))


@triton.jit
def row_lse(lse2, no_keys, sink, HAS_SINKS: tl.constexpr):
    """The natural-log lse stored for a row whose base-2 lse is ``lse2``: a row without keys
    (``no_keys``) has -inf there, or with HAS_SINKS the sink (natural) itself, not its round trip
    through base 2."""
    lse = lse2 * LN2
    if HAS_SINKS:
        lse = tl.where(no_keys, sink, lse)
    return lse


@triton.jit
def finish_rows(m_i, l_i, sink, v_scale, HAS_SINKS: tl.constexpr):
    """(factor, lse2, lse) that end rows: out = acc * factor[:, None], lse2 the base-2 lse, lse
    the natural one to store (row_lse).

    m_i, l_i, sink: [BLOCK_M] (sink: natural logits, read only with HAS_SINKS); v_scale: the
    row's dequantization scale of V (1.0 for non-fp8 caches). HAS_SINKS: the sink joins the
    denominator once (join_sink); a +inf sink gives out 0 and lse +inf, a NaN sink a NaN row. A
    row that saw no key (l_i 0, m_i -inf) gets out 0 (not 0 / 0) and lse -inf, or the sink.
    Without sinks the factor of a row with keys is v_scale / l_i, bit for bit as before the
    variants.
    """
    if HAS_SINKS:
        m, w_sink = join_sink(m_i, sink * LOG2E)
        alpha = tl.exp2(m_i - m)
        total = l_i * alpha + w_sink
        factor = tl.where(total == 0.0, 0.0, v_scale * alpha / total)
        lse2 = m + tl.log2(total)
    else:
        factor = tl.where(l_i == 0.0, 0.0, v_scale / l_i)
        lse2 = m_i + tl.log2(l_i)
    return factor, lse2, row_lse(lse2, l_i == 0.0, sink, HAS_SINKS)


@triton.jit
def finish_and_store(acc, m_i, l_i, v_scale, out_ptr, out_rows, dims, out_mask, lse_ptr, lse_rows, sinks_ptr, heads,
                     row_mask, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The epilogue of decode (unsplit) and prefill: ends the rows (finish_rows) and stores out at
    out_ptr + out_rows[:, None] + dims[None, :] (out_mask) and, with WRITE_LSE, the natural lse at
    lse_ptr + lse_rows (row_mask); the rows' sinks are sinks_ptr[heads] (read with HAS_SINKS).
    out_rows, lse_rows, heads: [BLOCK_M] offsets. Returns the rows' base-2 lse.

    Offsets, not pointer tensors: the [BLOCK_M, VALUE_PAD] 64-bit out pointers are formed once acc
    is scaled, a live pointer tensor beside acc cost true-fp32 prefill 20 registers on sm_80."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0)
    else:
        sink = 0.0
    factor, lse2, _ = finish_rows(m_i, l_i, sink, v_scale, HAS_SINKS)
    out = acc * factor[:, None]
    store_rows(out_ptr + out_rows[:, None] + dims[None, :], out, out_mask, ROUND_BF16)
    if WRITE_LSE:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0)
        tl.store(lse_ptr + lse_rows, row_lse(lse2, l_i == 0.0, sink, HAS_SINKS), mask=row_mask)
    return lse2


@triton.jit
def load_scale(scale_ptr, seq, kv_head, seq_stride, head_stride):
    """Dequantization scale of (sequence, KV head): scale[seq * seq_stride + kv_head * head_stride]
    (strides (0, 0) per tensor, (0, 1) per KV head, (num_kv_heads, 1) per sequence and KV head;
    a 1.0 tensor with (0, 0) for non-fp8 caches)."""
    return tl.load(scale_ptr + (seq * seq_stride + kv_head * head_stride))  # < num_seqs * num_kv_heads: int32


@triton.jit
def store_rows(ptr, x, mask, ROUND_BF16: tl.constexpr):
    """Store fp32 ``x`` in ``ptr``'s dtype, rounding to nearest even like a GPU's cast."""
    if ROUND_BF16:
        x = round_to_bf16(x)  # exact in bf16 now: the interpreter's truncating cast is harmless
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

// Paged attention on the CPU: one flash-attention core shared by decode (q_len = 1 per
// sequence) and varlen prefill. Raw pointers and strides only.
//
// Work is cut into tasks (sequence, KV head, tile of query tokens, KV split). A task loads its
// KV head once for the whole query group and tile (GQA: the group's query heads are rows of the
// same tile), walks the block table in tiles of kTileTokens tokens with an online softmax, and
// either writes the normalized output or, when the sequence's KV is split across tasks, a
// partial output plus its log-sum-exp that a second pass merges.
//
// The variants (paged_ops/reference.py attention): a row at position p sees keys
// [max(0, p - window_left), causal ? p : min(kv_len - 1, p + window_right)] (row_range, from the
// shared rule visible_keys of attention_rules.h; none when p < 0 or the window leaves nothing:
// out 0, lse -inf, or the sink's); soft-cap and ALiBi change the scores of each tile before its
// softmax; a sink is one more term of the row's denominator, added once, when the row's parts are
// folded into its output (fold_part / fold_finish, the shared end_row), which also gives the
// row's log-sum-exp. Keys a row does not see never
// change it, even inf or NaN ones (copy_finite below). Tiles sit on absolute multiples of kTileTokens and a task starts at
// the first tile any of its rows sees, so a window of W keys costs O(W) whatever the context.
//
// Batch-invariant mode: a row's KV is cut into chunks on absolute multiples of
// kBatchInvariantSplitTokens; each chunk is one online softmax over the same tiles, and the
// chunks are folded in position order. Whether the chunks run in one task (folded there) or in
// tasks of their own (folded by merge_splits), and which other rows share the tiles, changes no
// bit of a row: the per-row arithmetic is the same code on the same values in the same order,
// and tiles a row does not see add exact zeros.
//
// Sizes and positions are int64: a stride-0 view can have any size (block_size 2^32 + 16), and
// a position near 2^31 plus a tile overflows int. The running softmax sum and output
// accumulator are fp64: each tile is summed in fp32 registers (32 terms) and added to them, so
// the error does not grow with the context length (in fp32 a sum of 1e8 probabilities of ~1
// stops growing at 2^24, and the output drifts by percents).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_dot.h"
#include "attention_rules.h"
#include "decode_dot.h"
#include "kernels/params.h"
#include "vec16.h"
#include "vec8.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

// The core takes paged::AttentionParams (kernels/params.h), the struct of every C++ backend. Of its
// fields it leaves the GPU's launch sizing (num_sms, max_seqlen_q) alone: the plan here counts the
// rows itself. The element types come as template arguments (paged_attention<QT, CT>), chosen by
// the caller from dtype / cache_dtype.

inline constexpr int kTileTokens = 32;  // a multiple of 8: softmax runs on whole vectors
// Below this many tasks per thread a long sequence is split; splits never get shorter than this.
inline constexpr int kTasksPerThread = 4;
inline constexpr int kMinSplitTokens = 256;
// Batch-invariant mode's chunk of KV positions (a multiple of kTileTokens): fixed, so a row's
// chunks depend on its own positions only, never on the batch or the thread count.
inline constexpr int64_t kBatchInvariantSplitTokens = 512;
// Batch-invariant mode runs a query tile's chunks as tasks of their own (for idle threads) only
// while their partial outputs stay below this many rows; else one task folds them in turn.
inline constexpr int64_t kMaxPartialRows = int64_t(1) << 14;
// Multiply-adds below which a call runs on the calling thread: starting an OpenMP region costs
// more than such a call's whole work.
inline constexpr int64_t kMinParallelWork = int64_t(1) << 21;
// Rows of a task (per KV head) from which the bf16 dot-product path is taken (bf16_dot.h): its
// tile re-layout costs about as much as QK and PV of a few rows.
inline constexpr int64_t kMinDotRows = 16;

struct Task {
  int64_t seq, kv_head_begin, kv_head_end;  // KV heads [begin, end), each with its whole query group
  int64_t q_begin, q_end;                   // query rows [q_begin, q_end) of the flattened batch
  int64_t kv_begin, kv_end;                 // this task's KV positions
  int64_t chunk_tokens;  // > 0: fold chunks on absolute multiples of it (batch-invariant mode)
  int64_t split, num_splits;  // num_splits > 1: one chunk per task, merged by merge_splits
  int64_t partial_offset;  // into the split workspace, in rows
};

// Per-thread scratch, reused across tasks.
struct Scratch {
  std::vector<float> q, s, m, out;
  std::vector<double> acc, l;  // the running sums (see the top of the file)
  std::vector<double> fold_m, fold_w, fold_acc;  // the rows' folded chunks (fold_part)
  std::vector<int64_t> first_visible, last_visible, position;
  std::vector<uint32_t> qb, kt, vp, pb;  // the bf16 dot-product path's layouts (bf16_dot.h)
  std::vector<uint32_t> qt;              // the heads path's Q^T (dot_qk_heads, amx_qk_heads)
  std::vector<float> st;                 // and its scores, [kTileTokens][rows]
  std::vector<uint16_t> kg;              // and its gathered key rows (key_halves, AMX builds)
  std::vector<float> acc32;              // and its fp32 PV sums between flushes
  std::vector<double> acc_scale;         // the corrections acc still owes at the next flush
  std::vector<uint16_t> kw;              // fp8 caches: a tile's K or V rows widened to bf16
  std::vector<uint32_t> v_finite;        // value rows with inf / NaN elements 0 (copy_finite)
  std::vector<uint32_t> v_zero;          // a value row of zeros (never written after resize)
  // rows per KV head: scores and visibility are per head (reused head after head), the rest
  // (queries, accumulators, softmax state) for all the task's heads. Query rows have the key head
  // size dk, accumulators and output rows the value head size dv (MLA: dv < dk). The fp32 query
  // (fp32_query: the 8/16-lane QK; the dot paths read the query as it is) and the fold's
  // accumulator (fold: tasks that fold chunks) are sized only where the task uses them: at 128
  // query heads of 576 they are most of the scratch.
  void resize(int64_t rows, int64_t heads, int dk, int dv, bool fp32_query, bool fold) {
    if (fp32_query) q.resize(size_t(rows) * heads * dk);
    acc.resize(size_t(rows) * heads * dv);
    if (fold) fold_acc.resize(size_t(rows) * heads * dv);
    s.resize(size_t(rows) * kTileTokens);
    m.resize(size_t(rows) * heads);
    l.resize(size_t(rows) * heads);
    fold_m.resize(size_t(rows) * heads);
    fold_w.resize(size_t(rows) * heads);
    out.resize(dv);
    v_finite.resize(size_t(kTileTokens) * dv);  // 4 bytes per element: any cache dtype
    v_zero.resize(dv);
  }
  void resize_rows(int64_t rows) {  // each row's visible keys and position (plan_rows)
    first_visible.resize(rows);
    last_visible.resize(rows);
    position.resize(rows);
  }
  void resize_dot(int64_t rows, int64_t heads, int dk, int dv) {
    const int64_t dv32 = (dv + 31) / 32 * 32;
    qb.resize(size_t(rows) * heads * dk / 2);
    kt.resize(size_t(dk / 2) * kTileTokens);
    vp.resize(size_t(kTileTokens / 2) * dv32);
    pb.resize(size_t(rows) * kTileTokens / 2);
    acc32.resize(size_t(rows) * heads * dv32);
    acc_scale.resize(size_t(rows) * heads);
    kw.resize(size_t(kTileTokens) * std::max(dk, dv));  // K's rows and V's, widened in turn
  }
  void resize_heads(int64_t rows, int64_t heads, int dk) {
    qt.resize(size_t(rows) * heads * dk / 2);
    st.resize(size_t(kTileTokens) * rows);
    kg.resize(size_t(kTileTokens) * dk);
  }
};

// This thread's Scratch, kept across calls (OpenMP's threads persist), so a call does not page-
// fault fresh buffers in. Bounded: vectors only grow, so it holds the largest task's scratch this
// thread has run so far (per ISA build), never more. No task reads what it did not write first
// (run_task zero-fills or overwrites each buffer it reads), as with tasks reusing it in one call.
inline Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Sequence s's query rows of the flattened batch: [begin, end). cu_seqlens_q == nullptr (decode):
// one row per sequence, row s (kernels/params.h), so decode needs no offsets tensor.
struct QueryRows {
  int64_t begin, end;
  int64_t size() const { return end - begin; }
};
inline QueryRows query_rows(const AttentionParams& p, int64_t s) {
  if (p.cu_seqlens_q == nullptr) return {s, s + 1};
  return {p.cu_seqlens_q[s], p.cu_seqlens_q[s + 1]};
}

// Keys a query row sees: [lo, hi], closed (the tile loop's bounds), p its position: the contract's
// rule, rules::visible_keys (attention_rules.h), whose half-open end is hi + 1. None when lo > hi
// (a row before the sequence's first key, p < 0, or a window with nothing in it). Both ends grow
// with the row: a query tile's rows see [lo of its first row, hi of its last] together.
struct RowRange {
  int64_t position, lo, hi;
  bool empty() const { return lo > hi; }
};
inline RowRange row_range(const AttentionParams& p, int64_t kv_len, int64_t q_len, int64_t i) {
  const int64_t pos = kv_len - q_len + i;
  const KeyRange<int64_t> keys = visible_keys<int64_t>(pos, kv_len, p.causal, p.window_left, p.window_right);
  return {pos, keys.lo, keys.hi - 1};
}

// Folding a row's parts (chunks or splits, in position order) into its output: the running
// (max, weight, weighted sum) of exp(lse_i) * part_i. Out of line, so the fold in a task and
// the one in merge_splits are the same instructions: batch-invariant mode needs their bits equal.
// A part with lse -inf (it saw no key) is skipped, so a missing part and an empty one give the
// same bits. The first part is taken exactly (weight exp(0) = 1, previous weight 0).
__attribute__((noinline)) inline void fold_part(double& m, double& w, double* acc, int D, double lse,
                                                const float* part) {
  if (lse == -std::numeric_limits<double>::infinity()) return;
  const double m_new = std::max(m, lse);  // a NaN lse keeps m; its weight below is NaN
  const double a = std::exp(m - m_new), b = std::exp(lse - m_new);
  w = w * a + b;
  m = m_new;
  for (int d = 0; d < D; ++d) acc[d] = acc[d] * a + b * double(part[d]);
}

// The row's output and log-sum-exp from its folded parts and its sink: end_row (attention_rules.h)
// in fp64 natural logs (BaseEF64) on the fold's max m and weight w. No weight (no part and no
// sink: the row saw no key, or only -inf scores): out 0 and lse -inf, as the reference (its
// probabilities are 0 where the lse is -inf, not (-inf) - (-inf)).
__attribute__((noinline)) inline void fold_finish(double m, double w, const double* acc, int D, const float* sink,
                                                  float* out, float* lse) {
  const RowEnd<double> end = end_row<BaseEF64>(m, w, sink ? double(*sink) : -std::numeric_limits<double>::infinity());
  for (int d = 0; d < D; ++d) out[d] = float(acc[d] * end.mul);
  if (lse != nullptr) *lse = float(end.lse);
}

// A row's output and log-sum-exp straight from its one chunk's running max m, sum l and
// accumulator acc (v_mul: the value scale, end_row's num): what fold_part then fold_finish give
// for a single part, without the fp32 part and the fold's passes between. For tasks of one chunk
// that are not split, i.e. never in batch-invariant mode (its bits must match a fold of several
// chunks). l == 0 (no key, or only -inf scores, and no sink): out 0 (acc * 0: NaN only where a
// value the row sees is inf or NaN) and lse -inf; with a sink, end_row's.
inline void finish_row(double m, double l, const double* acc, int D, double v_mul, const float* sink, float* out,
                       float* lse) {
  const RowEnd<double> end =
      end_row<BaseEF64>(m, l, sink ? double(*sink) : -std::numeric_limits<double>::infinity(), v_mul);
  for (int d = 0; d < D; ++d) out[d] = float(acc[d] * end.mul);
  if (lse != nullptr) *lse = float(end.lse);
}

// Into L2, not L1: the next tile is 16 KiB per KV head, which L1 prefetches (prefetcht0) cannot
// keep in flight (they wait on L1's few miss buffers and stall the core); L2 holds it easily and
// the loads then hit L2 (bench/README.md has the decode rates).
// asm volatile because GCC 12 dropped __builtin_prefetch from this code at -O1 and -O3.
inline void prefetch(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// How the micro-kernels read a cache dtype: as itself, except e4m3fn, read as fp16 (its value /
// 2^8, kUnit, which the scales take) and, in tiles without NaN bytes, through the widening that
// skips the NaN fix-up (per byte read, the fp8 cache was compute-bound on the widening).
template <typename CT>
struct CacheRead {
  using Exact = CT;
  using Finite = CT;
  static constexpr float kUnit = 1.f;
};
template <>
struct CacheRead<c10::Float8_e4m3fn> {
  using Exact = E4m3Half;
  using Finite = E4m3HalfFinite;
  static constexpr float kUnit = 256.f;
};

// Keys hidden from some rows of a tile never change those rows (spec: select, not multiply). A
// hidden key's probability is exactly 0, and 0 * v is an exact 0 for finite v but NaN for an inf
// or NaN v. So in a tile where some row cannot see some of the keys (a causal diagonal, a
// window's edges, rows before the sequence), those keys' values are scanned (the keys before
// lo_all, which no row sees and locate() points at key lo_all, read a row of zeros instead); the few with an inf or NaN element are read by every
// PV path (8-lane, bf16 dot and its AMX tiles, decode_dot.h's) from a copy holding 0 in those
// elements, and each such element's p * v (plain IEEE, as the reference) is then added to the rows
// that see the key (add_nonfinite_values). Finite elements are read as they lie, so a row's
// finite columns keep their bits whatever its tile holds (batch-invariant mode: decode and prefill
// rows stay equal), and its non-finite ones are inf or NaN either way. Tiles every row sees
// whole are not scanned.
template <typename CT>
struct StorageBits {  // an element's bits, and the exponent bits all set in inf and NaN
  using U = std::conditional_t<sizeof(CT) == 4, uint32_t, std::conditional_t<sizeof(CT) == 2, uint16_t, uint8_t>>;
  static constexpr U kNonFinite = std::is_same_v<CT, float>            ? U(0x7F800000)
                                  : std::is_same_v<CT, c10::Half>      ? U(0x7C00)
                                  : std::is_same_v<CT, c10::BFloat16>  ? U(0x7F80)
                                  : std::is_same_v<CT, c10::Float8_e5m2> ? U(0x7C)
                                                                         : U(0x7F);  // e4m3fn: NaN only
  static bool nonfinite(U bits) { return (bits & kNonFinite) == kNonFinite; }
  static float value(U bits) {  // the element as float (inf or NaN here)
    CT x;
    std::memcpy(&x, &bits, sizeof(x));
    return static_cast<float>(x);
  }
};

template <typename CT>
inline bool any_nonfinite(const void* row, int D) {
  using B = StorageBits<CT>;
  const typename B::U* u = static_cast<const typename B::U*>(row);
  int found = 0;  // no early exit: the loop vectorizes
  for (int d = 0; d < D; ++d) found |= int(B::nonfinite(u[d]));
  return found != 0;
}

// out = row with its inf / NaN elements 0.
template <typename CT>
inline void copy_finite(const void* row, int D, void* out) {
  using B = StorageBits<CT>;
  const typename B::U* u = static_cast<const typename B::U*>(row);
  typename B::U* o = static_cast<typename B::U*>(out);
  for (int d = 0; d < D; ++d) o[d] = B::nonfinite(u[d]) ? typename B::U(0) : u[d];
}

// acc[r][d] += p[r][j] * v[d] for the inf / NaN elements d of each listed token j's value row v
// (as it lies in the cache) and the rows r that see the token (key j0 + j): what the PV paths
// left out of those rows when they read the copy (copy_finite). acc: fp64 (the 8-lane and small
// paths) or acc32 (the bf16 dot path), rows acc_stride apart.
template <typename CT, typename A>
inline void add_nonfinite_values(int64_t rows, const float* p, const int64_t* first_visible, const int64_t* last_visible,
                                 int64_t j0, const int* tokens, const void* const* values, int count, int D, A* acc,
                                 int64_t acc_stride) {
  using B = StorageBits<CT>;
  for (int i = 0; i < count; ++i) {
    const int j = tokens[i];
    const typename B::U* u = static_cast<const typename B::U*>(values[i]);
    for (int64_t r = 0; r < rows; ++r) {
      if (j0 + j < first_visible[r] || j0 + j > last_visible[r]) continue;
      const float pr = p[r * kTileTokens + j];
      for (int d = 0; d < D; ++d)
        if (B::nonfinite(u[d])) acc[r * acc_stride + d] += A(pr * B::value(u[d]));
    }
  }
}

// The fp8 scale of (sequence seq, KV head head); 1 without one.
inline float kv_scale(const float* scale, int64_t seq_stride, int64_t head_stride, int64_t seq, int64_t head) {
  return scale == nullptr ? 1.f : scale[seq * seq_stride + head * head_stride];
}

// Prefetches rows of the next tile while this one is computed. Spread over the tile's compute
// (a few rows per step) rather than issued in one burst, which would overflow the miss buffers.
// Rows of one KV head are strided and blocks scattered: the hardware prefetcher does not follow.
template <typename CT>
struct Prefetch {
  const CT* const* k = nullptr;
  const CT* const* v = nullptr;
  int n = 0;  // rows in the next tile (0: nothing to fetch)
  // Bytes of a key row and of a value row (MLA: they differ; 0 when the value rows lie inside the
  // key rows, as the absorbed latent's do: fetched with the keys already).
  int64_t k_row_bytes = 0, v_row_bytes = 0;
  int per_step = 1;  // rows fetched per row of this tile, so the whole next tile is covered
  int64_t k_offset = 0, v_offset = 0;  // the KV head's offset from the token's base pointer

  // Inlined: called per token, as a call it cost a tenth of an MHA decode.
  __attribute__((always_inline)) void rows(int j, int count) const {
    keys(j, count);
    values(j, count);
  }
  // Line `line` (64 bytes) of the next tile's token i: of its key row, and of its value row, where
  // the row is that long (bf16_dot.h's dot_qk_heads issues one per column pair it computes).
  __attribute__((always_inline)) void token_line(int i, int line) const {
    if (i >= n) return;
    const int64_t b = int64_t(line) * 64;
    // The builtin, not prefetch()'s asm: the asm's memory operand made GCC keep the caller's
    // accumulators in memory around it.
    if (b < k_row_bytes) __builtin_prefetch(reinterpret_cast<const char*>(k[i] + k_offset) + b, 0, 2);
    if (b < v_row_bytes) __builtin_prefetch(reinterpret_cast<const char*>(v[i] + v_offset) + b, 0, 2);
  }
  // The keys / the values of the same rows alone (decode_dot.h spreads them over QK and PV).
  __attribute__((always_inline)) void keys(int j, int count) const { lines(k, k_offset, k_row_bytes, j, count); }
  __attribute__((always_inline)) void values(int j, int count) const { lines(v, v_offset, v_row_bytes, j, count); }

 private:
  __attribute__((always_inline)) void lines(const CT* const* base, int64_t offset, int64_t row_bytes, int j,
                                            int count) const {
    for (int i = j * per_step; i < std::min(n, (j + count) * per_step); ++i)
      for (int64_t b = 0; b < row_bytes; b += 64) prefetch(reinterpret_cast<const char*>(base[i] + offset) + b);
  }
};

// s[r][j] = q[r] . k[j] for R query rows and the n tokens of a tile, reading K straight from the
// cache. Two tokens at a time: 2R independent FMA chains, and each q chunk is loaded once per pair.
template <int R, typename CT, typename P>
inline void qk_block(const float* q, int D, const CT* const* k, int n, float* s, const P& next) {
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    next.rows(j, 2);
    Vec8 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = Vec8::zero();
    int c = 0;
    for (; c + 16 <= D; c += 16) {  // 16 columns: a 16-wide widening where the dtype has one
      Vec8 k0, k0h, k1, k1h;
      Vec8::load16(k[j] + c, k0, k0h);
      Vec8::load16(k[j + 1] + c, k1, k1h);
      for (int r = 0; r < R; ++r) {
        const Vec8 qr = Vec8::load(q + size_t(r) * D + c), qh = Vec8::load(q + size_t(r) * D + c + 8);
        a[r][0] = a[r][0].fma(qr, k0).fma(qh, k0h);
        a[r][1] = a[r][1].fma(qr, k1).fma(qh, k1h);
      }
    }
    for (; c < D; c += 8) {
      const Vec8 k0 = Vec8::load(k[j] + c), k1 = Vec8::load(k[j + 1] + c);
      for (int r = 0; r < R; ++r) {
        const Vec8 qr = Vec8::load(q + size_t(r) * D + c);
        a[r][0] = a[r][0].fma(qr, k0);
        a[r][1] = a[r][1].fma(qr, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      s[r * kTileTokens + j] = a[r][0].sum();
      s[r * kTileTokens + j + 1] = a[r][1].sum();
    }
  }
  for (; j < n; ++j) {
    next.rows(j, 1);
    Vec8 a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec8::zero();
    for (int c = 0; c < D; c += 8) {
      const Vec8 k0 = Vec8::load(k[j] + c);
      for (int r = 0; r < R; ++r) a[r] = a[r].fma(Vec8::load(q + size_t(r) * D + c), k0);
    }
    for (int r = 0; r < R; ++r) s[r * kTileTokens + j] = a[r].sum();
  }
}

// acc[r] += sum_j p[r][j] * v[j] for R rows: 16 columns of R rows stay in fp32 registers over
// the tile, then are added to the fp64 accumulator.
template <int R, typename CT>
inline void pv_block(double* acc, int D, const float* p, const CT* const* v, int n) {
  for (int c = 0; c < D; c += 16) {
    const bool pair = c + 16 <= D;  // head sizes are multiples of 8, not always of 16
    Vec8 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = Vec8::zero();
    for (int j = 0; j < n; ++j) {
      Vec8 v0, v1;
      if (pair)
        Vec8::load16(v[j] + c, v0, v1);
      else
        v0 = Vec8::load(v[j] + c), v1 = Vec8::zero();
      for (int r = 0; r < R; ++r) {
        const Vec8 pr = Vec8::broadcast(p[r * kTileTokens + j]);
        a[r][0] = a[r][0].fma(pr, v0);
        a[r][1] = a[r][1].fma(pr, v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      a[r][0].add_to(acc + size_t(r) * D + c);
      if (pair) a[r][1].add_to(acc + size_t(r) * D + c + 8);
    }
  }
}

// Runs a micro-kernel over all rows, four at a time (the register budget of 16 vector registers).
template <template <int, typename> class Kernel, typename CT, typename... Args>
inline void for_row_blocks(int64_t rows, Args&&... args) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) Kernel<4, CT>::run(r, args...);
  switch (rows - r) {
    case 3: Kernel<3, CT>::run(r, args...); break;
    case 2: Kernel<2, CT>::run(r, args...); break;
    case 1: Kernel<1, CT>::run(r, args...); break;
  }
}

template <int R, typename CT>
struct QK {
  template <typename P>
  static void run(int64_t r, const float* q, int D, const CT* const* k, int n, float* s, const P& next) {
    // Only the first row block issues the next tile's prefetches: once is enough.
    qk_block<R, CT>(q + size_t(r) * D, D, k, n, s + r * kTileTokens, r == 0 ? next : P{});
  }
};

template <int R, typename CT>
struct PV {
  static void run(int64_t r, double* acc, int D, const float* p, const CT* const* v, int n) {
    pv_block<R, CT>(acc + size_t(r) * D, D, p + r * kTileTokens, v, n);
  }
};

// The fp8 scales of (sequence seq, KV head h); 1 without. k_scale folds into the query, v_scale
// into the output: both are per sequence and KV head.
inline float k_scale_of(const AttentionParams& p, int64_t seq, int64_t kv_head) {
  return kv_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kv_head);
}
inline float v_scale_of(const AttentionParams& p, int64_t seq, int64_t kv_head) {
  return kv_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kv_head);
}

#if defined(__AVX512BF16__)
// bf16 caches on this build, and fp8 caches under a bf16 query (widened to bf16 exactly in the
// re-layout): the caches the bf16 dot-product paths read (bf16_dot.h, decode_dot.h).
template <typename QT, typename CT>
inline constexpr bool kDotCache =
    std::is_same_v<CT, c10::BFloat16> || (is_fp8_v<CT> && std::is_same_v<QT, c10::BFloat16>);
// decode_dot.h's element type: fp8 as it lies (widened in registers there), else bf16's bits.
template <typename CT>
using SmallDotElem = std::conditional_t<is_fp8_v<CT>, CT, uint16_t>;
#endif

// What one task computes with, fixed before its KV walk (plan_rows): its rows, the keys they see,
// and the micro-kernels it runs. For each KV head, rows are (query token, head in group) pairs:
// row r = token * group + g.
struct TaskShape {
  int Dk, Dv;            // key (query) and value (output) head sizes: Dv <= Dk, at most 576
  int64_t group;         // query heads per KV head
  int64_t rows;          // per KV head
  int64_t heads;         // KV heads of the task
  bool split;            // one split of several: writes its part to partial / part_lse
  // [lo_all, hi_all]: keys some row sees (rows that see none left out); [common_lo, common_hi]:
  // keys every row sees (empty rows included: empty when some row sees none).
  int64_t lo_all, hi_all, common_lo, common_hi;
  // The KV walk [begin, end): the task's range cut to what its rows see, from a tile boundary.
  int64_t begin, end;
  // One chunk, not split (outside batch-invariant mode): the epilogue writes out and lse at once
  // (finish_row) and the fold's accumulator is never read.
  bool direct;
  // The QK / PV micro-kernels (choose_kernels): the 8/16-lane ones on the fp32 query (w.q), or
  // the bf16 dot products on the query as it is (w.qb): dot (re-laid tiles, bf16_dot.h) or
  // small_dot (rows as they lie, decode_dot.h).
  bool query_as_is, dot, small_dot;
  // The dot path with the rows as the vectors' lanes (decode): every row sees the same keys, so
  // QK is S^T = K Q^T on the key rows as they lie (dot_qk_heads; amx_qk_heads on tiles) and the
  // softmax runs across rows, 16 at a time (softmax_tile_heads); PV is the dot path's. Rows a
  // multiple of 16 (and on tiles Dk of 32).
  bool heads_path;
  int dot_dv;  // the dot path's accumulator row: Dv rounded up to 32
};

// Stage: choose_kernels. The bf16 dot products (both read the query as it is, never w.q) for the
// caches they take, never in batch-invariant mode: there decode and prefill rows must share one
// code path. The re-laid tiles (dot) when the task has rows enough to pay for the tile's re-layout
// (a prefill tile); fewer rows (decode: the GQA group) dot the keys and values as they lie
// (small_dot), no re-layout to pay for.
template <typename QT, typename CT>
inline void choose_kernels(const AttentionParams& p, TaskShape& sh) {
#if defined(__AVX512BF16__)
  sh.query_as_is = kDotCache<QT, CT> && !p.batch_invariant;
  sh.dot = sh.query_as_is && sh.rows >= kMinDotRows;
  sh.small_dot = sh.query_as_is && sh.rows < kMinDotRows;
#else
  (void)p;
  sh.query_as_is = sh.dot = sh.small_dot = false;
#endif
}

// Stage: plan_rows. Each row's visible keys and position (w.first_visible / last_visible /
// position, from row_range) and, from them, the task's KV walk and its micro-kernels.
template <typename QT, typename CT>
inline TaskShape plan_rows(const AttentionParams& p, const Task& t, Scratch& w) {
  TaskShape sh{};
  sh.Dk = int(p.head_size);
  sh.Dv = int(p.value_head_size);
  sh.group = p.num_heads / p.num_kv_heads;
  const QueryRows seq_rows = query_rows(p, t.seq);
  const int64_t kv_len = p.seq_lens[t.seq];
  const int64_t tokens = t.q_end - t.q_begin;
  sh.rows = tokens * sh.group;
  sh.heads = t.kv_head_end - t.kv_head_begin;
  sh.split = t.num_splits > 1;
  w.resize_rows(sh.rows);
  const int64_t group = sh.group;
  int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = -1;
  int64_t common_lo = 0, common_hi = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < tokens; ++i) {
    const RowRange range = row_range(p, kv_len, seq_rows.size(), t.q_begin + i - seq_rows.begin);
    for (int64_t g = 0; g < group; ++g) {
      w.first_visible[i * group + g] = range.lo;
      w.last_visible[i * group + g] = range.hi;
      w.position[i * group + g] = range.position;
    }
    common_lo = std::max(common_lo, range.lo);
    common_hi = std::min(common_hi, range.hi);
    if (range.empty()) continue;
    lo_all = std::min(lo_all, range.lo);
    hi_all = std::max(hi_all, range.hi);
  }
  sh.lo_all = lo_all, sh.hi_all = hi_all, sh.common_lo = common_lo, sh.common_hi = common_hi;
  // Tiles start on multiples of kTileTokens (the same tiles for a row whatever else is in its
  // task), but keys before lo_all are never read: no row sees them (see locate_tile).
  sh.end = std::min(t.kv_end, hi_all + 1);
  sh.begin = sh.end <= lo_all ? sh.end : std::max(t.kv_begin, lo_all / kTileTokens * kTileTokens);
  sh.direct = !sh.split && t.chunk_tokens == 0 && sh.begin < sh.end;
  sh.dot_dv = (sh.Dv + 31) / 32 * 32;
  choose_kernels<QT, CT>(p, sh);
#if defined(PAGED_CPU_AMX)
  sh.heads_path = sh.dot && tokens == 1 && sh.rows % 16 == 0 && sh.Dk % 32 == 0;
#elif defined(__AVX512BF16__)
  sh.heads_path = sh.dot && tokens == 1 && sh.rows % 16 == 0;
#endif
  w.resize(sh.rows, sh.heads, sh.Dk, sh.Dv, !sh.query_as_is, !sh.direct);
  return sh;
}

// Stage: load_queries. The task's query rows in the form its QK reads: fp32 times the scale and
// k_scale (w.q, the 8/16-lane QK), or as they are (w.qb, the dot paths: their products are then
// exact in fp32 and the scale multiplies the fp32 scores, so scores and lse keep fp32 accuracy).
// Also starts the rows' fold (fold_part) and, on the dot path, its fp32 sums: every chunk's last
// tile flushes acc32 to zero, and it is zeroed here too, so no earlier task's leftovers (a NaN
// row) can reach this one.
template <typename QT, typename CT>
inline void load_queries(const AttentionParams& p, const Task& t, const TaskShape& sh, Scratch& w) {
  const QT* query = static_cast<const QT*>(p.query);
  const int D = sh.Dk;  // query rows
  const int64_t group = sh.group, rows = sh.rows, heads = sh.heads;
  for (int64_t hl = 0; hl < heads; ++hl) {
    const int64_t kv_head = t.kv_head_begin + hl;
    const float q_mul = p.scale * k_scale_of(p, t.seq, kv_head) * CacheRead<CT>::kUnit;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = t.q_begin + r / group, head = kv_head * group + r % group;
      if (!sh.query_as_is) {
        float* q = &w.q[(size_t(hl) * rows + r) * D];
        to_float(query + token * p.q_stride_token + head * p.q_stride_head, q, D);
        for (int d = 0; d < D; ++d) q[d] *= q_mul;
      }
      w.fold_m[hl * rows + r] = -std::numeric_limits<double>::infinity();
      w.fold_w[hl * rows + r] = 0.0;
    }
  }
  if (!sh.direct) std::fill(w.fold_acc.begin(), w.fold_acc.begin() + size_t(rows) * heads * sh.Dv, 0.0);
#if defined(__AVX512BF16__)
  if (sh.dot || sh.small_dot) {
    w.resize_dot(rows, heads, sh.Dk, sh.Dv);
    for (int64_t hl = 0; hl < heads; ++hl)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = t.q_begin + r / group, head = (t.kv_head_begin + hl) * group + r % group;
        std::memcpy(&w.qb[(size_t(hl) * rows + r) * D / 2], query + token * p.q_stride_token + head * p.q_stride_head,
                    size_t(D) * sizeof(QT));
      }
  }
  if (sh.dot) {
    std::fill(w.acc32.begin(), w.acc32.begin() + size_t(rows) * heads * sh.dot_dv, 0.f);
    std::fill(w.acc_scale.begin(), w.acc_scale.begin() + rows * heads, 1.0);
  }
#endif
#if defined(__AVX512BF16__)
  if (sh.heads_path) {  // qt[hl][row block][dp][16 rows] = qb[hl][row][dp]: 16 x 16 words at a time
    w.resize_heads(rows, heads, sh.Dk);
    const int DP = D / 2;  // D a multiple of 8: the last block has 4, 8, 12 or 16 pairs
    for (int64_t hl = 0; hl < heads; ++hl)
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int dp0 = 0; dp0 < DP; dp0 += 16) {
          const int cols = std::min(16, DP - dp0);
          const __mmask16 mask = __mmask16((1u << cols) - 1);
          __m512i x[16];
          for (int i = 0; i < 16; ++i)
            x[i] = _mm512_maskz_loadu_epi32(mask, &w.qb[(size_t(hl) * rows + r0 + i) * DP + dp0]);
          transpose16(x);
          for (int c = 0; c < cols; ++c)
            _mm512_storeu_si512(&w.qt[(size_t(hl) * rows + r0) * DP + (dp0 + c) * 16], x[c]);
        }
  }
#endif
}

// Stage: begin_chunk. A chunk's online softmax starts empty: max -inf, sum 0, accumulator 0.
inline void begin_chunk(const TaskShape& sh, Scratch& w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t rows = sh.rows, heads = sh.heads;
  for (int64_t hl = 0; hl < heads; ++hl)
    for (int64_t r = 0; r < rows; ++r) w.m[hl * rows + r] = kNegInf, w.l[hl * rows + r] = 0.0;
  std::fill(w.acc.begin(), w.acc.begin() + size_t(rows) * heads * sh.Dv, 0.0);
}

// Tokens [j0, j0 + n) of the chunk ending at c1, n <= kTileTokens.
inline int tile_len(int64_t j0, int64_t c1) { return int(std::min<int64_t>(kTileTokens, c1 - j0)); }

// The cache rows of the walk's tiles: each token's head-0 row, for this tile and the next (slots
// 0 and 1, alternating).
template <typename CT>
struct TileRows {
  const CT* kc;
  const CT* vc;
  const int32_t* table;  // the sequence's block table row
  const CT* k_tokens[2][kTileTokens];
  const CT* v_tokens[2][kTileTokens];

  // Stage: locate_tile. The n tokens of the tile at j0 into slot. One division per tile, not per
  // token (a 64-bit division costs more than a token's math at small head sizes); the next
  // block's table entry is read only when a token lies in it. Keys of the tile before lo_all (the
  // first tile only) point at key lo_all: their scores are masked and their probabilities 0, and
  // their blocks (outside a window) are never read.
  void locate(const AttentionParams& p, int64_t lo_all, int64_t j0, int n, int slot) {
    const int hidden = int(std::clamp<int64_t>(lo_all - j0, 0, n - 1));
    int64_t index = (j0 + hidden) / p.block_size, offset = (j0 + hidden) % p.block_size;
    const CT* k_block = kc + table[index] * p.k_stride_block;
    const CT* v_block = vc + table[index] * p.v_stride_block;
    for (int j = hidden; j < n; ++j, ++offset) {
      if (offset == p.block_size) {
        offset = 0, ++index;
        k_block = kc + table[index] * p.k_stride_block;
        v_block = vc + table[index] * p.v_stride_block;
      }
      k_tokens[slot][j] = k_block + offset * p.k_stride_token;
      v_tokens[slot][j] = v_block + offset * p.v_stride_token;
    }
    for (int j = 0; j < hidden; ++j) k_tokens[slot][j] = k_tokens[slot][hidden], v_tokens[slot][j] = v_tokens[slot][hidden];
  }
};

// A tile's rows as Finite when none holds a NaN byte (the widening that skips the NaN fix-up),
// else nullptr (read them as Exact). buf: room for the Finite pointers.
template <typename CT>
inline const typename CacheRead<CT>::Finite* const* as_finite(const typename CacheRead<CT>::Exact* const* rows, int n,
                                                               int D, const typename CacheRead<CT>::Finite** buf) {
  using Exact = typename CacheRead<CT>::Exact;
  using Finite = typename CacheRead<CT>::Finite;
  if constexpr (std::is_same_v<Exact, Finite>) {
    return rows;
  } else {
    if (any_e4m3_nan(rows, n, D)) return nullptr;
    for (int j = 0; j < n; ++j) buf[j] = reinterpret_cast<const Finite*>(rows[j]);
    return buf;
  }
}

#if defined(PAGED_CPU_AMX)
// The heads path's A operands (amx_qk_heads): the first key row of each 16-token half of the tile
// (n tokens, bf16 rows of D) and the bytes between its rows. The rows as they lie where the half
// is 16 evenly spaced rows (16 tokens in one block); else (block sizes below 16, the tile's end,
// rows the first tile aliases) a copy in buf, rows past n zero.
inline void key_halves(const uint16_t* const* k, int n, int D, uint16_t* buf, const void* keys[2],
                       int64_t key_stride[2]) {
  for (int half = 0; half < 2 && 16 * half < n; ++half) {
    const int j0 = 16 * half;
    const uint16_t* const* rows = k + j0;
    const auto at = [&](int i) { return int64_t(reinterpret_cast<uintptr_t>(rows[i])); };
    bool even = j0 + 16 <= n;
    const int64_t step = even ? at(1) - at(0) : 0;
    for (int i = 2; even && i < 16; ++i) even = at(i) - at(i - 1) == step;
    if (even) {
      keys[half] = rows[0], key_stride[half] = step;
      continue;
    }
    uint16_t* copy = buf + size_t(j0) * D;
    for (int i = 0; i < 16; ++i) {
      if (j0 + i < n)
        std::memcpy(copy + size_t(i) * D, rows[i], size_t(D) * 2);
      else
        std::memset(copy + size_t(i) * D, 0, size_t(D) * 2);
    }
    keys[half] = copy, key_stride[half] = int64_t(D) * 2;
  }
}
#endif

// Stage: score_tile (QK). w.s[r][j] = the scaled score of row r and token j of the tile, for the
// rows of KV head h (local index hl), by the task's micro-kernels; next: the next tile's prefetches.
template <typename QT, typename CT, typename P>
__attribute__((always_inline)) inline void score_tile(const AttentionParams& p, const Task& t, const TaskShape& sh,
                                                      Scratch& w, int64_t hl, int64_t h,
                                                      const typename CacheRead<CT>::Exact* const* k_rows, int n,
                                                      const P& next) {
  using Exact = typename CacheRead<CT>::Exact;
  using Finite = typename CacheRead<CT>::Finite;
  const int D = sh.Dk;  // query and key rows
  const int64_t rows = sh.rows;
#if defined(__AVX512BF16__)
  // The dot paths' query is bf16 as it is: the scale multiplies their fp32 scores.
  const float q_mul = p.scale * k_scale_of(p, t.seq, h) * CacheRead<CT>::kUnit;
  if (sh.heads_path) {  // w.st, [token][row]
    const uint16_t* widened[kTileTokens];
    const uint16_t* const* k = dot_rows<CT>(k_rows, n, D, w.kw.data(), widened);
    const uint32_t* qt = &w.qt[size_t(hl) * rows * D / 2];
#if defined(PAGED_CPU_AMX)
    next.rows(0, n);
    const void* keys[2];
    int64_t key_stride[2];
    key_halves(k, n, D, w.kg.data(), keys, key_stride);
    amx_qk_heads(rows, qt, D / 2, keys, key_stride, n, q_mul, w.st.data());
#else
    dot_qk_heads(rows, qt, D / 2, k, n, q_mul, w.st.data(), next);
#endif
    return;
  }
  if (sh.dot) {
    const uint16_t* widened[kTileTokens];  // fp8 caches: the rows widened to bf16 (in w.kw)
    transpose_keys(dot_rows<CT>(k_rows, n, D, w.kw.data(), widened), n, D, w.kt.data(), next);
    const uint32_t* qb = &w.qb[size_t(hl) * rows * D / 2];
    dot_qk_rows(rows, qb, D / 2, w.kt.data(), q_mul, w.s.data());
    return;
  }
  if (sh.small_dot) {
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(&w.qb[size_t(hl) * rows * D / 2]);
    small_qk_rows(rows, qb, D, reinterpret_cast<const SmallDotElem<CT>* const*>(k_rows), n, q_mul, w.s.data(), next);
    return;
  }
#else
  (void)p, (void)t, (void)h;
#endif
  const float* q = &w.q[size_t(hl) * rows * D];
  const Finite* finite_rows[kTileTokens];
  if (const Finite* const* k_fast = as_finite<CT>(k_rows, n, D, finite_rows))
    for_row_blocks<QK, Finite>(rows, q, D, k_fast, n, w.s.data(), next);
  else
    for_row_blocks<QK, Exact>(rows, q, D, k_rows, n, w.s.data(), next);
}

// Stage: apply_variants. On one row's scores of a tile: the soft-cap (the whole tile, before the
// mask: a capped -inf is -softcap), the mask of the keys it does not see (all but [first, last):
// window, causal mask, end of the tile), and ALiBi's slope * (j - position), the key's distance
// to the query (slope: nullptr without ALiBi; distance: the tile's first key minus the position).
__attribute__((always_inline)) inline void apply_variants(const AttentionParams& p, float* s, int first, int last,
                                                          const float* slope, int64_t distance) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // SoftmaxVec (vec16.h): 16 lanes on AVX-512 builds, two vectors a tile; else Vec8.
  using SV = SoftmaxVec;
  if (p.softcap > 0.f)
    for (int c = 0; c < kTileTokens; c += SV::kLanes) SV::softcap(SV::load(s + c), p.softcap).store(s + c);
  std::fill(s, s + first, kNegInf);
  std::fill(s + last, s + kTileTokens, kNegInf);
  if (slope != nullptr) {
    const float k = *slope;
    for (int j = first; j < last; ++j) s[j] += k * float(distance + j);
  }
}

// Stage: online_softmax_update. One row's tile of scores s (masked) into its running max m and
// sum l; s becomes the tile's probabilities exp(s - m). Returns the factor the row's accumulator
// takes (1 when the max stays; the caller rescales). A tile whose visible scores are all -inf
// contributes nothing: s all 0, factor 1.
__attribute__((always_inline)) inline float online_softmax_update(float* s, float& m, double& l) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  using SV = SoftmaxVec;
  SV vmax = SV::load(s), vsum = vmax;
  for (int c = SV::kLanes; c < kTileTokens; c += SV::kLanes) {
    vmax = SV::max(vmax, SV::load(s + c));
    vsum = vsum + SV::load(s + c);
  }
  float tile_max = vmax.reduce_max();
  // A NaN score (a NaN in K) makes the row NaN, as in the reference: the max above may drop
  // NaN, so the lane sums tell (a lane test, no horizontal sum); NaN then flows through m,
  // the correction, exp and l. +inf does too: exp(inf - inf) is NaN.
  if (vsum.any_nan()) tile_max = std::numeric_limits<float>::quiet_NaN();
  if (tile_max == kNegInf) {
    std::fill(s, s + kTileTokens, 0.f);
    return 1.f;
  }
  const float m_new = std::isnan(tile_max) ? tile_max : std::max(m, tile_max);
  // exp(-inf) = 0 on the first tile; 1 (exp(0), no libm call) when the max stays
  const float correction = m_new == m ? 1.f : std::exp(m - m_new);
  const SV shift = SV::broadcast(m_new);
  SV sum = SV::zero();
  for (int c = 0; c < kTileTokens; c += SV::kLanes) {
    const SV e = SV::exp(SV::load(s + c) - shift);
    e.store(s + c);
    sum = sum + e;
  }
  l = l * correction + sum.sum();
  m = m_new;
  return correction;
}

#if defined(__AVX512BF16__)
// Stage: softmax_tile_heads, the heads path's softmax_tile on w.st ([token][row]): the same
// variants and online softmax (apply_variants, online_softmax_update) on 16 rows at once, lane r
// for row r, since the rows share their keys (one mask for all) and the tile's max and sum run
// down the tokens, no horizontal reduction. Then the probabilities as
// PV's A operand, w.pb [rows][16 token pairs] (pack_bf16's rounding and pairs).
inline void softmax_tile_heads(const AttentionParams& p, const TaskShape& sh, Scratch& w, int64_t hl, int64_t h,
                               int64_t j0, int n) {
  const int64_t rows = sh.rows;
  const int first = int(std::clamp<int64_t>(w.first_visible[0] - j0, 0, n));
  const int last = int(std::clamp<int64_t>(w.last_visible[0] - j0 + 1, 0, n));
  const int64_t distance = j0 - w.position[0];  // ALiBi's, as apply_variants
  float* st = w.st.data();
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  alignas(64) static const uint16_t pair_index[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(pair_index);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const __m512 slope = p.alibi_slopes ? _mm512_loadu_ps(p.alibi_slopes + h * sh.group + r0) : zero;
    __m512 tile_max = neg_inf;
    __mmask16 nan = 0;
    for (int j = first; j < last; ++j) {
      Vec16 x = Vec16::load(st + j * rows + r0);
      if (p.softcap > 0.f) x = Vec16::softcap(x, p.softcap);
      if (p.alibi_slopes != nullptr) x.v = _mm512_add_ps(x.v, _mm512_mul_ps(slope, _mm512_set1_ps(float(distance + j))));
      x.store(st + j * rows + r0);
      tile_max = _mm512_max_ps(x.v, tile_max);  // drops a NaN score: the mask below keeps it
      nan |= _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
    }
    // online_softmax_update's cases per lane: a NaN score makes the row NaN; a tile of -inf
    // scores leaves the row alone; else the max is std::max(m, tile_max) (a NaN m stays: max_ps
    // passes its second operand's NaN) and the correction exp(m - m_new) where the max moved.
    float* m = &w.m[hl * rows + r0];
    const __m512 m_old = _mm512_loadu_ps(m);
    const __mmask16 take = _mm512_cmp_ps_mask(tile_max, neg_inf, _CMP_NEQ_OQ) | nan;
    __m512 m_new = _mm512_mask_mov_ps(_mm512_max_ps(tile_max, m_old), nan,
                                      _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    m_new = _mm512_mask_mov_ps(m_old, take, m_new);
    const __mmask16 moved = take & _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_UQ);
    const __m512 correction = _mm512_mask_mov_ps(one, moved, Vec16::exp({_mm512_sub_ps(m_old, m_new)}).v);
    __m512 sum = zero;
    for (int j = 0; j < kTileTokens; ++j) {
      float* s = st + j * rows + r0;
      if (j < first || j >= last) {
        _mm512_storeu_ps(s, zero);
        continue;
      }
      const __m512 e = _mm512_maskz_mov_ps(take, Vec16::exp({_mm512_sub_ps(_mm512_loadu_ps(s), m_new)}).v);
      _mm512_storeu_ps(s, e);
      sum = _mm512_add_ps(sum, e);
    }
    double* l = &w.l[hl * rows + r0];
    for (int i = 0; i < 2; ++i) {  // l = l * correction + sum, in fp64 (1 and 0 where the row took nothing)
      const __m512d c = _mm512_cvtps_pd(i == 0 ? _mm512_castps512_ps256(correction)
                                               : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(correction), 1)));
      const __m512d t = _mm512_cvtps_pd(i == 0 ? _mm512_castps512_ps256(sum)
                                               : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
      _mm512_storeu_pd(l + 8 * i, _mm512_add_pd(_mm512_mul_pd(_mm512_loadu_pd(l + 8 * i), c), t));
    }
    _mm512_storeu_ps(m, m_new);
    if (moved) {
      alignas(64) float factor[16];
      _mm512_store_ps(factor, correction);
      for (int i = 0; i < 16; ++i) {
        if (!((moved >> i) & 1)) continue;
        const int64_t row = hl * rows + r0 + i;
        float* a = &w.acc32[size_t(row) * sh.dot_dv];
        for (int d = 0; d < sh.Dv; ++d) a[d] *= factor[i];
        w.acc_scale[row] *= factor[i];
      }
    }
    // pb: row r's probabilities of tokens (2k, 2k + 1) in word k: token pairs of 16 rows as words
    // (cvtne2ps's halves interleaved), transposed to rows.
    __m512i x[16];
    for (int k = 0; k < kTileTokens / 2; ++k) {
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(st + (2 * k + 1) * rows + r0),
                                                _mm512_loadu_ps(st + 2 * k * rows + r0));
      x[k] = _mm512_permutexvar_epi16(pairs, (__m512i)both);
    }
    transpose16(x);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(&w.pb[size_t(r0 + i) * (kTileTokens / 2)], x[i]);
  }
}
#endif

// Stage: softmax_tile. The rows of KV head h (local hl) over the tile at j0 of n tokens: each
// row's variants and online softmax (w.s becomes the probabilities; 0 where a row sees nothing),
// and its accumulator rescaled by the factor: acc, or on the dot path acc32 now and acc (fp64,
// rows too large to rescale often) at the next flush (acc_scale).
__attribute__((always_inline)) inline void softmax_tile(const AttentionParams& p, const TaskShape& sh, Scratch& w,
                                                        int64_t hl, int64_t h, int64_t j0, int n) {
#if defined(__AVX512BF16__)
  if (sh.heads_path) return softmax_tile_heads(p, sh, w, hl, h, j0, n);
#endif
  const int D = sh.Dv;  // accumulator rows
  const int64_t rows = sh.rows, group = sh.group;
  double* acc = &w.acc[size_t(hl) * rows * D];
  float* m = &w.m[hl * rows];
  double* l = &w.l[hl * rows];
  for (int64_t r = 0; r < rows; ++r) {
    float* s = &w.s[size_t(r) * kTileTokens];
    const int first = int(std::clamp<int64_t>(w.first_visible[r] - j0, 0, n));
    const int last = int(std::clamp<int64_t>(w.last_visible[r] - j0 + 1, 0, n));
    if (last <= first) {  // the row sees nothing here: contributes nothing
      std::fill(s, s + kTileTokens, 0.f);
      continue;
    }
    apply_variants(p, s, first, last, p.alibi_slopes != nullptr ? &p.alibi_slopes[h * group + r % group] : nullptr,
                   j0 - w.position[r]);
    const float correction = online_softmax_update(s, m[r], l[r]);
    if (correction != 1.f) {
#if defined(__AVX512BF16__)
      if (sh.dot) {
        for (int d = 0; d < D; ++d) w.acc32[(size_t(hl) * rows + r) * sh.dot_dv + d] *= correction;
        w.acc_scale[hl * rows + r] *= correction;
      } else
#endif
      for (int d = 0; d < D; ++d) acc[size_t(r) * D + d] *= correction;
    }
  }
}

// The values of a tile hidden from some row that hold an inf or NaN element (hide_nonfinite_values).
struct NonfiniteValues {
  int tokens[kTileTokens];          // their tokens in the tile
  const void* rows[kTileTokens];    // their rows as they lie in the cache
  int count = 0;
};

// Stage: hide_nonfinite_values. Of the tile's keys hidden from some row (outside [seen_lo,
// seen_hi), from aliased on: keys before it read the zero row), the values with an inf or NaN
// element: v_rows then points at a copy with those elements 0 (copy_finite), their p * v added
// to the rows that see them after PV (add_nonfinite_values).
template <typename CT>
inline void hide_nonfinite_values(Scratch& w, const typename CacheRead<CT>::Exact** v_rows, int aliased, int seen_lo,
                                  int seen_hi, int n, int D, NonfiniteValues& nf) {
  using Exact = typename CacheRead<CT>::Exact;
  for (int j = aliased; j < n; ++j) {
    if ((j >= seen_lo && j < seen_hi) || !any_nonfinite<CT>(v_rows[j], D)) continue;
    void* copy = &w.v_finite[size_t(j) * D];
    copy_finite<CT>(v_rows[j], D, copy);
    nf.rows[nf.count] = v_rows[j];
    nf.tokens[nf.count++] = j;
    v_rows[j] = static_cast<const Exact*>(copy);
  }
}

// Stage: accumulate_pv (PV). acc += p . v over the tile at j0 (n tokens) of the chunk [c0, c1)
// for the rows of KV head h (local hl), by the task's micro-kernels, plus the non-finite values'
// terms; the dot path sums in acc32 and flushes it to acc every kDotFlushTiles tiles and at the
// chunk's end.
template <typename QT, typename CT, typename P>
__attribute__((always_inline)) inline void accumulate_pv(const TaskShape& sh, Scratch& w, int64_t hl,
                                                         const typename CacheRead<CT>::Exact* const* v_rows, int n,
                                                         const P& next, const NonfiniteValues& nf, int64_t j0,
                                                         int64_t c0, int64_t c1) {
  using Exact = typename CacheRead<CT>::Exact;
  using Finite = typename CacheRead<CT>::Finite;
  const int D = sh.Dv;  // value and accumulator rows
  const int64_t rows = sh.rows;
  double* acc = &w.acc[size_t(hl) * rows * D];
#if defined(__AVX512BF16__)
  if (sh.dot) {
    const uint16_t* widened[kTileTokens];
    interleave_values(dot_rows<CT>(v_rows, n, D, w.kw.data(), widened), n, D, w.vp.data(), sh.dot_dv);
    if (!sh.heads_path) {
      pack_bf16(w.s.data(), int(rows * kTileTokens), w.pb.data());
    } else if (nf.count > 0) {  // add_nonfinite_values reads the probabilities as [row][token]
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < kTileTokens; ++j) w.s[size_t(r) * kTileTokens + j] = w.st[size_t(j) * rows + r];
    }
    float* acc32 = &w.acc32[size_t(hl) * rows * sh.dot_dv];
    dot_pv_rows(rows, acc32, w.pb.data(), w.vp.data(), sh.dot_dv);
    if (nf.count > 0)  // before the flush: acc32 holds this tile's sums
      add_nonfinite_values<CT>(rows, w.s.data(), w.first_visible.data(), w.last_visible.data(), j0, nf.tokens,
                               nf.rows, nf.count, D, acc32, sh.dot_dv);
    if (j0 + kTileTokens >= c1 || ((j0 - c0) / kTileTokens + 1) % kDotFlushTiles == 0)
      flush_acc(rows, acc32, sh.dot_dv, acc, D, &w.acc_scale[hl * rows]);
    return;
  }
  if (sh.small_dot) {
    pack_bf16(w.s.data(), int(rows * kTileTokens), w.pb.data());
    small_pv_rows(rows, acc, D, w.pb.data(), reinterpret_cast<const SmallDotElem<CT>* const*>(v_rows), n, next);
  } else
#else
  (void)c0, (void)c1, (void)next;
#endif
  {
    const Finite* finite_rows[kTileTokens];
    if (const Finite* const* v_fast = as_finite<CT>(v_rows, n, D, finite_rows))
      for_row_blocks<PV, Finite>(rows, acc, D, w.s.data(), v_fast, n);
    else
      for_row_blocks<PV, Exact>(rows, acc, D, w.s.data(), v_rows, n);
  }
  if (nf.count > 0)
    add_nonfinite_values<CT>(rows, w.s.data(), w.first_visible.data(), w.last_visible.data(), j0, nf.tokens, nf.rows,
                             nf.count, D, acc, D);
}

// Stage: finish_chunk. The chunk's part of each row, its normalized output and log-sum-exp:
// written as the row's out and lse (direct), to the split's part (partial / part_lse), or folded
// into the row's chunks (fold_part).
template <typename QT, typename CT>
inline void finish_chunk(const AttentionParams& p, const Task& t, const TaskShape& sh, Scratch& w, float* partial,
                         double* part_lse) {
  const int D = sh.Dv;  // output rows
  const int64_t rows = sh.rows, group = sh.group;
  for (int64_t hl = 0; hl < sh.heads; ++hl) {
    const int64_t kv_head = t.kv_head_begin + hl;
    const double v_mul = v_scale_of(p, t.seq, kv_head) * CacheRead<CT>::kUnit;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = hl * rows + r;
      const double* acc = &w.acc[size_t(row) * D];
      if (sh.direct) {
        const int64_t token = t.q_begin + r / group, head = kv_head * group + r % group;
        finish_row(double(w.m[row]), w.l[row], acc, D, v_mul, p.sinks ? p.sinks + head : nullptr, w.out.data(),
                   p.lse ? p.lse + token * p.num_heads + head : nullptr);
        from_float(w.out.data(), static_cast<QT*>(p.out) + token * p.o_stride_token + head * p.o_stride_head, D);
        continue;
      }
      // l == 0: the row saw no key in this chunk, or every score it saw was -inf: lse -inf,
      // a part the fold skips (fold_part; out 0 when no part is left). l is NaN for NaN rows.
      const double lse = w.l[row] == 0.0 ? -std::numeric_limits<double>::infinity()
                                         : double(w.m[row]) + std::log(w.l[row]);
      const double norm = v_mul / w.l[row];
      float* part = sh.split ? partial + (t.partial_offset + row) * D : w.out.data();
      for (int d = 0; d < D; ++d) part[d] = float(acc[d] * norm);
      if (sh.split)
        part_lse[t.partial_offset + row] = lse;
      else
        fold_part(w.fold_m[row], w.fold_w[row], &w.fold_acc[size_t(row) * D], D, lse, part);
    }
  }
}

// Stage: finish_rows. A task that folded its chunks itself: each row's output and lse from its
// fold and its sink (fold_finish).
template <typename QT>
inline void finish_rows(const AttentionParams& p, const Task& t, const TaskShape& sh, Scratch& w) {
  const int D = sh.Dv;  // output rows
  const int64_t rows = sh.rows, group = sh.group;
  for (int64_t hl = 0; hl < sh.heads; ++hl) {
    const int64_t kv_head = t.kv_head_begin + hl;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = hl * rows + r;
      const int64_t token = t.q_begin + r / group, head = kv_head * group + r % group;
      fold_finish(w.fold_m[row], w.fold_w[row], &w.fold_acc[size_t(row) * D], D, p.sinks ? p.sinks + head : nullptr,
                  w.out.data(), p.lse ? p.lse + token * p.num_heads + head : nullptr);
      from_float(w.out.data(), static_cast<QT*>(p.out) + token * p.o_stride_token + head * p.o_stride_head, D);
    }
  }
}

// Runs one task: plan_rows (with choose_kernels), load_queries, then per chunk (begin_chunk) the KV walk
// tile by tile (locate_tile; per KV head score_tile, softmax_tile, hide_nonfinite_values,
// accumulate_pv) and finish_chunk, then finish_rows. Tiles are the outer loop and heads the inner
// one, so the task walks each token's K/V rows of all its heads together: contiguous memory in
// the usual layouts, which is what the hardware prefetcher follows. Writes out and lse
// (num_splits == 1) or its one part to partial / part_lse (split tasks).
template <typename QT, typename CT>
void run_task(const AttentionParams& p, const Task& t, Scratch& w, float* partial, double* part_lse) {
  const TaskShape sh = plan_rows<QT, CT>(p, t, w);
  load_queries<QT, CT>(p, t, sh, w);
  if (sh.split && sh.begin >= sh.end)  // none of the rows sees this split: an empty part each
    for (int64_t row = 0; row < sh.rows * sh.heads; ++row)
      part_lse[t.partial_offset + row] = -std::numeric_limits<double>::infinity();

  using Exact = typename CacheRead<CT>::Exact;
  TileRows<CT> tiles;
  tiles.kc = static_cast<const CT*>(p.key_cache);
  tiles.vc = static_cast<const CT*>(p.value_cache);
  tiles.table = p.block_tables + t.seq * p.block_table_stride;
  const Exact* k_rows[kTileTokens];  // the rows of the head being computed
  const Exact* v_rows[kTileTokens];
  // Prefetched bytes per token and head. Value rows inside the key rows (the absorbed latent:
  // value_cache = key_cache[..., :Dv], the same strides) come with the keys' lines.
  const int64_t k_row_bytes = int64_t(sh.Dk) * sizeof(CT);
  const int64_t v_row_bytes = values_in_key_rows(p) ? 0 : int64_t(sh.Dv) * sizeof(CT);

  // Chunks: the whole range, or (batch-invariant mode) its pieces between absolute multiples of
  // chunk_tokens. Each is one online softmax, then folded into the rows' outputs.
  for (int64_t c0 = sh.begin, c1; c0 < sh.end; c0 = c1) {
    c1 = t.chunk_tokens > 0 ? std::min(sh.end, (c0 / t.chunk_tokens + 1) * t.chunk_tokens) : sh.end;
    begin_chunk(sh, w);
    const int first_n = tile_len(c0, c1);
    tiles.locate(p, sh.lo_all, c0, first_n, 0);
    for (int64_t hl = 0; hl < sh.heads; ++hl) {
      const int64_t h = t.kv_head_begin + hl;
      Prefetch<CT>{tiles.k_tokens[0], tiles.v_tokens[0], first_n, k_row_bytes, v_row_bytes, 1, h * p.k_stride_head,
                   h * p.v_stride_head}
          .rows(0, kTileTokens);
    }
    for (int64_t j0 = c0, slot = 0; j0 < c1; j0 += kTileTokens, slot ^= 1) {
      const int n = tile_len(j0, c1);
      int next_n = 0;
      if (c1 - j0 > kTileTokens) {
        next_n = tile_len(j0 + kTileTokens, c1);
        tiles.locate(p, sh.lo_all, j0 + kTileTokens, next_n, int(slot ^ 1));
      }
      // The tile's keys every row sees: [seen_lo, seen_hi); the others are hidden from some row,
      // and their values are scanned for inf / NaN before PV (hide_nonfinite_values).
      const int seen_lo = int(std::clamp<int64_t>(sh.common_lo - j0, 0, n));
      const int seen_hi = int(std::clamp<int64_t>(sh.common_hi - j0 + 1, seen_lo, n));
      const bool some_hidden = seen_lo > 0 || seen_hi < n;
      // Keys before lo_all (locate_tile: they point at key lo_all) take a value row of zeros.
      const int aliased = int(std::clamp<int64_t>(sh.lo_all - j0, 0, n - 1));
      for (int64_t hl = 0; hl < sh.heads; ++hl) {
        const int64_t h = t.kv_head_begin + hl;
        for (int j = 0; j < n; ++j) {
          k_rows[j] = reinterpret_cast<const Exact*>(tiles.k_tokens[slot][j] + h * p.k_stride_head);
          v_rows[j] = reinterpret_cast<const Exact*>(tiles.v_tokens[slot][j] + h * p.v_stride_head);
        }
        for (int j = 0; j < aliased; ++j) v_rows[j] = reinterpret_cast<const Exact*>(w.v_zero.data());
        const Prefetch<CT> next{tiles.k_tokens[slot ^ 1], tiles.v_tokens[slot ^ 1], next_n, k_row_bytes, v_row_bytes,
                                (kTileTokens + n - 1) / n, h * p.k_stride_head, h * p.v_stride_head};
        score_tile<QT, CT>(p, t, sh, w, hl, h, k_rows, n, next);
        softmax_tile(p, sh, w, hl, h, j0, n);
        NonfiniteValues nf;
        if (some_hidden) hide_nonfinite_values<CT>(w, v_rows, aliased, seen_lo, seen_hi, n, sh.Dv, nf);
        accumulate_pv<QT, CT>(sh, w, hl, v_rows, n, next, nf, j0, c0, c1);
      }
    }
    finish_chunk<QT, CT>(p, t, sh, w, partial, part_lse);
  }
  if (sh.split || sh.direct) return;
  finish_rows<QT>(p, t, sh, w);
}

// Merges the splits of one (seq, kv head, query tile): the rows' parts folded in position
// order (fold_part, as a task folds its chunks), the sink added once, out and lse written.
// In fp64: an fp32 lse of a long context (~18 at 1e8 tokens) would carry a ~1e-6 weight error.
template <typename QT>
void merge_splits(const AttentionParams& p, const Task* splits, const float* partial, const double* part_lse) {
  const int D = int(p.value_head_size);  // the parts' and the output's rows
  const int64_t group = p.num_heads / p.num_kv_heads;
  const Task& t = splits[0];
  const int64_t rows = (t.q_end - t.q_begin) * group;  // per KV head
  std::vector<double> acc(D);
  std::vector<float> out(D);
  for (int64_t row = 0; row < rows * (t.kv_head_end - t.kv_head_begin); ++row) {
    double m = -std::numeric_limits<double>::infinity(), w = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t i = 0; i < t.num_splits; ++i) {
      const int64_t prow = splits[i].partial_offset + row;
      fold_part(m, w, acc.data(), D, part_lse[prow], partial + prow * D);
    }
    const int64_t r = row % rows, kv_head = t.kv_head_begin + row / rows;
    const int64_t token = t.q_begin + r / group, head = kv_head * group + r % group;
    fold_finish(m, w, acc.data(), D, p.sinks ? p.sinks + head : nullptr, out.data(),
                p.lse ? p.lse + token * p.num_heads + head : nullptr);
    from_float(out.data(), static_cast<QT*>(p.out) + token * p.o_stride_token + head * p.o_stride_head, D);
  }
}

// Cuts the batch into tasks. A task takes all KV heads of its sequence (contiguous reads) unless
// that leaves threads idle; then heads are spread over tasks, and only then is a long sequence's
// KV split, so short-context batches never pay for the merge. Each query tile's KV range is
// what its rows see (a window skips the rest), from a tile boundary.
inline std::vector<Task> plan_tasks(const AttentionParams& p, int num_threads, int64_t& partial_rows) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  // ~128 rows per KV head and task: a K/V tile's re-layout (bf16 dot path) and a task's set-up
  // and epilogue are paid once for more rows (1 x 2048 causal: +7% per CPU second over 64).
  const int64_t tile_tokens = std::max<int64_t>(1, 128 / group);
  int64_t query_tiles = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = query_rows(p, s).size();
    query_tiles += (q_len + tile_tokens - 1) / tile_tokens;
  }
  const int64_t wanted = num_threads > 1 ? int64_t(num_threads) * kTasksPerThread : 1;
  int64_t heads_per_task = p.num_kv_heads;
  while (heads_per_task > 1 && query_tiles * ((p.num_kv_heads + heads_per_task - 1) / heads_per_task) < wanted)
    heads_per_task = (heads_per_task + 1) / 2;
  const int64_t base_tasks = query_tiles * ((p.num_kv_heads + heads_per_task - 1) / heads_per_task);
  const int64_t max_splits = base_tasks >= wanted ? 1 : (wanted + base_tasks - 1) / std::max<int64_t>(base_tasks, 1);

  std::vector<Task> tasks;
  partial_rows = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const QueryRows seq_rows = query_rows(p, s);
    const int64_t q0 = seq_rows.begin, q1 = seq_rows.end, kv_len = p.seq_lens[s];
    if (q1 == q0) continue;  // no query rows (seq_len may be 0 then): nothing to compute
    for (int64_t qb = q0; qb < q1; qb += tile_tokens) {
      const int64_t qe = std::min(q1, qb + tile_tokens);
      // The tile's rows see [lo, hi] together (positions grow with the row).
      const int64_t lo = row_range(p, kv_len, q1 - q0, qb - q0).lo;
      const int64_t hi = row_range(p, kv_len, q1 - q0, qe - 1 - q0).hi;
      if (hi < lo) {  // no row of the tile sees a key: a task with no KV writes their empty rows
        for (int64_t h0 = 0; h0 < p.num_kv_heads; h0 += heads_per_task)
          tasks.push_back(Task{s, h0, std::min(p.num_kv_heads, h0 + heads_per_task), qb, qe, lo, lo, 0, 0, 1, 0});
        continue;
      }
      int64_t first = lo / kTileTokens * kTileTokens, per_split, num_splits, chunk_tokens = 0;
      if (p.batch_invariant) {
        // Chunks on absolute multiples of a fixed size: tasks of their own when threads are idle
        // and their partial outputs are small, else folded in one task (the same bits).
        const int64_t chunk = kBatchInvariantSplitTokens;
        first = lo / chunk * chunk;
        const int64_t chunks = hi / chunk - lo / chunk + 1;
        if (max_splits > 1 && chunks > 1 && partial_rows + chunks * (qe - qb) * p.num_heads <= kMaxPartialRows) {
          per_split = chunk, num_splits = chunks;
        } else {
          per_split = hi + 1 - first, num_splits = 1, chunk_tokens = chunk;
        }
      } else {
        const int64_t visible = hi + 1 - first;
        const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(max_splits, visible / kMinSplitTokens));
        // Split boundaries on tile multiples keep every split's tiles full; at least one tile.
        per_split = std::max<int64_t>(kTileTokens, ((visible + splits - 1) / splits + kTileTokens - 1) / kTileTokens * kTileTokens);
        num_splits = std::max<int64_t>(1, (visible + per_split - 1) / per_split);
      }
      for (int64_t h0 = 0; h0 < p.num_kv_heads; h0 += heads_per_task) {
        const int64_t h1 = std::min(p.num_kv_heads, h0 + heads_per_task);
        for (int64_t i = 0; i < num_splits; ++i) {
          Task t{s, h0, h1, qb, qe, first + i * per_split, std::min(hi + 1, first + (i + 1) * per_split),
                 chunk_tokens, i, num_splits, 0};
          if (num_splits > 1) {
            t.partial_offset = partial_rows;
            partial_rows += (qe - qb) * group * (h1 - h0);
          }
          tasks.push_back(t);
        }
      }
    }
  }
  return tasks;
}

template <typename QT, typename CT>
void paged_attention(const AttentionParams& p) {
  if (p.num_kv_heads <= 0 || p.num_heads <= 0) return;  // validated away; nothing to compute
  // A parallel region costs a wake-up of every thread, and a whole time slice when another
  // process holds a core: small calls (an engine's decode step on a short context) run inline,
  // and then nothing is gained by splitting KV either.
  double work = 0;  // multiply-adds, roughly (a double: q_len x seq_len x heads can pass 2^63)
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = query_rows(p, s).size();
    // keys a row sees: at most the window (left + right + 1) where it has both edges
    const int64_t right = p.causal ? 0 : p.window_right;
    const int64_t keys = p.window_left >= 0 && right >= 0
                             ? std::min<int64_t>(p.seq_lens[s], p.window_left + right + q_len)
                             : p.seq_lens[s];
    work += double(q_len) * keys * p.num_heads * double(p.head_size + p.value_head_size) / 2;  // QK and PV
  }
  const bool parallel = work >= double(kMinParallelWork) && omp_get_max_threads() > 1;
  int64_t partial_rows = 0;
  const std::vector<Task> tasks = plan_tasks(p, parallel ? omp_get_max_threads() : 1, partial_rows);
  std::vector<float> partial(size_t(partial_rows) * p.value_head_size);
  std::vector<double> part_lse(partial_rows);
  const int64_t num_tasks = int64_t(tasks.size());
  // Run largest first (keys walked x rows), so the dynamic schedule ends on small tasks: causal
  // prefill's tiles grow along the sequence, and in plan order the last big tile ran alone.
  // Only the order of running changes (tasks stays in plan order: merge_splits reads a tile's
  // splits side by side); each task's bits are its own, batch-invariant mode included.
  std::vector<int64_t> order(num_tasks);
  for (int64_t i = 0; i < num_tasks; ++i) order[i] = i;
  if (parallel)
    std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
      const Task &a = tasks[i], &b = tasks[j];
      return (a.kv_end - a.kv_begin) * (a.q_end - a.q_begin) * (a.kv_head_end - a.kv_head_begin) >
             (b.kv_end - b.kv_begin) * (b.q_end - b.q_begin) * (b.kv_head_end - b.kv_head_begin);
    });

#pragma omp parallel if (parallel)
  {
    Scratch& scratch = thread_scratch();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i)
      run_task<QT, CT>(p, tasks[order[i]], scratch, partial.data(), part_lse.data());
    if (partial_rows > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < num_tasks; ++i)
        if (tasks[i].split == 0 && tasks[i].num_splits > 1)
          merge_splits<QT>(p, &tasks[i], partial.data(), part_lse.data());
    }
  }
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

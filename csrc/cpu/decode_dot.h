// QK and PV of a tile by AVX-512 BF16 dot products (vdpbf16ps) for tasks of FEW rows per KV head
// (decode: rows = the GQA group, 1..15), bf16 caches and fp8 caches under a bf16 query (widened
// to bf16 exactly in registers, bf16_dot.h's load_bf16x32), isa_avx512_bf16 build only, never in
// batch-invariant mode (attention.h decides). bf16_dot.h's path re-lays the whole tile out
// (keys transposed in 16 x 16 blocks), which costs as much as QK itself at 8 rows; here nothing
// is re-laid out in memory:
//   QK: keys in their natural layout. Each (row, token) pair gets a vector of 16 pair-products
//       (q[r][2i..2i+1] . k[j][2i..2i+1]) summed over the head's 32-column steps; 16 such
//       vectors are reduced at once by a transpose-add tree (45 instructions for 16 scores).
//       The query stays exact bf16 and the scale multiplies the fp32 scores, as in bf16_dot.h.
//   PV: two tokens' value rows interleaved in registers by word unpacks (one instruction per
//       16 columns, in-lane), their probabilities rounded to a bf16 pair; the unpacks permute
//       the columns, which one permutation per (row, 32 columns) undoes at the end of the tile
//       before the fp32 sums join the fp64 accumulator.
// vdpbf16ps treats bf16 denormals as zero (as in bf16_dot.h).
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "bf16_dot.h"  // column_mask, load_bf16x32
#include "convert.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

inline constexpr int kSmallTileTokens = 32;  // == kTileTokens: s rows are 32 floats apart

// Lane i of the result = the sum of v[i]'s 16 lanes.
// Inlined, and the loops over rows / tokens / accumulators unrolled: else GCC keeps the
// accumulator arrays in memory too (a store per dot product).
#define PAGED_DECODE_INLINE inline __attribute__((always_inline))
PAGED_DECODE_INLINE __m512 hsum16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  // per 128-bit lane: (v2k.x, v2k+1.x, v2k.y, v2k+1.y), x/y partial sums of that lane
#pragma GCC unroll 16
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  // per 128-bit lane: the lane's sums of v4k .. v4k+3
#pragma GCC unroll 16
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // 128-bit lanes (b0.L0+L1, b0.L2+L3, b1.L0+L1, b1.L2+L3)
#pragma GCC unroll 16
  for (int k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xdd));
  // 128-bit lane L: the totals of v4L .. v4L+3
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// s[r][j] = scale * (q[r] . k[j]) for R rows (q: [R][D] bf16, row stride D) and the tile's n
// tokens, 16 / R tokens per step (16 (row, token) vectors per reduction); P prefetches the next
// tile's keys as the tokens go. Scores of tokens past n (up to the step's end) are of token n - 1:
// finite, and masked by the softmax.
template <int R, typename E, typename P>
PAGED_DECODE_INLINE void qk_small(const uint16_t* q, int D, const E* const* k, int n, float scale, float* s, const P& next) {
  static_assert(R == 1 || R == 2 || R == 4 || R == 8, "16 / R tokens per step");
  constexpr int T = 16 / R;
  const __m512 mul = _mm512_set1_ps(scale);
  for (int j0 = 0; j0 < n; j0 += T) {
    const E* kj[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) kj[t] = k[j0 + t < n ? j0 + t : n - 1];
    __m512 a[16];  // a[r * T + t]: row r, token j0 + t
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 32) {
      const __mmask32 m = column_mask(D, c);
      __m512bh qv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) qv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, q + size_t(r) * D + c);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        // The next tile's keys one token at a time, its values in pv_small: K and V lines
        // together, or a step's tokens at once, fill the miss buffers and stall the loads
        // here (decode at 1 thread: MHA and group 4 went from below the 8-lane path's rate to
        // about equal with it when the values moved to PV).
        if (c == 0) next.keys(j0 + t, 1);
        const __m512bh kv = load_bf16x32(kj[t] + c, m);
  #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) a[r * T + t] = _mm512_dpbf16_ps(a[r * T + t], qv[r], kv);
      }
    }
    const __m512 sums = _mm512_mul_ps(hsum16(a), mul);
    // row r's T scores are lanes [r T, r T + T): one masked store each, at s[r][j0]
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(s + r * kSmallTileTokens + j0 - r * T, __mmask16(((1u << T) - 1) << (r * T)), sums);
  }
}

// Adds the fp32 sums of 32 columns (x0: columns 0..15, x1: 16..31, in order) to acc[0..cols).
PAGED_DECODE_INLINE void add_columns(double* acc, __m512 x0, __m512 x1, int cols) {
  // the upper halves through a double cast: AVX-512F alone has no 256-bit float extract
  const __m256 part[4] = {_mm512_castps512_ps256(x0), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x0), 1)),
                          _mm512_castps512_ps256(x1), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x1), 1))};
  for (int i = 0; i < 4 && 8 * i < cols; ++i)
    _mm512_storeu_pd(acc + 8 * i, _mm512_add_pd(_mm512_loadu_pd(acc + 8 * i), _mm512_cvtps_pd(part[i])));
}

// acc[r][c] += sum_j p[r][j] v[j][c] for R rows over the tile's n tokens; pb: [R][16] bf16
// probability pairs (token 2jp, 2jp + 1), zero past n. Value rows past n are never read. P
// prefetches the next tile's values.
// 8 / R steps of 32 columns at once: 16 accumulators whatever R, so few rows still have
// independent dot-product chains enough to hide their latency.
template <int R, typename E, typename P>
PAGED_DECODE_INLINE void pv_small(double* acc, int D, const uint32_t* pb, const E* const* v, int n, const P& next) {
  static_assert(R == 1 || R == 2 || R == 4 || R == 8, "8 / R column steps at once");
  constexpr int C = 8 / R;
  // unpacklo/hi_epi16 of two rows leave, in lane 4L + i of the dot product, column 8L + i (lo)
  // and 8L + 4 + i (hi) of the 32; these indices put columns 0..15 / 16..31 back in order.
  alignas(64) static const int32_t first_index[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t second_index[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const int pairs = (n + 1) / 2;
  for (int c0 = 0; c0 < D; c0 += 32 * C) {
    __mmask32 m[C];
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) m[i] = c0 + 32 * i < D ? column_mask(D, c0 + 32 * i) : __mmask32(0);
    __m512 a[R][C][2];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int i = 0; i < C; ++i) a[r][i][0] = a[r][i][1] = _mm512_setzero_ps();
    for (int jp = 0; jp < pairs; ++jp) {
      if (c0 == 0) next.values(2 * jp, 2);  // the next tile's values (see qk_small)
      const bool has_odd = 2 * jp + 1 < n;
      __m512bh pr[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) pr[r] = (__m512bh)_mm512_set1_epi32(int(pb[r * (kSmallTileTokens / 2) + jp]));
#pragma GCC unroll 16
      for (int i = 0; i < C; ++i) {
        if (m[i] == 0) break;  // past the head's last column
        const __m512i even = (__m512i)load_bf16x32(v[2 * jp] + c0 + 32 * i, m[i]);
        const __m512i odd = has_odd ? (__m512i)load_bf16x32(v[2 * jp + 1] + c0 + 32 * i, m[i]) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(even, odd), hi = (__m512bh)_mm512_unpackhi_epi16(even, odd);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          a[r][i][0] = _mm512_dpbf16_ps(a[r][i][0], pr[r], lo);
          a[r][i][1] = _mm512_dpbf16_ps(a[r][i][1], pr[r], hi);
        }
      }
    }
    const __m512i i0 = _mm512_load_si512(first_index), i1 = _mm512_load_si512(second_index);
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) {
      const int c = c0 + 32 * i;
      if (c >= D) break;
      const int cols = D - c < 32 ? D - c : 32;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        add_columns(acc + size_t(r) * D + c, _mm512_permutex2var_ps(a[r][i][0], i0, a[r][i][1]),
                    _mm512_permutex2var_ps(a[r][i][0], i1, a[r][i][1]), cols);
    }
  }
}

// Runs f over all rows in blocks of 8, 4, 2, 1.
template <typename F>
inline void for_small_rows(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) f(std::integral_constant<int, 8>{}, r);
  if (r + 4 <= rows) f(std::integral_constant<int, 4>{}, r), r += 4;
  if (r + 2 <= rows) f(std::integral_constant<int, 2>{}, r), r += 2;
  if (r < rows) f(std::integral_constant<int, 1>{}, r);
}

// The entry points run_task calls for tasks of few rows (per KV head). q: [rows][D] bf16;
// k / v: the tile's n rows of this KV head; s: [rows][32] fp32; pb: [rows][16] probability
// pairs; acc: [rows][D] fp64. Only the first row block prefetches the next tile.
template <typename E, typename P>
inline void small_qk_rows(int64_t rows, const uint16_t* q, int D, const E* const* k, int n, float scale, float* s,
                          const P& next) {
  for_small_rows(rows, [&](auto R, int64_t r) {
    qk_small<R>(q + size_t(r) * D, D, k, n, scale, s + size_t(r) * kSmallTileTokens, r == 0 ? next : P{});
  });
}
template <typename E, typename P>
inline void small_pv_rows(int64_t rows, double* acc, int D, const uint32_t* pb, const E* const* v, int n,
                          const P& next) {
  for_small_rows(rows, [&](auto R, int64_t r) {
    pv_small<R>(acc + size_t(r) * D, D, pb + size_t(r) * (kSmallTileTokens / 2), v, n, r == 0 ? next : P{});
  });
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS
#undef PAGED_DECODE_INLINE
#endif

// QK^T and PV of a tile with AVX-512 BF16 dot products (vdpbf16ps: each fp32 lane adds a pair
// of bf16 products), for bf16 caches in the isa_avx512_bf16 build only (attention.h decides
// when: not in batch-invariant mode, and only for tasks with enough rows to pay for the
// tile's re-layout). QK takes the bf16 query and keys as they are (exact products, fp32 sums,
// the scale applied to the fp32 scores), so scores and lse keep fp32 accuracy; PV rounds the
// probabilities to bf16 (within the contract's bf16 tolerance) and sums into an fp32
// accumulator acc32 that run_task adds to the fp64 one every kDotFlushTiles tiles and at the
// chunk's end (flush_acc): the fp32 sum never covers more than kDotFlushTiles * 32 keys, so
// the error does not grow with the context, and the per-tile fp64 widening is gone from the
// register loop. vdpbf16ps treats bf16 denormals as zero.
//
// Layouts, all in 32-bit words holding a pair of bf16:
//   qb[row][dp]   the query row's columns (2dp, 2dp + 1)
//   kt[dp][j]     the tile's keys transposed by column pair: token j's columns (2dp, 2dp + 1),
//                 so one vector holds 16 tokens and QK needs no horizontal sums
//   pb[row][jp]   the row's probabilities of tokens (2jp, 2jp + 1)
//   vp[jp][c]     the tile's values interleaved by token pair: (v[2jp][c], v[2jp + 1][c]);
//                 rows of DV words, DV = D rounded up to 32, columns from D on zero
//   acc32[row][c] fp32 (not pairs): the row's running PV sums, rows of DV floats
// and, on the heads path (decode tasks whose rows all see the same keys: attention.h), for QK:
//   qt[rb][dp][i] Q^T: column pair dp of row 16 rb + i, so one vector holds 16 rows' pair dp
//   st[j][row]    fp32 scores (then probabilities) token by token, 16 rows a vector; the key rows
//                 are read as they lie in the cache, one pair broadcast at a time (no kt)
// Tokens past the tile's end are zero in kt / vp (their scores are masked afterwards).
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

inline constexpr int kDotTileTokens = 32;  // == kTileTokens (two 16-lane vectors of scores)
// Tiles summed in fp32 (acc32) before they join the fp64 accumulator: 256 keys, whose fp32 sum
// errs by at most ~256 ulp of the row's largest term, far below the bf16 probabilities' rounding.
inline constexpr int kDotFlushTiles = 8;

// Rounds n floats (n even) to bf16 pairs, to nearest even (NaN stays NaN).
inline void pack_bf16(const float* x, int n, uint32_t* out) {
  int i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(out + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
  for (; i < n; i += 2) {
    const __m128bh pair = _mm_cvtneps_pbh(_mm_setr_ps(x[i], x[i + 1], 0.f, 0.f));
    uint32_t word;
    std::memcpy(&word, &pair, sizeof(word));
    out[i / 2] = word;
  }
}

// r[c] = column c of the 16 x 16 words r[0..16) (rows become columns).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// kt from the tile's n key rows (D bf16 each), 16 tokens x 16 column pairs at a time; P
// prefetches the next tile.
template <typename P>
inline void transpose_keys(const uint16_t* const* k, int n, int D, uint32_t* kt, const P& next) {
  const int DP = D / 2;
  next.rows(0, n);
  for (int j0 = 0; j0 < kDotTileTokens; j0 += 16)
    for (int dp0 = 0; dp0 < DP; dp0 += 16) {
      const int cols = DP - dp0 < 16 ? DP - dp0 : 16;  // D is a multiple of 8: 4, 8, 12 or 16
      const __mmask16 m = __mmask16((1u << cols) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_maskz_loadu_epi32(m, reinterpret_cast<const uint32_t*>(k[j0 + i]) + dp0)
                          : _mm512_setzero_si512();
      transpose16(r);
      for (int c = 0; c < cols; ++c) _mm512_storeu_si512(kt + (dp0 + c) * kDotTileTokens + j0, r[c]);
    }
}

// The mask of the columns [c, min(c + 32, D)).
inline __attribute__((always_inline)) __mmask32 column_mask(int D, int c) { return D - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - c)) - 1; }

// 32 cache elements from p (those of m; the rest 0) as bf16 pairs. E: uint16_t (a bf16 cache)
// or an fp8 dtype, widened exactly in registers through fp16 (fp8 -> fp16 -> fp32 -> bf16 loses
// nothing: 3 or 2 mantissa bits). e4m3fn is read as CacheRead's E4m3Half (its value / 2^8, which
// the scales take back), NaN bytes (0x7F / 0xFF) included; e5m2 is the top byte of an fp16.
template <typename E>
inline __attribute__((always_inline)) __m512bh load_bf16x32(const E* p, __mmask32 m) {
  if constexpr (std::is_same_v<E, uint16_t>) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
  } else {
    const __m512i high = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p)), 8);
    __m512i half = high;  // e5m2: already the fp16
    if constexpr (std::is_same_v<E, c10::Float8_e4m3fn>) {  // as vec8.h's E4m3Half
      half = _mm512_and_si512(_mm512_srai_epi16(high, 1), _mm512_set1_epi16(int16_t(0xBFFF)));
      const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_slli_epi16(high, 1), _mm512_set1_epi16(int16_t(0xFE00)));
      half = _mm512_mask_mov_epi16(half, nan, _mm512_or_si512(half, _mm512_set1_epi16(0x7C00)));
    }
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
    const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

// fp8 caches (the query bf16): the tile's n rows widened to bf16 rows of D words in out, and
// ptrs[j] pointing at them, for the re-layouts below. Exact: bf16's exponent range and 7
// mantissa bits hold every e4m3fn and e5m2 value. Through fp16, as vec8.h reads them: e5m2 is
// an fp16's top byte (infinities and NaN included); e4m3fn is read as its value / 2^8 (kUnit in
// CacheRead, which the scales take back), 0x7F/0xFF a NaN: load_bf16x32, the widening
// decode_dot.h reads its tiles with.
template <typename T>
inline void widen_fp8_rows(const T* const* rows, int n, int D, uint16_t* out, const uint16_t** ptrs) {
  for (int j = 0; j < n; ++j) {
    uint16_t* dst = out + size_t(j) * D;
    for (int c = 0; c < D; c += 32) {
      const __mmask32 m = column_mask(D, c);
      _mm512_mask_storeu_epi16(dst + c, m, (__m512i)load_bf16x32(rows[j] + c, m));
    }
    ptrs[j] = dst;
  }
}

// The tile's n rows (of cache dtype CT) as bf16 rows for the re-layouts: bf16 as they lie, fp8
// widened into buf ([kDotTileTokens][D]) with ptrs to its rows.
template <typename CT, typename R>
inline const uint16_t* const* dot_rows(const R* const* rows, int n, int D, uint16_t* buf, const uint16_t** ptrs) {
  if constexpr (std::is_same_v<CT, c10::BFloat16>) {
    return reinterpret_cast<const uint16_t* const*>(rows);
  } else if constexpr (is_fp8_v<CT>) {
    widen_fp8_rows(reinterpret_cast<const CT* const*>(rows), n, D, buf, ptrs);
    return ptrs;
  } else {
    return nullptr;  // never: attention.h takes the dot path for bf16 and fp8 caches only
  }
}

// vp from the tile's n value rows; DV = D rounded up to 32 (vp's row length).
inline void interleave_values(const uint16_t* const* v, int n, int D, uint32_t* vp, int DV) {
  // Words 2i / 2i + 1 of a 32-column step: column i of the even / odd token.
  alignas(64) static const uint16_t lo_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_index[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_index), hi = _mm512_load_si512(hi_index);
  for (int jp = 0; jp < kDotTileTokens / 2; ++jp) {
    const int j = 2 * jp;
    uint32_t* out = vp + size_t(jp) * DV;
    for (int c = 0; c < D; c += 32) {
      const __mmask32 m = column_mask(D, c);
      const __m512i a = j < n ? _mm512_maskz_loadu_epi16(m, v[j] + c) : _mm512_setzero_si512();
      const __m512i b = j + 1 < n ? _mm512_maskz_loadu_epi16(m, v[j + 1] + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// s[r][0..32) = scale * (q[r] . k[j]) for R rows (row stride kDotTileTokens in s).
template <int R>
inline void qk_dot(const uint32_t* qb, int DP, const uint32_t* kt, float scale, float* s) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int dp = 0; dp < DP; ++dp) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + dp * kDotTileTokens);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + dp * kDotTileTokens + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(int(qb[size_t(r) * DP + dp]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], q, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], q, k1);
    }
  }
  const __m512 m = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * kDotTileTokens, _mm512_mul_ps(a[r][0], m));
    _mm512_storeu_ps(s + r * kDotTileTokens + 16, _mm512_mul_ps(a[r][1], m));
  }
}

// acc[r][c] += sum_j p[r][j] v[j][c] for R rows over the whole tile, 32 columns at a time, in
// fp32: acc rows of DV floats, loaded as the accumulators' start and stored back.
template <int R>
inline void pv_dot(float* acc, int DV, const uint32_t* pb, const uint32_t* vp) {
  for (int c = 0; c < DV; c += 32) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + size_t(r) * DV + c);
      a[r][1] = _mm512_loadu_ps(acc + size_t(r) * DV + c + 16);
    }
    for (int jp = 0; jp < kDotTileTokens / 2; ++jp) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + size_t(jp) * DV + c);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + size_t(jp) * DV + c + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(int(pb[r * (kDotTileTokens / 2) + jp]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], pr, v0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], pr, v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + size_t(r) * DV + c, a[r][0]);
      _mm512_storeu_ps(acc + size_t(r) * DV + c + 16, a[r][1]);
    }
  }
}

// acc[r][0..D) = acc[r][0..D) * scale[r] + acc32[r][0..D) (acc32 widened exactly to fp64), then
// scale[r] = 1 and acc32 zeroed (all DV columns: the padding columns may hold 0 * NaN). scale
// holds the softmax corrections since the last flush (acc32 took them at once; the fp64 rows
// are too large to rescale at every new maximum). D is a multiple of 8.
inline void flush_acc(int64_t rows, float* acc32, int DV, double* acc, int D, double* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc32 + size_t(r) * DV;
    double* o = acc + size_t(r) * D;
    const __m512d f = _mm512_set1_pd(scale[r]);
    for (int c = 0; c < D; c += 8)
      _mm512_storeu_pd(o + c, _mm512_fmadd_pd(_mm512_loadu_pd(o + c), f, _mm512_cvtps_pd(_mm256_loadu_ps(a + c))));
    for (int c = 0; c < DV; c += 16) _mm512_storeu_ps(a + c, _mm512_setzero_ps());
    scale[r] = 1.0;
  }
}

// Runs a kernel over all rows, eight at a time (16 accumulators of 32 vector registers).
template <typename F>
inline void for_dot_rows(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) f(std::integral_constant<int, 8>{}, r);
  for (; r + 4 <= rows; r += 4) f(std::integral_constant<int, 4>{}, r);
  for (; r < rows; ++r) f(std::integral_constant<int, 1>{}, r);
}

// a + the pair products of b and the bf16 pair at p broadcast to every lane: vdpbf16ps with the
// pair as its embedded-broadcast memory operand ({1to16}), which GCC's intrinsic does not emit
// (it loads the broadcast into a register first: one more instruction per product).
inline __attribute__((always_inline)) __m512 dpbf16_broadcast(__m512 a, __m512bh b, const uint16_t* p) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(a) : "v"(b), "m"(*reinterpret_cast<const uint32_t*>(p)));
  return a;
#else
  int32_t pair;  // rows are 2-byte aligned only
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_dpbf16_ps(a, b, (__m512bh)_mm512_set1_epi32(pair));
#endif
}

// Decode's QK with the rows as the lanes (attention.h's heads path, where every row of the task
// sees the same keys): st[j][r] = scale * (q[r] . k[j]), for the n tokens of the tile (rows of D
// bf16, as they lie in the cache: no re-layout of K) and `rows` query rows, a multiple of 16. qt:
// Q^T in pairs, [rows / 16][DP][16 rows] (laid out once per task). Each vdpbf16ps adds a key's
// column pair, broadcast from its row, times 16 rows' pairs; 16 tokens at a time share each load of
// qt. st: [kDotTileTokens][rows] fp32. The AMX builds run amx_qk_heads instead.
template <int T, typename P>
inline void qk_heads_block(const uint32_t* qt, int DP, const uint16_t* const* k, float scale, float* st, int64_t rows,
                           int j, const P* next) {
  __m512 a[T];  // unrolled loops over it: GCC then keeps it in registers (else some builds spilled it)
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) a[t] = _mm512_setzero_ps();
  for (int dp = 0; dp < DP; ++dp) {
    // The next tile's tokens j..j+15, one line a step: line dp / 16 of token j + dp % 16 (the
    // rows' lines in the order this loop reads the current ones), never a burst.
    if (next != nullptr) next->token_line(j + dp % 16, dp / 16);
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + size_t(dp) * 16);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) a[t] = dpbf16_broadcast(a[t], q, k[t] + 2 * dp);
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(st + t * rows, _mm512_mul_ps(a[t], _mm512_set1_ps(scale)));
}
// next: the next tile's prefetches (attention.h's Prefetch), issued by the first row block.
template <typename P>
inline void dot_qk_heads(int64_t rows, const uint32_t* qt, int DP, const uint16_t* const* k, int n, float scale,
                         float* st, const P& next) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const uint32_t* q = qt + size_t(r0) * DP;
    const P* fetch = r0 == 0 ? &next : nullptr;
    int j = 0;
    for (; j + 16 <= n; j += 16) qk_heads_block<16>(q, DP, k + j, scale, st + j * rows + r0, rows, j, fetch);
    for (; j + 4 <= n; j += 4) qk_heads_block<4>(q, DP, k + j, scale, st + j * rows + r0, rows, j, fetch);
    for (; j < n; ++j) qk_heads_block<1>(q, DP, k + j, scale, st + j * rows + r0, rows, j, fetch);
  }
}

// The tile's QK and PV for all of a task's rows (per KV head): the entry points run_task calls.
// s: [rows][kDotTileTokens] fp32 scores; qb: [rows][DP]; pb: [rows][kDotTileTokens / 2];
// acc32: [rows][DV] fp32 (flush_acc moves it to the fp64 accumulator).
inline void dot_qk_rows(int64_t rows, const uint32_t* qb, int DP, const uint32_t* kt, float scale, float* s) {
#if defined(PAGED_CPU_AMX)  // the AMX builds: blocks of 16 rows on tiles (amx_dot.h), the rest below
  static_assert(kAmxTileTokens == kDotTileTokens);
  const int64_t tiled = amx_qk_rows(rows, qb, DP, kt, scale, s);
  rows -= tiled, qb += size_t(tiled) * DP, s += size_t(tiled) * kDotTileTokens;
#endif
  for_dot_rows(rows, [&](auto R, int64_t r) {
    qk_dot<R>(qb + size_t(r) * DP, DP, kt, scale, s + size_t(r) * kDotTileTokens);
  });
}
inline void dot_pv_rows(int64_t rows, float* acc32, const uint32_t* pb, const uint32_t* vp, int DV) {
#if defined(PAGED_CPU_AMX)
  const int64_t tiled = amx_pv_rows(rows, acc32, pb, vp, DV);
  rows -= tiled, acc32 += size_t(tiled) * DV, pb += size_t(tiled) * (kDotTileTokens / 2);
#endif
  for_dot_rows(rows, [&](auto R, int64_t r) {
    pv_dot<R>(acc32 + size_t(r) * DV, DV, pb + size_t(r) * (kDotTileTokens / 2), vp);
  });
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS
#endif

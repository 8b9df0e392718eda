// Sixteen floats at a time, for the online softmax of AVX-512 builds: a tile's 32 scores are two
// vectors (Vec8 takes four). Only what the softmax needs; the arithmetic is Vec8's (the same
// Cephes exp and soft-cap formulas), lane for lane, so every row of a build, decode or prefill,
// gets its probabilities from this one implementation.
#pragma once
#include "vec8.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace paged::cpu::PAGED_CPU_ISA_NS {
#if defined(__AVX512F__)

struct Vec16 {
  static constexpr int kLanes = 16;
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  Vec16 operator+(Vec16 o) const { return {_mm512_add_ps(v, o.v)}; }
  Vec16 operator-(Vec16 o) const { return {_mm512_sub_ps(v, o.v)}; }
  bool any_nan() const { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  // As _mm256_max_ps: the second operand when either is NaN.
  static Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  __m256 high() const { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
  float reduce_max() const {
    __m256 x = _mm256_max_ps(_mm512_castps512_ps256(v), high());
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
  }
  float sum() const {
    __m256 x = _mm256_add_ps(_mm512_castps512_ps256(v), high());
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
  }
  // Vec8::exp in 16 lanes: Cephes' range reduction and polynomial, exact 0 below -87.3 (masked
  // scores give probability 0), NaN stays NaN (min/max pass their second operand's NaN).
  __attribute__((always_inline)) static Vec16 exp(Vec16 x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    __m512 a = _mm512_max_ps(_mm512_set1_ps(-87.3f), _mm512_min_ps(_mm512_set1_ps(88.37f), x.v));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    a = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), a);
    a = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), a);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, a, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, a, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, a, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, a, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, a, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(a, a), _mm512_add_ps(a, _mm512_set1_ps(1.f)));
    const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return {_mm512_maskz_mul_ps(__mmask16(~underflow), y, _mm512_castsi512_ps(pow2n))};
  }
  // Vec8::softcap in 16 lanes: cap * tanh(x / cap), Cephes' tanhf polynomial below |x / cap| =
  // 0.625, else (1 - e) / (1 + e) with e = exp(-2 |x / cap|); NaN stays NaN, +-inf gives +-cap.
  static Vec16 softcap(Vec16 s, float cap) {
    const __m512 x = _mm512_div_ps(s.v, _mm512_set1_ps(cap));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u)));
    const __m512 a = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));  // |x|
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = exp({_mm512_mul_ps(a, _mm512_set1_ps(-2.f))}).v;
    const __m512 large = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(_mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e))), sign));
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    // blendv picks small where a < 0.625 (false for NaN: large, which is NaN too)
    const __mmask16 below = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
    return {_mm512_mul_ps(_mm512_mask_blend_ps(below, large, small), _mm512_set1_ps(cap))};
  }
};

// The online softmax's vector (attention.h): 16 lanes where the build has AVX-512.
using SoftmaxVec = Vec16;
#else
using SoftmaxVec = Vec8;
#endif

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

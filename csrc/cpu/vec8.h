// Eight floats at a time, loaded straight from any storage dtype. AVX2/FMA/F16C on x86;
// plain arrays (which the compiler vectorizes as it can) elsewhere.
#pragma once
#include <cmath>

#include "convert.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

// An fp8 e4m3fn byte read as an fp16's top bits (bias 15 vs 7): it widens to its value / 2^8,
// exactly. E4m3HalfFinite: the same, for bytes known not to be NaN (0x7F/0xFF).
struct E4m3Half {
  uint8_t bits;
};
struct E4m3HalfFinite {
  uint8_t bits;
};

// Whether any of the rows' first D bytes is an e4m3fn NaN (0x7F/0xFF). D is a multiple of 8.
inline bool any_e4m3_nan(const E4m3Half* const* rows, int n, int D) {
#if defined(__AVX2__)
  const __m256i mag = _mm256_set1_epi8(0x7F);
  __m256i top = _mm256_setzero_si256();  // the largest magnitude byte seen, per lane
  __m128i tail = _mm_setzero_si128();
  for (int j = 0; j < n; ++j) {
    const uint8_t* p = &rows[j]->bits;
    int c = 0;
    for (; c + 32 <= D; c += 32)
      top = _mm256_max_epu8(top, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c)), mag));
    for (; c < D; c += 8)
      tail = _mm_max_epu8(tail, _mm_and_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)), _mm256_castsi256_si128(mag)));
  }
  return (_mm256_movemask_epi8(_mm256_cmpeq_epi8(top, mag)) | _mm_movemask_epi8(_mm_cmpeq_epi8(tail, _mm256_castsi256_si128(mag)))) != 0;
#else
  for (int j = 0; j < n; ++j)
    for (int c = 0; c < D; ++c)
      if ((rows[j][c].bits & 0x7F) == 0x7F) return true;
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec8 {
  static constexpr int kLanes = 8;
  __m256 v;
  static Vec8 zero() { return {_mm256_setzero_ps()}; }
  static Vec8 broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec8 load(const c10::BFloat16* p) {  // bf16 is the top half of a float
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
  }
  static Vec8 load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // fp8 widens through fp16 with shifts alone (a table gather made the fp8 cache 5x slower per
  // byte than bf16). e5m2 is the top byte of an fp16, infinities and NaN included.
  static Vec8 load(const c10::Float8_e5m2* p) {
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(_mm_slli_epi16(bytes, 8))};
  }
  // e4m3fn's exponent and mantissa, placed in an fp16's low exponent and high mantissa bits, read
  // as that fp16 times 2^8 (bias 15 vs 7) — exact for normals and subnormals alike. With the byte
  // in a word's high half, an arithmetic shift by one puts them there and copies the sign into
  // the exponent's top bit, which the mask clears. 0x7F/0xFF are e4m3fn's NaN (it has no
  // infinities): their fp16 gets an all-ones exponent (its mantissa is nonzero), a NaN of the same sign.
  static Vec8 load(const c10::Float8_e4m3fn* p) {
    return {_mm256_mul_ps(load(reinterpret_cast<const E4m3Half*>(p)).v, _mm256_set1_ps(256.f))};
  }
  // e4m3fn read as the fp16 above without the 2^8 (the attention folds it into its scales):
  // E4m3Half exactly as that widening, NaN included; E4m3HalfFinite for bytes known to hold no
  // NaN (0x7F/0xFF), which need no fix-up: the sign-extended byte shifted by 7 is that fp16 but
  // for a sign copy in the exponent's top bit, which the mask clears.
  static Vec8 load(const E4m3Half* p) {
    const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i half = _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(int16_t(0xBFFF)));
    const __m128i nan = _mm_cmpeq_epi16(_mm_slli_epi16(high, 1), _mm_set1_epi16(int16_t(0xFE00)));
    return {_mm256_cvtph_ps(_mm_or_si128(half, _mm_and_si128(nan, _mm_set1_epi16(0x7C00))))};
  }
  static Vec8 load(const E4m3HalfFinite* p) {
    const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(int16_t(0xBFFF))))};
  }
  // Sixteen at once: one widening of the 16 bytes (a 256-bit sign extension), two conversions.
  template <typename T>
  static void load16(const T* p, Vec8& lo, Vec8& hi) {
    lo = load(p);
    hi = load(p + 8);
  }
  static void load16(const E4m3HalfFinite* p, Vec8& lo, Vec8& hi) {
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
    lo = {_mm256_cvtph_ps(_mm256_castsi256_si128(half))};
    hi = {_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void add_to(double* p) const {  // p[0..8) += this, widened exactly to double
    _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), _mm256_cvtps_pd(_mm256_castps256_ps128(v))));
    _mm256_storeu_pd(p + 4, _mm256_add_pd(_mm256_loadu_pd(p + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
  }
  Vec8 fma(Vec8 a, Vec8 b) const { return {_mm256_fmadd_ps(a.v, b.v, v)}; }  // this + a * b
  Vec8 operator+(Vec8 o) const { return {_mm256_add_ps(v, o.v)}; }
  Vec8 operator-(Vec8 o) const { return {_mm256_sub_ps(v, o.v)}; }
  static Vec8 max(Vec8 a, Vec8 b) { return {_mm256_max_ps(a.v, b.v)}; }
  bool any_nan() const { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
  float reduce_max() const {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  // exp with Cephes' range reduction and polynomial (about 1 ulp), exact 0 below -87.3 so
  // masked (-inf) scores give probability 0; the softmax spent a fifth of its time in libm expf.
  static Vec8 exp(Vec8 x) {
    const __m256 underflow = _mm256_cmp_ps(x.v, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    // min/max return their second operand when either is NaN: NaN passes the clamp, exp(NaN) = NaN
    __m256 a = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.37f), x.v));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    a = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), a);
    a = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), a);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, a, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, a, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, a, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, a, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, a, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(a, a), _mm256_add_ps(a, _mm256_set1_ps(1.f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)))};
  }
  // cap * tanh(x / cap), the logit soft-cap: Cephes' tanhf polynomial below |x / cap| = 0.625,
  // else (1 - e) / (1 + e) with e = exp(-2 |x / cap|), which does not cancel there (a few ulp).
  // NaN stays NaN, +-inf gives +-cap. One libm tanhf per score cost more than the whole tile.
  static Vec8 softcap(Vec8 s, float cap) {
    const __m256 x = _mm256_div_ps(s.v, _mm256_set1_ps(cap));
    const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.f));
    const __m256 a = _mm256_xor_ps(x, sign);  // |x|
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 e = exp({_mm256_mul_ps(a, _mm256_set1_ps(-2.f))}).v;
    const __m256 large = _mm256_xor_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), sign);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
    return {_mm256_mul_ps(t, _mm256_set1_ps(cap))};
  }
  float sum() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
};
#else
struct Vec8 {
  static constexpr int kLanes = 8;
  float v[8];
  static Vec8 zero() { return broadcast(0.f); }
  static Vec8 broadcast(float x) {
    Vec8 r;
    for (float& e : r.v) e = x;
    return r;
  }
  template <typename T>
  static Vec8 load(const T* p) {
    Vec8 r;
    to_float(p, r.v, 8);
    return r;
  }
  static Vec8 load(const E4m3Half* p) {  // value / 2^8, exactly
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = fp8_table<c10::Float8_e4m3fn>()[p[i].bits] * (1.f / 256.f);
    return r;
  }
  static Vec8 load(const E4m3HalfFinite* p) { return load(reinterpret_cast<const E4m3Half*>(p)); }
  template <typename T>
  static void load16(const T* p, Vec8& lo, Vec8& hi) {
    lo = load(p);
    hi = load(p + 8);
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  void add_to(double* p) const {
    for (int i = 0; i < 8; ++i) p[i] += v[i];
  }
  Vec8 fma(Vec8 a, Vec8 b) const {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = v[i] + a.v[i] * b.v[i];
    return r;
  }
  Vec8 operator+(Vec8 o) const {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = v[i] + o.v[i];
    return r;
  }
  Vec8 operator-(Vec8 o) const {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = v[i] - o.v[i];
    return r;
  }
  static Vec8 max(Vec8 a, Vec8 b) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = std::max(a.v[i], b.v[i]);
    return r;
  }
  float reduce_max() const { return *std::max_element(v, v + 8); }
  bool any_nan() const {
    for (float e : v)
      if (std::isnan(e)) return true;
    return false;
  }
  static Vec8 exp(Vec8 x) {
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = std::exp(x.v[i]);
    return r;
  }
  static Vec8 softcap(Vec8 s, float cap) {  // cap * tanh(x / cap), the logit soft-cap
    Vec8 r;
    for (int i = 0; i < 8; ++i) r.v[i] = cap * std::tanh(s.v[i] / cap);
    return r;
  }
  float sum() const {
    float s = 0.f;
    for (float e : v) s += e;
    return s;
  }
};
#endif

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

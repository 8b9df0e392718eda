// Row conversions between storage dtypes and float, written so that GCC vectorizes them.
// Every row length here is a multiple of 8 (head sizes are), so no loop needs a scalar tail.
//
// Compiled once per instruction set (csrc/cpu/isa.h): everything here lives in that build's
// namespace, so the inline functions of two builds are never merged by the linker.
#pragma once
#ifndef PAGED_CPU_ISA_NS
#error "csrc/cpu kernels are compiled per ISA: define PAGED_CPU_ISA_NS (CMakeLists.txt does)"
#endif
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the intrinsics below are used only where the build's flags enable them
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace paged::cpu::PAGED_CPU_ISA_NS {

template <typename T>
inline constexpr bool is_fp8_v =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// fp8 -> float through a 256-entry table: exact, and one load per element.
template <typename T>
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(T(static_cast<uint8_t>(i), T::from_bits()));
    return t;
  }();
  return table.data();
}

inline void to_float(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int n) {
  // bf16 is the top half of a float: widening is a shift.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int n) {
#if defined(__F16C__)
  for (int i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#else
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
#endif
}

template <typename T, std::enable_if_t<is_fp8_v<T>, int> = 0>
inline void to_float(const T* src, float* dst, int n) {
  const float* table = fp8_table<T>();
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
  for (int i = 0; i < n; ++i) dst[i] = table[s[i]];
}

// float -> storage dtype, round-to-nearest-even as torch's own casts do.
template <typename T>
inline void from_float(const float* src, T* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The contract's fp8 quantization: x / scale as a true float division, clamped to the fp8
// range (torch's cast would make NaN or inf of outliers), then cast with round-to-nearest-even.
template <typename T>
inline T saturating_fp8(float x, float scale) {
  const float max = static_cast<float>(std::numeric_limits<T>::max());
  float y = x / scale;
  y = y > max ? max : (y < -max ? -max : y);  // keeps NaN as NaN
  return T(y);
}

// Whether x * (1 / scale) equals x / scale for every float x: exactly when 1 / scale is itself a
// float (scale a power of two whose reciprocal does not overflow), as both are then the
// correctly rounded value of the same real number. Multiplying is several times cheaper.
inline bool reciprocal_is_exact(float scale) {
  const float r = 1.0f / scale;
  return static_cast<double>(r) * static_cast<double>(scale) == 1.0;  // a float product is exact in double
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight floats from any of the float storage dtypes.
inline __m256 load8_float(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_float(const c10::BFloat16* p) {  // bf16 is the top half of a float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8_float(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// saturating_fp8's clamp and c10's fp8e4m3fn/fp8e5m2_from_fp32_value on eight lanes, bit for bit:
// each 32-bit lane of the result holds the fp8 byte. After the clamp only NaN lies at or beyond
// the fp8 overflow threshold, so c10's overflow branch reduces to "NaN -> 0x7F", and rounding can
// no longer carry into e4m3fn's NaN pattern.
template <typename T>
inline __m256i fp8_bits8(__m256 y) {
  constexpr bool e4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  constexpr int mant_shift = e4m3 ? 20 : 21;                           // 23 - mantissa bits
  constexpr int32_t min_normal = e4m3 ? (121 << 23) : (113 << 23);     // 2^-6 / 2^-14
  constexpr int32_t denorm_magic = e4m3 ? (141 << 23) : (134 << 23);   // c10's denorm_mask
  constexpr int32_t rebias = e4m3 ? ((7 - 127) * (1 << 23) + 0x7FFFF) : ((15 - 127) * (1 << 23) + 0xFFFFF);
  const float max = static_cast<float>(std::numeric_limits<T>::max());
  // min/max return their second operand when either is NaN: NaN passes through, -0 stays -0,
  // exactly as saturating_fp8's comparisons.
  y = _mm256_max_ps(_mm256_set1_ps(-max), _mm256_min_ps(_mm256_set1_ps(max), y));
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);  // |y|, non-negative as int32
  // below the smallest normal: the float addition rounds (RNE) the magnitude into the low bits
  const __m256i magic = _mm256_set1_epi32(denorm_magic);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  // normals: rebias the exponent, round to nearest even on the integer bits
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, mant_shift), _mm256_set1_epi32(1));
  const __m256i normal =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(rebias)), odd), mant_shift);
  __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(min_normal), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// Eight floats into any of the float storage dtypes, rounding as c10's casts do (RNE; NaN
// stays NaN, bf16's as c10's 0x7FC0).
inline void store8_float(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8_float(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline __m256i bf16_bits8(__m256 v) {  // c10's round_to_nearest_even, one per 32-bit lane
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store8_float(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
// Sixteen at a time: one pack and one 32-byte store for two vectors.
template <typename T>
inline void store16_float(T* p, __m256 a, __m256 b) {
  store8_float(p, a);
  store8_float(p + 8, b);
}
inline void store16_float(c10::BFloat16* p, __m256 a, __m256 b) {
  const __m256i words = _mm256_packus_epi32(bf16_bits8(a), bf16_bits8(b));  // a0-3 b0-3 | a4-7 b4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(words, 0xD8));
}

template <typename T, bool kMul>
inline __m256i fp8_bits8(__m256 x, __m256 s) {
  return fp8_bits8<T>(kMul ? _mm256_mul_ps(x, s) : _mm256_div_ps(x, s));
}
#endif

// dst[i] = saturating_fp8<OT>(src[i], scale) for i < n, eight or 32 lanes at a time.
template <typename OT, typename IT>
inline void quantize_row(const IT* src, OT* dst, int64_t n, float scale) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  auto run = [&](auto mul_tag) {
    constexpr bool kMul = decltype(mul_tag)::value;
    const __m256 s = _mm256_set1_ps(kMul ? 1.0f / scale : scale);
    uint8_t* d = reinterpret_cast<uint8_t*>(dst);
    for (; i + 32 <= n; i += 32) {
      const __m256i r0 = fp8_bits8<OT, kMul>(load8_float(src + i), s);
      const __m256i r1 = fp8_bits8<OT, kMul>(load8_float(src + i + 8), s);
      const __m256i r2 = fp8_bits8<OT, kMul>(load8_float(src + i + 16), s);
      const __m256i r3 = fp8_bits8<OT, kMul>(load8_float(src + i + 24), s);
      // per 128-bit half: r0..r3's lanes 0-3 (low half) and 4-7 (high half), one dword each
      const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(r0, r1), _mm256_packus_epi32(r2, r3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    for (; i + 8 <= n; i += 8) {
      const __m256i r = fp8_bits8<OT, kMul>(load8_float(src + i), s);
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + i), _mm_packus_epi16(words, words));
    }
  };
  if (reciprocal_is_exact(scale))
    run(std::true_type{});
  else
    run(std::false_type{});
#endif
  for (; i < n; ++i) dst[i] = saturating_fp8<OT>(static_cast<float>(src[i]), scale);
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

// Row conversions between storage dtypes and float, written so that GCC vectorizes them.
// Every row length here is a multiple of 8 (head sizes are), so no loop needs a scalar tail.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>

namespace paged::cpu {

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

}  // namespace paged::cpu

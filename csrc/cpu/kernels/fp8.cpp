// quantize_fp8 / dequantize_fp8 for the cpu backend (per-tensor scale, contiguous tensors).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "cpu/convert.h"
#include "cpu/vec8.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {
namespace {

template <typename T>
void dispatch_float(at::ScalarType dtype, T&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kHalf: return fn(c10::Half{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    default: TORCH_CHECK(false, "fp8: unsupported floating dtype ", dtype);
  }
}

template <typename T>
void dispatch_fp8(at::ScalarType dtype, T&& fn) {
  switch (dtype) {
    case at::kFloat8_e4m3fn: return fn(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return fn(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, "fp8: unsupported fp8 dtype ", dtype);
  }
}

}  // namespace

void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  const float s = scale.data_ptr<float>()[0];
  const int64_t n = input.numel();
  dispatch_float(input.scalar_type(), [&](auto in_tag) {
    using IT = decltype(in_tag);
    dispatch_fp8(out.scalar_type(), [&](auto out_tag) {
      using OT = decltype(out_tag);
      const IT* src = input.data_ptr<IT>();
      OT* dst = out.data_ptr<OT>();
      at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
        quantize_row(src + b, dst + b, e - b, s);
      });
    });
  });
}

void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  const float s = scale.data_ptr<float>()[0];
  const int64_t n = input.numel();
  dispatch_fp8(input.scalar_type(), [&](auto in_tag) {
    using IT = decltype(in_tag);
    dispatch_float(out.scalar_type(), [&](auto out_tag) {
      using OT = decltype(out_tag);
      const float* table = fp8_table<IT>();
      const IT* src = input.data_ptr<IT>();
      OT* dst = out.data_ptr<OT>();
      at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
        int64_t i = b;
#if defined(__AVX2__) && defined(__F16C__)
        // the attention's exact widening, then the same float multiply and rounding as below
        const __m256 vs = _mm256_set1_ps(s);
        for (; i + 16 <= e; i += 16)
          store16_float(dst + i, _mm256_mul_ps(Vec8::load(src + i).v, vs), _mm256_mul_ps(Vec8::load(src + i + 8).v, vs));
        for (; i + 8 <= e; i += 8) store8_float(dst + i, _mm256_mul_ps(Vec8::load(src + i).v, vs));
#endif
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
        for (; i < e; ++i) dst[i] = static_cast<OT>(table[bytes[i]] * s);
      });
    });
  });
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

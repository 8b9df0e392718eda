// quantize_fp8 / dequantize_fp8 for the cpu backend (per-tensor scale, contiguous tensors).
#include <ATen/Parallel.h>

#include "cpu/convert.h"
#include "cpu/vec8.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

void quantize_fp8(const Fp8Params& p, Stream) {
  const float s = p.scale[0];
  const int64_t n = p.n;
  with_float_type(p.input_dtype, [&](auto in_tag) {
    using IT = decltype(in_tag);
    with_fp8_type(p.out_dtype, [&](auto out_tag) {
      using OT = decltype(out_tag);
      const IT* src = static_cast<const IT*>(p.input);
      OT* dst = static_cast<OT*>(p.out);
      at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
        quantize_row(src + b, dst + b, e - b, s);
      });
    });
  });
}

void dequantize_fp8(const Fp8Params& p, Stream) {
  const float s = p.scale[0];
  const int64_t n = p.n;
  with_fp8_type(p.input_dtype, [&](auto in_tag) {
    using IT = decltype(in_tag);
    with_float_type(p.out_dtype, [&](auto out_tag) {
      using OT = decltype(out_tag);
      const float* table = fp8_table<IT>();
      const IT* src = static_cast<const IT*>(p.input);
      OT* dst = static_cast<OT*>(p.out);
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

// This ISA build's kernels, for csrc/cpu/backend.cpp's table.
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

IsaKernels kernels() {
#if defined(PAGED_CPU_AMX)  // only attention differs from isa_avx512_bf16 (isa.h)
  return {&attention, &isa_avx512_bf16::reshape_and_cache, &isa_avx512_bf16::quantize_fp8,
          &isa_avx512_bf16::dequantize_fp8};
#else
  return {&attention, &reshape_and_cache, &quantize_fp8, &dequantize_fp8};
#endif
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

// This ISA build's kernels, for csrc/cpu/dispatch.cpp's table.
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

IsaKernels kernels() {
#if defined(PAGED_CPU_AMX)  // only attention differs from isa_avx512_bf16 (isa.h)
  return {&isa_avx512_bf16::reshape_and_cache, &decode_attention, &prefill_attention,
          &isa_avx512_bf16::quantize_fp8, &isa_avx512_bf16::dequantize_fp8};
#else
  return {&reshape_and_cache, &decode_attention, &prefill_attention, &quantize_fp8, &dequantize_fp8};
#endif
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

// This ISA build's kernels, for csrc/cpu/dispatch.cpp's table.
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

IsaKernels kernels() {
  return {&reshape_and_cache, &decode_attention, &prefill_attention, &quantize_fp8, &dequantize_fp8};
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

// attention for the cpu backend: the one launcher of decode and prefill (csrc/cpu/isa.h) on the
// AttentionParams the binding filled (csrc/binding.h): the element types from the dtype
// codes, then the core in attention.h (decode is prefill with one query token per sequence:
// p.cu_seqlens_q null).
// The AMX builds' tile kernels come first: bf16_dot.h's entry points call them.
#include "cpu/amx_dot.h"
#include "cpu/attention.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {

void attention(const AttentionParams& p) {
#if defined(PAGED_CPU_AMX)
  amx_begin_call();  // every thread reloads its tile configuration in this call (amx_dot.h)
#endif
  with_float_type(p.dtype, [&](auto query_tag) {
    using QT = decltype(query_tag);
    if (p.cache_dtype == p.dtype) return paged_attention<QT, QT>(p);  // validated: else an fp8 cache
    with_fp8_type(p.cache_dtype, [&](auto cache_tag) { paged_attention<QT, decltype(cache_tag)>(p); });
  });
#if defined(PAGED_CPU_AMX_EMULATED)
  // A tile instruction the hardware would fault on (recorded by the model; an exception cannot
  // leave the kernel's OpenMP region): the call fails, its output is not to be trusted.
  const std::string fault = amx_emulated::take_fault();
  TORCH_CHECK(fault.empty(), fault);
#endif
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

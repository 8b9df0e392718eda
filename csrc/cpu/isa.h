// Runtime ISA dispatch for the cpu backend. csrc/cpu/kernels/*.cpp (and the headers they
// include: attention.h, vec8.h, convert.h) are compiled once per instruction set, each time with
// that ISA's flags and -DPAGED_CPU_ISA_NS=isa_<name>, so every build's functions, inline ones
// included, live in their own namespace. csrc/cpu/backend.cpp (compiled with the baseline flags)
// picks one build at the first call by CPUID, or as PAGED_OPS_CPU_ISA says.
//
//   isa_portable     no -m flags: the same kernels' plain C++ branches (what aarch64 builds)
//   isa_avx2         -mavx2 -mfma -mf16c: the 8-lane intrinsics in vec8.h / convert.h
//   isa_avx512       + -mavx512f -mavx512bw -mavx512vl: the same 8-lane code; only what the
//                    compiler auto-vectorizes gets wider (no 16-lane kernels yet)
//   isa_avx512_bf16  + -mavx512bf16: as isa_avx512, but bf16 caches' QK and PV by vdpbf16ps
//                    (bf16_dot.h) in tasks of 16+ rows per KV head, outside batch-invariant mode
//   isa_amx          + -mamx-tile -mamx-bf16 (where the compiler takes them): as isa_avx512_bf16,
//                    with that path's blocks of 16 rows on AMX tiles (amx_dot.h); chosen only
//                    where CPUID, XCR0 and Linux's arch_prctl permission all allow tiles
//   isa_amx_emulated the avx512_bf16 flags and the same amx_dot.h on a scalar model of the tile
//                    instructions (amx_emulated.h): tests the AMX kernels on CPUs without AMX;
//                    never chosen by default
// The two AMX builds compile only attention (kernels/attention.cpp, table.cpp and the model's
// test hooks); their other kernels are isa_avx512_bf16's (table.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include "cpu/ops.h"

namespace paged::cpu {

// One ISA build's launchers: the cpu Target's (csrc/cpu/backend.cpp) while that build is active.
struct IsaKernels {
  void (*attention)(const AttentionParams& p);
  void (*reshape_and_cache)(const ReshapeCacheParams& p, Stream stream);
  void (*quantize_fp8)(const Fp8Params& p, Stream stream);
  void (*dequantize_fp8)(const Fp8Params& p, Stream stream);
};

#define PAGED_CPU_DECLARE_ISA(ns) \
  namespace ns {                  \
  PAGED_CPU_DECLARE_ISA_KERNELS   \
  IsaKernels kernels();           \
  }
PAGED_CPU_DECLARE_ISA(isa_portable)
PAGED_CPU_DECLARE_ISA(isa_avx2)
PAGED_CPU_DECLARE_ISA(isa_avx512)
PAGED_CPU_DECLARE_ISA(isa_avx512_bf16)
PAGED_CPU_DECLARE_ISA(isa_amx)
PAGED_CPU_DECLARE_ISA(isa_amx_emulated)
#undef PAGED_CPU_DECLARE_ISA

// The AMX model's test hooks (kernels/amx_emulated_probe.cpp; registered by backend.cpp).
namespace isa_amx_emulated {
std::string amx_emulated_fault_case(const std::string& name);
at::Tensor amx_emulated_tdpbf16ps(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b);
void amx_emulated_disturb(const std::string& how);
int64_t amx_emulated_dot_count();  // TDPBF16PS run so far, all threads
}  // namespace isa_amx_emulated

}  // namespace paged::cpu

// The cpu backend: C++/OpenMP kernels on the structs of csrc/kernels/params.h, the same the CUDA
// kernels take (the one binding, csrc/binding.h, fills them from the tensors). Attention
// computes in fp32 and keeps its running sums in fp64. Inputs are validated before they get here
// (csrc/public/); semantics: paged_ops/reference.py.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "kernels/launch.h"
#include "kernels/params.h"

// The kernels built once per instruction set (csrc/cpu/isa.h), in each ISA's namespace; every
// launcher has its CUDA twin's signature (kernels/launch.h) and ignores the stream.
#define PAGED_CPU_DECLARE_ISA_KERNELS                                 \
  void attention(const AttentionParams& p); /* decode: no cu_seqlens_q */ \
  void reshape_and_cache(const ReshapeCacheParams& p, Stream stream);  \
  void quantize_fp8(const Fp8Params& p, Stream stream);                \
  void dequantize_fp8(const Fp8Params& p, Stream stream);

namespace paged::cpu {

// Memory-bound, no arithmetic worth an ISA build: built once, with the baseline flags.
void merge_attention_states(const MergeParams& p, Stream stream);
void merge_states(const MergeStatesParams& p, Stream stream);  // the N-way merge
void copy_blocks(const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs, Stream stream);

// fn(T{}) with T the C++ type of a 16/32-bit float code (the dtypes attention and merges take).
template <typename F>
void with_float_type(DType dtype, F&& fn) {
  switch (dtype) {
    case DType::F32: return fn(float{});
    case DType::F16: return fn(c10::Half{});
    case DType::BF16: return fn(c10::BFloat16{});
    default: TORCH_CHECK(false, "paged cpu: unsupported dtype code ", int(dtype));
  }
}
// fn(T{}) with T the C++ type of an fp8 code.
template <typename F>
void with_fp8_type(DType dtype, F&& fn) {
  switch (dtype) {
    case DType::E4M3: return fn(c10::Float8_e4m3fn{});
    case DType::E5M2: return fn(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, "paged cpu: unsupported fp8 dtype code ", int(dtype));
  }
}

}  // namespace paged::cpu

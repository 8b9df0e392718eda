// The one launcher interface of the CUDA kernels, shared by the two builds that run them:
//   * the GPU build: csrc/cuda/attention.cu and csrc/cuda/cache_kernels.cu (nvcc) define
//     kCudaAttention / kCudaCache, launching on a CUDA stream;
//   * the emulator: csrc/cuda_emu/kernels_attention.cpp and kernels_cache.cpp (host compiler over
//     csrc/emu/cuda_emu.h) define kEmuAttention / kEmuCache; launches are synchronous.
// The binding (csrc/cuda/binding.h) fills the parameters and the plan once and calls one table or
// the other. No torch or CUDA types: a stream travels as void* (a cudaStream_t on a GPU, null on
// the emulator).
#pragma once
#include <cstdint>

#include "kernels/params.h"
#include "kernels/plan.h"

namespace paged {

struct AttentionLaunchers {
  // `workspace`: plan.workspace_floats floats (null when that is 0).
  void (*decode_attention)(const AttentionParams& p, const DecodePlan& plan, float* workspace, Stream stream);
  void (*prefill_attention)(const AttentionParams& p, const PrefillPlan& plan, Stream stream);
};

struct CacheLaunchers {
  void (*reshape_and_cache)(const ReshapeCacheParams& p, Stream stream);
  void (*quantize_fp8)(const Fp8Params& p, Stream stream);
  void (*dequantize_fp8)(const Fp8Params& p, Stream stream);
  // `caches` and `mapping` ([num_pairs, 2] src/dst block ids) are device arrays.
  void (*copy_blocks)(const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs,
                      Stream stream);
};

extern const AttentionLaunchers kCudaAttention;  // csrc/cuda/attention.cu
extern const CacheLaunchers kCudaCache;          // csrc/cuda/cache_kernels.cu
extern const AttentionLaunchers kEmuAttention;   // csrc/cuda_emu/kernels_attention.cpp
extern const CacheLaunchers kEmuCache;           // csrc/cuda_emu/kernels_cache.cpp

}  // namespace paged

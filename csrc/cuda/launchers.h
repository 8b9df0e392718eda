// Plain launcher functions over raw pointers (no torch, no CUDA headers beyond the stream type):
// defined by nvcc in csrc/cuda/*.cu (namespace paged_cuda::launchers) and by the host compiler
// over the emulator in csrc/cuda_emu/kernels_*.cpp (namespace paged_cuda_emu::launchers). The torch
// bindings (binding_common.h) call one or the other.
#pragma once
#include <driver_types.h>  // cudaStream_t

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

#define PAGED_DECLARE_LAUNCHERS                                                                           \
  /* floats of float32 workspace decode_attention needs for this shape/config (0: no split-KV) */         \
  size_t decode_workspace_floats(const ::paged_cuda::AttentionParams& p, const ::paged_cuda::LaunchConfig& cfg); \
  void decode_attention(const ::paged_cuda::AttentionParams& p, const ::paged_cuda::LaunchConfig& cfg,      \
                        float* workspace, cudaStream_t stream);                                          \
  void prefill_attention(const ::paged_cuda::AttentionParams& p, const ::paged_cuda::LaunchConfig& cfg,     \
                         cudaStream_t stream);                                                           \
  void reshape_and_cache(const ::paged_cuda::ReshapeCacheParams& p, cudaStream_t stream);                  \
  void quantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,  \
                    int max_blocks, cudaStream_t stream);                                                \
  void dequantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n, \
                      int max_blocks, cudaStream_t stream);                                              \
  void copy_blocks(const ::paged_cuda::CacheDesc* caches, int num_caches, const int64_t* mapping,          \
                   int num_pairs, cudaStream_t stream);

namespace paged_cuda {
namespace launchers {
PAGED_DECLARE_LAUNCHERS
}  // namespace launchers
}  // namespace paged_cuda

namespace paged_cuda_emu {
namespace launchers {
PAGED_DECLARE_LAUNCHERS
}  // namespace launchers
}  // namespace paged_cuda_emu

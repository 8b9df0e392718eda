// The cache kernels of csrc/kernels, compiled by the host compiler over the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/cache.cuh"
#include "kernels/copy_blocks.cuh"
#include "cuda/launchers.h"

namespace paged_cuda_emu {
namespace launchers {
namespace k = ::paged_cuda_emu_impl;

void reshape_and_cache(const paged_cuda::ReshapeCacheParams& p, cudaStream_t stream) {
  k::cache::launch_reshape_and_cache(p, stream);
}
void quantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                  int max_blocks, cudaStream_t stream) {
  k::cache::launch_quantize(out, out_dtype, in, in_dtype, scale, n, max_blocks, stream);
}
void dequantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                    int max_blocks, cudaStream_t stream) {
  k::cache::launch_dequantize(out, out_dtype, in, in_dtype, scale, n, max_blocks, stream);
}
void copy_blocks(const paged_cuda::CacheDesc* caches, int num_caches, const int64_t* mapping, int num_pairs,
                 cudaStream_t stream) {
  k::cache::launch_copy_blocks(caches, num_caches, mapping, num_pairs, stream);
}

}  // namespace launchers
}  // namespace paged_cuda_emu

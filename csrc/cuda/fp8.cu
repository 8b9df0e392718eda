// nvcc side of quantize_fp8 / dequantize_fp8 (kernels/cache.cuh).
#include "kernels/cache.cuh"
#include "cuda/launchers.h"

namespace paged_cuda {
namespace launchers {

void quantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                  int max_blocks, cudaStream_t stream) {
  cache::launch_quantize(out, out_dtype, in, in_dtype, scale, n, max_blocks, stream);
}
void dequantize_fp8(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                    int max_blocks, cudaStream_t stream) {
  cache::launch_dequantize(out, out_dtype, in, in_dtype, scale, n, max_blocks, stream);
}

}  // namespace launchers
}  // namespace paged_cuda

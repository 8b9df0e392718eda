// nvcc side of reshape_and_cache (kernels/cache.cuh).
#include "kernels/cache.cuh"
#include "cuda/launchers.h"

namespace paged_cuda {
namespace launchers {

void reshape_and_cache(const ReshapeCacheParams& p, cudaStream_t stream) {
  cache::launch_reshape_and_cache(p, stream);
}

}  // namespace launchers
}  // namespace paged_cuda

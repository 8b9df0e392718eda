// nvcc side of copy_blocks (kernels/cache.cuh).
#include "kernels/copy_blocks.cuh"
#include "cuda/launchers.h"

namespace paged_cuda {
namespace launchers {

void copy_blocks(const CacheDesc* caches, int num_caches, const int64_t* mapping, int num_pairs, cudaStream_t stream) {
  cache::launch_copy_blocks(caches, num_caches, mapping, num_pairs, stream);
}

}  // namespace launchers
}  // namespace paged_cuda

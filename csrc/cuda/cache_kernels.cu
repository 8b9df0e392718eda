// GPU build of the cache launchers (nvcc; no torch headers): the kCudaCache table of
// kernels/launch.h over kernels/cache.cuh.
#include "kernels/cache.cuh"
#include "kernels/launch.h"

namespace paged {

const CacheLaunchers kCudaCache = {
    [](const ReshapeCacheParams& p, Stream stream) { paged_cuda::cache::launch_reshape_and_cache(p, stream); },
    [](const Fp8Params& p, Stream stream) { paged_cuda::cache::launch_quantize(p, stream); },
    [](const Fp8Params& p, Stream stream) { paged_cuda::cache::launch_dequantize(p, stream); },
    [](const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs, Stream stream) {
      paged_cuda::cache::launch_copy_blocks(caches, num_caches, mapping, num_pairs, stream);
    },
};

}  // namespace paged

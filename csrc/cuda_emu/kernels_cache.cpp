// Emulator build of the cache launchers: the kEmuCache table of kernels/launch.h over
// kernels/cache.cuh, compiled by the host compiler against the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/cache.cuh"
#include "kernels/launch.h"

namespace paged {

const CacheLaunchers kEmuCache = {
    [](const ReshapeCacheParams& p, Stream stream) { paged_cuda_emu_impl::cache::launch_reshape_and_cache(p, stream); },
    [](const Fp8Params& p, Stream stream) { paged_cuda_emu_impl::cache::launch_quantize(p, stream); },
    [](const Fp8Params& p, Stream stream) { paged_cuda_emu_impl::cache::launch_dequantize(p, stream); },
    [](const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs, Stream stream) {
      paged_cuda_emu_impl::cache::launch_copy_blocks(caches, num_caches, mapping, num_pairs, stream);
    },
};

}  // namespace paged

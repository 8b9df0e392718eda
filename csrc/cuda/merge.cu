// GPU build of the merge_attention_states launcher (nvcc; no torch headers): kCudaMerge of
// kernels/launch.h over kernels/merge.cuh.
#include "kernels/launch.h"
#include "kernels/merge.cuh"

namespace paged {

const MergeLauncher kCudaMerge = [](const MergeParams& p, Stream stream) { paged_cuda::merge::launch(p, stream); };

}  // namespace paged

// GPU build of the merge_attention_states and merge_states launchers (nvcc; no torch headers):
// kCudaMerge and kCudaMergeStates of kernels/launch.h over kernels/merge.cuh.
#include "kernels/launch.h"
#include "kernels/merge.cuh"

namespace paged {

const MergeLauncher kCudaMerge = [](const MergeParams& p, Stream stream) { paged_cuda::merge::launch(p, stream); };
const MergeStatesLauncher kCudaMergeStates = [](const MergeStatesParams& p, Stream stream) {
  paged_cuda::merge::launch_states(p, stream);
};

}  // namespace paged

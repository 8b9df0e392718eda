// Emulator build of the merge_attention_states and merge_states launchers: kEmuMerge and
// kEmuMergeStates of kernels/launch.h over kernels/merge.cuh, compiled by the host compiler
// against the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/launch.h"
#include "kernels/merge.cuh"

namespace paged {

const MergeLauncher kEmuMerge = [](const MergeParams& p, Stream stream) {
  paged_cuda_emu_impl::merge::launch(p, stream);
};
const MergeStatesLauncher kEmuMergeStates = [](const MergeStatesParams& p, Stream stream) {
  paged_cuda_emu_impl::merge::launch_states(p, stream);
};

}  // namespace paged

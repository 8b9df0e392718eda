// Emulator build of the prefill launcher: kEmuPrefill of kernels/launch.h over kernels/prefill.cuh,
// compiled by the host compiler against the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/launch.h"
#include "kernels/prefill.cuh"

namespace paged {

const PrefillLauncher kEmuPrefill = [](const AttentionParams& p, const PrefillPlan& plan, Stream stream) {
  paged_cuda_emu_impl::prefill::launch(p, plan, stream);
};

}  // namespace paged

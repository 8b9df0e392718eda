// GPU build of the prefill launcher (nvcc; no torch headers): kCudaPrefill of kernels/launch.h over
// kernels/prefill.cuh (CUDA-core and tensor-core kernels).
#include "kernels/launch.h"
#include "kernels/prefill.cuh"

namespace paged {

const PrefillLauncher kCudaPrefill = [](const AttentionParams& p, const PrefillPlan& plan, Stream stream) {
  paged_cuda::prefill::launch(p, plan, stream);
};

}  // namespace paged

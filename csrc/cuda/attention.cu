// GPU build of the attention launchers (nvcc; no torch headers): the kAttention table of
// kernels/launch.h over kernels/decode.cuh and kernels/prefill.cuh.
#include "kernels/decode.cuh"
#include "kernels/launch.h"
#include "kernels/prefill.cuh"

namespace paged {

const AttentionLaunchers kCudaAttention = {
    [](const AttentionParams& p, const DecodePlan& plan, float* workspace, Stream stream) {
      paged_cuda::decode::launch(p, plan, workspace, stream);
    },
    [](const AttentionParams& p, const PrefillPlan& plan, Stream stream) {
      paged_cuda::prefill::launch(p, plan, stream);
    },
};

}  // namespace paged

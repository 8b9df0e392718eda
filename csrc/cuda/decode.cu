// GPU build of the decode launcher (nvcc; no torch headers): kCudaDecode of kernels/launch.h over
// kernels/decode.cuh.
#include "kernels/decode.cuh"
#include "kernels/launch.h"

namespace paged {

const DecodeLauncher kCudaDecode = [](const AttentionParams& p, const DecodePlan& plan, float* workspace,
                                      Stream stream) { paged_cuda::decode::launch(p, plan, workspace, stream); };

}  // namespace paged

// nvcc side of prefill_attention (kernels/prefill.cuh).
#include "kernels/prefill.cuh"
#include "cuda/launchers.h"

namespace paged_cuda {
namespace launchers {

void prefill_attention(const AttentionParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  prefill::launch_auto(p, cfg, stream);
}

}  // namespace launchers
}  // namespace paged_cuda

// nvcc side of decode_attention: instantiates the kernels of kernels/decode.cuh (no torch headers).
#include "kernels/decode.cuh"
#include "cuda/launchers.h"

namespace paged_cuda {
namespace launchers {

size_t decode_workspace_floats(const AttentionParams& p, const LaunchConfig& cfg) {
  return decode::plan(p, cfg).workspace_floats;
}
void decode_attention(const AttentionParams& p, const LaunchConfig& cfg, float* workspace, cudaStream_t stream) {
  decode::launch(p, cfg, workspace, stream);
}

}  // namespace launchers
}  // namespace paged_cuda

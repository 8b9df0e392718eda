// The attention kernels of csrc/kernels, compiled by the host compiler over the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/decode.cuh"
#include "kernels/prefill.cuh"
#include "cuda/launchers.h"

namespace paged_cuda_emu {
namespace launchers {
namespace k = ::paged_cuda_emu_impl;

size_t decode_workspace_floats(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& cfg) {
  return k::decode::plan(p, cfg).workspace_floats;
}
void decode_attention(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& cfg, float* workspace,
                      cudaStream_t stream) {
  k::decode::launch(p, cfg, workspace, stream);
}
void prefill_attention(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& cfg,
                       cudaStream_t stream) {
  k::prefill::launch_auto(p, cfg, stream);
}

}  // namespace launchers
}  // namespace paged_cuda_emu

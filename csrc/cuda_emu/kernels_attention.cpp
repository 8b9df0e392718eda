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

// Load accounting (cuda_emu::LoadWatch) for tests, exposed here because this file already sees the
// emulator header, which ops.cpp (torch headers) must not include.
void load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  cuda_emu::LoadWatch& w = cuda_emu::load_watch();
  w.lo[0] = reinterpret_cast<uintptr_t>(a);
  w.hi[0] = reinterpret_cast<uintptr_t>(a) + a_bytes;
  w.lo[1] = reinterpret_cast<uintptr_t>(b);
  w.hi[1] = reinterpret_cast<uintptr_t>(b) + b_bytes;
  w.bytes = 0;
  w.on = true;
}
uint64_t load_watch_end() {
  cuda_emu::LoadWatch& w = cuda_emu::load_watch();
  w.on = false;
  return w.bytes.load();
}

}  // namespace paged_cuda_emu

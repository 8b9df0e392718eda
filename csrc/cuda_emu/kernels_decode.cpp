// Emulator build of the decode launcher: kEmuDecode of kernels/launch.h over kernels/decode.cuh,
// compiled by the host compiler against the CUDA emulator.
#include "emu/cuda_emu.h"
#define PAGED_KERNEL_NS paged_cuda_emu_impl
#include "kernels/decode.cuh"
#include "kernels/launch.h"

namespace paged {

const DecodeLauncher kEmuDecode = [](const AttentionParams& p, const DecodePlan& plan, float* workspace,
                                     Stream stream) { paged_cuda_emu_impl::decode::launch(p, plan, workspace, stream); };

// The rows a step of this build's group-4 decode kernel takes (kernels_decode_sm80.cpp: the other).
int emu_decode_rows_per_step(int cache_bytes) {
  using namespace paged_cuda_emu_impl::decode;
  return cache_bytes == 4 ? decode_kernel_rows_per_step<kMaxHeadsPerThread, float>()
         : cache_bytes == 2 ? decode_kernel_rows_per_step<kMaxHeadsPerThread, __nv_bfloat16>()
                            : decode_kernel_rows_per_step<kMaxHeadsPerThread, __nv_fp8_e4m3>();
}

// Load accounting (cuda_emu::LoadWatch) for the test namespace's decode_kv_bytes_read, here because
// this file already sees the emulator header, which the torch binding must not include.
void emu_load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  cuda_emu::LoadWatch& w = cuda_emu::load_watch();
  w.lo[0] = reinterpret_cast<uintptr_t>(a);
  w.hi[0] = reinterpret_cast<uintptr_t>(a) + a_bytes;
  w.lo[1] = reinterpret_cast<uintptr_t>(b);
  w.hi[1] = reinterpret_cast<uintptr_t>(b) + b_bytes;
  w.bytes = 0;
  w.on = true;
}
uint64_t emu_load_watch_end() {
  cuda_emu::LoadWatch& w = cuda_emu::load_watch();
  w.on = false;
  return w.bytes.load();
}

}  // namespace paged

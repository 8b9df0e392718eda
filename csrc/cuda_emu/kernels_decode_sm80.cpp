// Emulator build of the decode kernels as nvcc compiles them for sm_80 / 86 / 89
// (PAGED_EMU_CUDA_ARCH 800: decode_kernel_rows_per_step's Ampere choice), so the code only those
// GPUs run is checked against the reference too. The cuda_emu backend launches it after
// paged_cuda_emu_test.set_emulated_arch(80); kernels_decode.cpp is the sm_90 build.
#include "emu/cuda_emu.h"
#define PAGED_EMU_CUDA_ARCH 800
#define PAGED_KERNEL_NS paged_cuda_emu_sm80_impl
#include "kernels/decode.cuh"
#include "kernels/launch.h"

namespace paged {

const DecodeLauncher kEmuDecodeSm80 = [](const AttentionParams& p, const DecodePlan& plan, float* workspace,
                                         Stream stream) {
  paged_cuda_emu_sm80_impl::decode::launch(p, plan, workspace, stream);
};

// The rows a step of this build's group-4 decode kernel takes, by cache element size (the tests
// check that the two builds differ where they should).
int emu_decode_rows_per_step_sm80(int cache_bytes) {
  using namespace paged_cuda_emu_sm80_impl::decode;
  return cache_bytes == 4 ? decode_kernel_rows_per_step<kMaxHeadsPerThread, float>()
         : cache_bytes == 2 ? decode_kernel_rows_per_step<kMaxHeadsPerThread, __nv_bfloat16>()
                            : decode_kernel_rows_per_step<kMaxHeadsPerThread, __nv_fp8_e4m3>();
}

}  // namespace paged

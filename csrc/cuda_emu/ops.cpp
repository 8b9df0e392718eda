// Backend `cuda_emu`: the CUDA kernels run on CPU tensors by the emulator (csrc/emu/cuda_emu.h).
// Same op bodies as the GPU backend (cuda/binding_common.h); launches are synchronous, the
// "stream" is null and the launch configuration is the kernels' fixed default unless
// PAGED_CUDA_CONFIG overrides it (the tests force the split-KV path that way).
#include <torch/library.h>

#include <cstring>

#include "cuda/binding_common.h"
#include "cuda/launchers.h"
#include "ops.h"

namespace paged_cuda_emu {
namespace {
namespace L = launchers;

struct EmuBackend {
  // What the GPU heuristics see on the emulator: an H100-sized device, so the emulated launches
  // take the same decisions (one-pass vs split-KV) as the GPU would at the same shapes.
  static int num_sms(const at::Tensor&) { return 132; }
  static paged_cuda::LaunchConfig config(const paged_cuda::AttentionParams&, bool) {
    return paged_cuda::binding::config_from_env();
  }
  static size_t decode_workspace_floats(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& c) {
    return L::decode_workspace_floats(p, c);
  }
  static void decode(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& c, float* ws) {
    L::decode_attention(p, c, ws, nullptr);
  }
  static void prefill(const paged_cuda::AttentionParams& p, const paged_cuda::LaunchConfig& c) {
    L::prefill_attention(p, c, nullptr);
  }
  static void reshape_and_cache(const paged_cuda::ReshapeCacheParams& p) { L::reshape_and_cache(p, nullptr); }
  static void quantize(void* o, int od, const void* i, int id, const float* s, int64_t n, int mb) {
    L::quantize_fp8(o, od, i, id, s, n, mb, nullptr);
  }
  static void dequantize(void* o, int od, const void* i, int id, const float* s, int64_t n, int mb) {
    L::dequantize_fp8(o, od, i, id, s, n, mb, nullptr);
  }
  static void copy_blocks(const paged_cuda::CacheDesc* c, int nc, const int64_t* m, int np) {
    L::copy_blocks(c, nc, m, np, nullptr);
  }
  static void memcpy(void* d, const void* s, size_t n, at::Device, at::Device) { std::memcpy(d, s, n); }
  static void after_swap(at::Device, at::Device) {}
};

namespace B = paged_cuda::binding;
}  // namespace
}  // namespace paged_cuda_emu

TORCH_LIBRARY(paged_cuda_emu, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY_IMPL(paged_cuda_emu, CPU, m) {
  using E = paged_cuda_emu::EmuBackend;
  namespace B = paged_cuda::binding;
  m.impl("reshape_and_cache", &B::reshape_and_cache<E>);
  m.impl("decode_attention", &B::decode_attention<E>);
  m.impl("prefill_attention", &B::prefill_attention<E>);
  m.impl("quantize_fp8", &B::quantize_fp8<E>);
  m.impl("dequantize_fp8", &B::dequantize_fp8<E>);
  m.impl("copy_blocks", &B::copy_blocks<E>);
  m.impl("swap_blocks", &B::swap_blocks<E>);
}

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

void load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes);  // kernels_attention.cpp
uint64_t load_watch_end();

namespace {
// decode_attention that also returns how many bytes its kernels read from the two KV caches'
// storages (through the kernels' load helpers). Tests compare it with the bytes of the live tokens
// to prove each KV token is read once per query group.
int64_t decode_kv_bytes_read(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             double scale, const B::OptTensor& k_scale, const B::OptTensor& v_scale) {
  auto range = [](const at::Tensor& t) { return std::make_pair(t.storage().data(), t.storage().nbytes()); };
  const auto k = range(key_cache), v = range(value_cache);
  load_watch_begin(k.first, k.second, v.first, v.second);
  try {
    B::decode_attention<EmuBackend>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                                    v_scale);
  } catch (...) {
    load_watch_end();
    throw;
  }
  return int64_t(load_watch_end());
}
}  // namespace
}  // namespace paged_cuda_emu

TORCH_LIBRARY(paged_cuda_emu, m) {
  PAGED_OPS_DEFINE_SCHEMAS(m);
  m.def("decode_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale) -> int",
        &paged_cuda_emu::decode_kv_bytes_read);
}

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

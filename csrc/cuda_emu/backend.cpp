// Backend `cuda_emu`: the CUDA kernels run on CPU tensors by the emulator (csrc/emu/cuda_emu.h),
// registered as torch.ops.paged_cuda_emu.* (CPU dispatch key) by the one registration
// (csrc/binding.h) over the emulator's launchers (kernels_*.cpp); launches are synchronous,
// there is no stream, and the launch configuration is the kernels' default. Test-only ops (an
// explicit launch configuration, the KV byte counter) are in the namespace paged_cuda_emu_test.
#include <torch/library.h>

#include <cstring>

#include "binding.h"

namespace paged {
void emu_load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes);  // kernels_decode.cpp
uint64_t emu_load_watch_end();
}  // namespace paged

namespace paged_cuda_emu {
namespace {

void copy_bytes(void* dst, const void* src, size_t bytes, paged::Stream) { std::memcpy(dst, src, bytes); }

}  // namespace

// What the GPU heuristics see on the emulator: an H100-sized device (132 SMs), so the emulated
// launches take the same decisions (one-pass vs split-KV) as the GPU would at the same shapes.
struct Backend {
  using Guard = paged::registration::NoGuard;
  static paged::binding::Target target(const at::Device&) {
    return {&paged::kEmuDecode, &paged::kEmuPrefill, nullptr, &paged::kEmuCache, &paged::kEmuMerge,
            &paged::kEmuMergeStates, nullptr, 132, copy_bytes, nullptr, /*int32_sizes=*/true};
  }
};

namespace {

using at::Tensor;
using paged::binding::OptTensor;
using Ops = paged::registration::Ops<Backend>;

// How many bytes `run` makes the kernels read from the two KV caches' storages (through the
// kernels' load helpers).
template <typename F>
int64_t kv_bytes_read(const Tensor& key_cache, const Tensor& value_cache, F&& run) {
  auto range = [](const Tensor& t) { return std::make_pair(t.storage().data(), t.storage().nbytes()); };
  const auto k = range(key_cache), v = range(value_cache);
  paged::emu_load_watch_begin(k.first, k.second, v.first, v.second);
  try {
    run();
  } catch (...) {
    paged::emu_load_watch_end();
    throw;
  }
  return int64_t(paged::emu_load_watch_end());
}

// decode_attention_config (with optional sliding windows) that also returns how many bytes its
// kernels read from the two KV caches. Tests compare it with the bytes of the live tokens to prove
// each KV token is read once per query group, and that a window reads only its own tokens.
int64_t decode_kv_bytes_read(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, double scale,
                             const OptTensor& k_scale, const OptTensor& v_scale, at::IntArrayRef config,
                             int64_t window_left, int64_t window_right) {
  return kv_bytes_read(key_cache, value_cache, [&] {
    Ops::decode_attention_config(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                            config, 0.0, window_left, std::nullopt, std::nullopt, std::nullopt, false, window_right);
  });
}
// The same for prefill_attention_config: a window (left, right, or both) must cost O(window) keys
// per row tile (batch_invariant: per row, through the decode kernel), not O(seq_len).
int64_t prefill_kv_bytes_read(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                              int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                              const OptTensor& v_scale, at::IntArrayRef config, int64_t window_left,
                              int64_t window_right, bool batch_invariant) {
  return kv_bytes_read(key_cache, value_cache, [&] {
    Ops::prefill_attention_config(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                             scale, causal, k_scale, v_scale, config, 0.0, window_left, std::nullopt, std::nullopt,
                             std::nullopt, batch_invariant, window_right);
  });
}

}  // namespace
}  // namespace paged_cuda_emu

PAGED_OPS_REGISTER_BACKEND(paged_cuda_emu, CPU, paged_cuda_emu::Backend)
PAGED_OPS_REGISTER_TEST_OPS(paged_cuda_emu_test, CPU, paged_cuda_emu::Backend)

// The KV byte counters (tests): the decode / prefill test ops that also say what their kernels read.
TORCH_LIBRARY_FRAGMENT(paged_cuda_emu_test, m) {
  m.def("decode_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
        "int window_left=-1, int window_right=-1) -> int");
  m.def("prefill_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
        "Tensor? k_scale, Tensor? v_scale, int[] config, int window_left=-1, int window_right=-1, "
        "bool batch_invariant=False) -> int");
}

TORCH_LIBRARY_IMPL(paged_cuda_emu_test, CPU, m) {
  m.impl("decode_kv_bytes_read", &paged_cuda_emu::decode_kv_bytes_read);
  m.impl("prefill_kv_bytes_read", &paged_cuda_emu::prefill_kv_bytes_read);
}

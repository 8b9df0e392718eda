// Backend `cuda_emu`: the CUDA kernels run on CPU tensors by the emulator (csrc/emu/cuda_emu.h),
// registered as torch.ops.paged_cuda_emu.* (CPU dispatch key). Same binding as the GPU backend
// (csrc/cuda/binding.h) over the emulator's launchers (kernels_*.cpp); launches are
// synchronous, there is no stream, and the launch configuration is the kernels' default. Test-only
// ops (an explicit launch configuration, the KV byte counter) are in the namespace
// paged_cuda_emu_test.
#include <torch/library.h>

#include <cstring>

#include "cuda/binding.h"
#include "ops.h"

namespace paged {
void emu_load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes);  // kernels_decode.cpp
uint64_t emu_load_watch_end();
}  // namespace paged

namespace paged_cuda_emu {
namespace {

namespace B = paged::binding;
using at::Tensor;
using B::OptTensor;

void copy_bytes(void* dst, const void* src, size_t bytes, paged::Stream) { std::memcpy(dst, src, bytes); }

// What the GPU heuristics see on the emulator: an H100-sized device (132 SMs), so the emulated
// launches take the same decisions (one-pass vs split-KV) as the GPU would at the same shapes.
const B::Target kTarget{&paged::kEmuDecode, &paged::kEmuPrefill, &paged::kEmuCache, nullptr, 132, copy_bytes,
                        nullptr, &paged::kEmuMerge, &paged::kEmuMergeStates};

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
  B::reshape_and_cache(kTarget, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}
void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, double scale, const OptTensor& k_scale,
                      const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  B::decode_attention(kTarget, nullptr, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                      v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                       int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                       const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  B::prefill_attention(kTarget, nullptr, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                       max_seqlen_q, scale, causal, k_scale, v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out, const Tensor& prefix_lse,
                            const Tensor& suffix_out, const Tensor& suffix_lse) {
  B::merge_attention_states(kTarget, out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
}
void merge_states(Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse) {
  B::merge_states(kTarget, out, out_lse, states, states_lse);
}
void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) { B::quantize_fp8(kTarget, out, input, scale); }
void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  B::dequantize_fp8(kTarget, out, input, scale);
}
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
  B::copy_blocks(kTarget, key_caches, value_caches, block_mapping);
}
void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  B::swap_blocks(kTarget, src, dst, block_mapping);
}

// ---- test namespace ---------------------------------------------------------------------------
void decode_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, double scale,
                             const OptTensor& k_scale, const OptTensor& v_scale, at::IntArrayRef config,
                             PAGED_OPS_VARIANT_PARAMS) {
  const paged::LaunchConfig cfg = B::config_from_list(config);
  B::decode_attention(kTarget, &cfg, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                      v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void prefill_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                              int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                              const OptTensor& v_scale, at::IntArrayRef config, PAGED_OPS_VARIANT_PARAMS) {
  const paged::LaunchConfig cfg = B::config_from_list(config);
  B::prefill_attention(kTarget, &cfg, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                       max_seqlen_q, scale, causal, k_scale, v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}

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
    decode_attention_config(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
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
    prefill_attention_config(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                             scale, causal, k_scale, v_scale, config, 0.0, window_left, std::nullopt, std::nullopt,
                             std::nullopt, batch_invariant, window_right);
  });
}

}  // namespace
}  // namespace paged_cuda_emu

TORCH_LIBRARY(paged_cuda_emu, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY_IMPL(paged_cuda_emu, CPU, m) {
  m.impl("reshape_and_cache", &paged_cuda_emu::reshape_and_cache);
  m.impl("decode_attention", &paged_cuda_emu::decode_attention);
  m.impl("prefill_attention", &paged_cuda_emu::prefill_attention);
  m.impl("merge_attention_states", &paged_cuda_emu::merge_attention_states);
  m.impl("merge_states", &paged_cuda_emu::merge_states);
  m.impl("quantize_fp8", &paged_cuda_emu::quantize_fp8);
  m.impl("dequantize_fp8", &paged_cuda_emu::dequantize_fp8);
  m.impl("copy_blocks", &paged_cuda_emu::copy_blocks);
  m.impl("swap_blocks", &paged_cuda_emu::swap_blocks);
}

// Test-only: config = [threads, partition_size, kv_tile, force_split, tensor_cores] (kernels/params.h
// LaunchConfig; [] = defaults); no validation of the tensors.
TORCH_LIBRARY(paged_cuda_emu_test, m) {
  m.def("decode_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
        PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
  m.def("prefill_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
        "Tensor? k_scale, Tensor? v_scale, int[] config, " PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
  m.def("decode_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
        "int window_left=-1, int window_right=-1) -> int");
  m.def("prefill_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
        "Tensor? k_scale, Tensor? v_scale, int[] config, int window_left=-1, int window_right=-1, "
        "bool batch_invariant=False) -> int");
}

TORCH_LIBRARY_IMPL(paged_cuda_emu_test, CPU, m) {
  m.impl("decode_attention_config", &paged_cuda_emu::decode_attention_config);
  m.impl("prefill_attention_config", &paged_cuda_emu::prefill_attention_config);
  m.impl("decode_kv_bytes_read", &paged_cuda_emu::decode_kv_bytes_read);
  m.impl("prefill_kv_bytes_read", &paged_cuda_emu::prefill_kv_bytes_read);
}

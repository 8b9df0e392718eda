// One registration of the op contract, instantiated once per C++ backend (csrc/backends.h's rows
// with no Python module). A backend's folder defines a type
//
//   struct Backend {
//     using Guard = ...;  // constructed from the call's device: c10::cuda::CUDAGuard, or NoGuard
//     static paged::binding::Target target(const at::Device& device);  // its launchers, stream, ...
//   };
//
// and writes, in one of its .cpp files,
//
//   PAGED_OPS_REGISTER_BACKEND(paged_cuda, CUDA, paged_cuda::Backend)
//
// which defines the namespace's schemas (csrc/ops.h) and binds every op to binding.h's function of
// it: tensors -> the kernels/params.h structs -> the target's launchers. The inputs were validated by
// the public op (csrc/public); a backend namespace's own ops trust their caller.
//
// PAGED_OPS_REGISTER_TEST_OPS(ns, Key, Backend) adds the test namespace `ns` (tests, the tuner): the
// attention ops with an explicit launch configuration (kernels/params.h LaunchConfig as a list).
#pragma once
#include <torch/library.h>

#include "attention_variants.h"
#include "cuda/binding.h"
#include "ops.h"

namespace paged::registration {

using at::Tensor;
using binding::OptTensor;

// The Guard of a backend whose kernels need no device context (the CPU).
struct NoGuard {
  explicit NoGuard(const at::Device&) {}
};

template <class Backend>
struct Ops {
  using Guard = typename Backend::Guard;

  static void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                                const Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
    const Guard guard(key_cache.device());
    binding::reshape_and_cache(Backend::target(key_cache.device()), key, value, key_cache, value_cache, slot_mapping,
                               k_scale, v_scale);
  }
  static void decode_with(const LaunchConfig* cfg, Tensor& out, const Tensor& query, const Tensor& key_cache,
                          const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens, double scale,
                          const OptTensor& k_scale, const OptTensor& v_scale, const AttentionVariants& variants) {
    const Guard guard(query.device());
    binding::decode_attention(Backend::target(query.device()), cfg, out, query, key_cache, value_cache, block_tables,
                              seq_lens, scale, k_scale, v_scale, variants);
  }
  static void prefill_with(const LaunchConfig* cfg, Tensor& out, const Tensor& query, const Tensor& key_cache,
                           const Tensor& value_cache, const Tensor& block_tables, const Tensor& cu_seqlens_q,
                           const Tensor& seq_lens, int64_t max_seqlen_q, double scale, bool causal,
                           const OptTensor& k_scale, const OptTensor& v_scale, const AttentionVariants& variants) {
    const Guard guard(query.device());
    binding::prefill_attention(Backend::target(query.device()), cfg, out, query, key_cache, value_cache, block_tables,
                               cu_seqlens_q, seq_lens, max_seqlen_q, scale, causal, k_scale, v_scale, variants);
  }
  static void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                               const Tensor& block_tables, const Tensor& seq_lens, double scale,
                               const OptTensor& k_scale, const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
    decode_with(nullptr, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                attention_variants(PAGED_OPS_VARIANT_ARGS));
  }
  static void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                                int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                                const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
    prefill_with(nullptr, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                 scale, causal, k_scale, v_scale, attention_variants(PAGED_OPS_VARIANT_ARGS));
  }
  static void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                                     const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse) {
    const Guard guard(out.device());
    binding::merge_attention_states(Backend::target(out.device()), out, out_lse, prefix_out, prefix_lse, suffix_out,
                                    suffix_lse);
  }
  static void merge_states(Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse) {
    const Guard guard(out.device());
    binding::merge_states(Backend::target(out.device()), out, out_lse, states, states_lse);
  }
  static void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
    const Guard guard(input.device());
    binding::quantize_fp8(Backend::target(input.device()), out, input, scale);
  }
  static void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
    const Guard guard(input.device());
    binding::dequantize_fp8(Backend::target(input.device()), out, input, scale);
  }
  static void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
    if (key_caches.empty()) return;
    const Guard guard(key_caches[0].device());
    binding::copy_blocks(Backend::target(key_caches[0].device()), key_caches, value_caches, block_mapping);
  }
  // src or dst may be on the CPU (a GPU backend's swap with pinned host memory): the call belongs to
  // the device of whichever is not, ordered on that device's stream.
  static void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
    const at::Device device = src.is_cpu() ? dst.device() : src.device();
    const Guard guard(device);
    binding::swap_blocks(Backend::target(device), src, dst, block_mapping);
  }

  static void impl(torch::Library& m) {
    m.impl("reshape_and_cache", &reshape_and_cache);
    m.impl("decode_attention", &decode_attention);
    m.impl("prefill_attention", &prefill_attention);
    m.impl("merge_attention_states", &merge_attention_states);
    m.impl("merge_states", &merge_states);
    m.impl("quantize_fp8", &quantize_fp8);
    m.impl("dequantize_fp8", &dequantize_fp8);
    m.impl("copy_blocks", &copy_blocks);
    m.impl("swap_blocks", &swap_blocks);
  }

  // ---- the test namespace: the same kernels with an explicit launch configuration ------------------
  static void decode_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache,
                                      const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                                      double scale, const OptTensor& k_scale, const OptTensor& v_scale,
                                      at::IntArrayRef config, PAGED_OPS_VARIANT_PARAMS) {
    const LaunchConfig cfg = binding::config_from_list(config);
    decode_with(&cfg, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                attention_variants(PAGED_OPS_VARIANT_ARGS));
  }
  static void prefill_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache,
                                       const Tensor& value_cache, const Tensor& block_tables,
                                       const Tensor& cu_seqlens_q, const Tensor& seq_lens, int64_t max_seqlen_q,
                                       double scale, bool causal, const OptTensor& k_scale, const OptTensor& v_scale,
                                       at::IntArrayRef config, PAGED_OPS_VARIANT_PARAMS) {
    const LaunchConfig cfg = binding::config_from_list(config);
    prefill_with(&cfg, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
                 causal, k_scale, v_scale, attention_variants(PAGED_OPS_VARIANT_ARGS));
  }
  static void define_test_ops(torch::Library& m) {
    m.def("decode_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
          "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
          PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
    m.def("prefill_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
          "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
          "Tensor? k_scale, Tensor? v_scale, int[] config, " PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
  }
  static void impl_test_ops(torch::Library& m) {
    m.impl("decode_attention_config", &decode_attention_config);
    m.impl("prefill_attention_config", &prefill_attention_config);
  }
};

}  // namespace paged::registration

#define PAGED_OPS_REGISTER_BACKEND(ns, key, Backend)                    \
  TORCH_LIBRARY(ns, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }                 \
  TORCH_LIBRARY_IMPL(ns, key, m) { ::paged::registration::Ops<Backend>::impl(m); }

// config = [threads, partition_size, kv_tile, force_split, tensor_cores] ([] = the defaults).
#define PAGED_OPS_REGISTER_TEST_OPS(ns, key, Backend)                                \
  TORCH_LIBRARY(ns, m) { ::paged::registration::Ops<Backend>::define_test_ops(m); }  \
  TORCH_LIBRARY_IMPL(ns, key, m) { ::paged::registration::Ops<Backend>::impl_test_ops(m); }

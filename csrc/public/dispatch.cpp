// torch.ops.paged.* on CPU and CUDA tensors: validate (validate.cpp), pick a backend
// (select.cpp), return on an empty call, and call the backend's namespace of the same op through
// the dispatcher. No Python runs on this path unless a use_backend block is open somewhere.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>

#include "attention_variants.h"
#include "inference_only.h"
#include "public/select.h"
#include "public/validate.h"

namespace paged::api {
namespace {

// The one C++ signature per op every namespace's kernel has (csrc/ops.h). SymInt here works
// with backend kernels that take int64_t: the dispatcher converts.
using ReshapeSig = void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, const OptTensor&,
                        const OptTensor&);
// The attention ops end in the variant parameters (csrc/attention_variants.h).
#define VARIANT_TYPES double, int64_t, const OptTensor&, const OptTensor&, const OptTensor&, bool, int64_t
using DecodeSig = void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                       const OptTensor&, const OptTensor&, VARIANT_TYPES);
using PrefillSig = void(Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, c10::SymInt, double, bool, const OptTensor&, const OptTensor&, VARIANT_TYPES);
#undef VARIANT_TYPES
using MergeSig = void(Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using MergeStatesSig = void(Tensor&, const OptTensor&, const Tensor&, const Tensor&);
using Fp8Sig = void(Tensor&, const Tensor&, const Tensor&);
using CopySig = void(at::TensorList, at::TensorList, const Tensor&);
using SwapSig = void(const Tensor&, Tensor&, const Tensor&);
using LatentCacheSig = void(const Tensor&, const Tensor&, Tensor&, const Tensor&, const OptTensor&);

// One op's handle in every backend namespace this build registered, looked up once.
template <class Sig>
class BackendOps {
 public:
  explicit BackendOps(const char* op) {
    for (int b = 0; b < kNumBackends; ++b) {
      const auto schema = c10::Dispatcher::singleton().findSchema({std::string(backend_namespace(b)) + "::" + op, ""});
      if (!schema.has_value()) {
        errors_[b] = "is not built into this installation";
        continue;
      }
      // A kernel registered with another C++ signature fails here; that breaks its backend only.
      try {
        handles_[b] = schema->typed<Sig>();
      } catch (const c10::Error& e) {
        errors_[b] = e.what_without_backtrace();
      }
    }
  }
  const c10::TypedOperatorHandle<Sig>& operator[](int backend) const {
    TORCH_CHECK(handles_[backend].has_value(), "paged_ops backend '", backend_name(backend), "' (namespace ",
                backend_namespace(backend), "): ", errors_[backend]);
    return *handles_[backend];
  }

 private:
  std::array<std::optional<c10::TypedOperatorHandle<Sig>>, kNumBackends> handles_;
  std::array<std::string, kNumBackends> errors_;
};

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
  check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  const int backend = select_backend(key.device());
  if (key.size(0) == 0) return;
  static const BackendOps<ReshapeSig> ops("reshape_and_cache");
  ops[backend].call(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}

void concat_and_cache_mla(const Tensor& latent, const Tensor& rope, Tensor& latent_cache, const Tensor& slot_mapping,
                          const OptTensor& scale) {
  check_concat_and_cache_mla(latent, rope, latent_cache, slot_mapping, scale);
  const int backend = select_backend(latent.device());
  if (latent.size(0) == 0) return;
  static const BackendOps<LatentCacheSig> ops("concat_and_cache_mla");
  ops[backend].call(latent, rope, latent_cache, slot_mapping, scale);
}

void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, double scale, const OptTensor& k_scale,
                      const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  check_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
  check_attention_variants(out, query, PAGED_OPS_VARIANT_ARGS);
  check_attention_outputs_apart(out, lse, query, key_cache, value_cache, block_tables, seq_lens, std::nullopt,
                                k_scale, v_scale, sinks, alibi_slopes);
  const int backend = select_attention_backend(out.device(), {query, key_cache, block_tables, nullptr});
  if (query.numel() == 0) return;
  batch_invariant = batch_invariant_mode(batch_invariant);
  static const BackendOps<DecodeSig> ops("decode_attention");
  ops[backend].call(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                    PAGED_OPS_VARIANT_ARGS);
}

void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                       c10::SymInt max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                       const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  check_prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                          max_seqlen_q.guard_int(__FILE__, __LINE__), k_scale, v_scale);
  check_attention_variants(out, query, PAGED_OPS_VARIANT_ARGS);
  check_attention_outputs_apart(out, lse, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                                k_scale, v_scale, sinks, alibi_slopes);
  const int backend = select_attention_backend(out.device(), {query, key_cache, block_tables, &max_seqlen_q});
  if (query.numel() == 0) return;
  batch_invariant = batch_invariant_mode(batch_invariant);
  static const BackendOps<PrefillSig> ops("prefill_attention");
  ops[backend].call(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, std::move(max_seqlen_q),
                    scale, causal, k_scale, v_scale, PAGED_OPS_VARIANT_ARGS);
}

void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out, const Tensor& prefix_lse,
                            const Tensor& suffix_out, const Tensor& suffix_lse) {
  check_merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
  const int backend = select_backend(out.device());
  if (out.numel() == 0 && !(out_lse && out_lse->numel())) return;
  static const BackendOps<MergeSig> ops("merge_attention_states");
  ops[backend].call(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
}

void merge_states(Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse) {
  check_merge_states(out, out_lse, states, states_lse);
  const int backend = select_backend(out.device());
  if (out.numel() == 0 && !(out_lse && out_lse->numel())) return;
  static const BackendOps<MergeStatesSig> ops("merge_states");
  ops[backend].call(out, out_lse, states, states_lse);
}

void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  check_quantize_fp8(out, input, scale);
  const int backend = select_backend(out.device());
  if (input.numel() == 0) return;
  static const BackendOps<Fp8Sig> ops("quantize_fp8");
  ops[backend].call(out, input, scale);
}

void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  check_dequantize_fp8(out, input, scale);
  const int backend = select_backend(out.device());
  if (input.numel() == 0) return;
  static const BackendOps<Fp8Sig> ops("dequantize_fp8");
  ops[backend].call(out, input, scale);
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
  check_copy_blocks(key_caches, value_caches, block_mapping);
  const c10::Device device = key_caches[0].device();
  const int backend = select_backend(device);
  if (block_mapping.size(0) == 0) return;
  static const BackendOps<CopySig> ops("copy_blocks");
  // Backends get the mapping on the caches' device.
  ops[backend].call(key_caches, value_caches, block_mapping.device() == device ? block_mapping : block_mapping.to(device));
}

void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  check_swap_blocks(src, dst, block_mapping);
  // A GPU<->CPU swap belongs to the GPU's backend.
  const int backend = select_backend(src.is_cpu() ? dst.device() : src.device());
  if (block_mapping.size(0) == 0) return;
  static const BackendOps<SwapSig> ops("swap_blocks");
  ops[backend].call(src, dst, block_mapping);
}

}  // namespace
}  // namespace paged::api

#define PAGED_OPS_IMPL_PUBLIC(m)                                  \
  m.impl("reshape_and_cache", &paged::api::reshape_and_cache);    \
  m.impl("decode_attention", &paged::api::decode_attention);      \
  m.impl("prefill_attention", &paged::api::prefill_attention);    \
  m.impl("merge_attention_states", &paged::api::merge_attention_states); \
  m.impl("merge_states", &paged::api::merge_states);              \
  m.impl("quantize_fp8", &paged::api::quantize_fp8);              \
  m.impl("dequantize_fp8", &paged::api::dequantize_fp8);          \
  m.impl("copy_blocks", &paged::api::copy_blocks);                \
  m.impl("swap_blocks", &paged::api::swap_blocks);               \
  m.impl("concat_and_cache_mla", &paged::api::concat_and_cache_mla)

TORCH_LIBRARY_IMPL(paged, CPU, m) { PAGED_OPS_IMPL_PUBLIC(m); }
TORCH_LIBRARY_IMPL(paged, CUDA, m) { PAGED_OPS_IMPL_PUBLIC(m); }
// Inference-only: refuse inputs that require grad (csrc/inference_only.h).
TORCH_LIBRARY_IMPL(paged, Autograd, m) { PAGED_OPS_IMPL_INFERENCE_ONLY(m); }

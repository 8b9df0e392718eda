// The keyword-only arguments of decode_attention and prefill_attention (csrc/ops.h,
// PAGED_OPS_SCHEMA_ATTENTION_VARIANTS; semantics: paged_ops/reference.py attention), as the flat
// C++ parameters every namespace's kernel takes (the dispatcher calls them flat) and as one value
// the bindings pass down.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

// Flat parameters and arguments, in schema order, for the op entry points.
#define PAGED_OPS_VARIANT_PARAMS                                                                  \
  double softcap, int64_t window_left, const std::optional<at::Tensor>&sinks,                     \
      const std::optional<at::Tensor>&alibi_slopes, const std::optional<at::Tensor>&lse, bool batch_invariant, \
      int64_t window_right
#define PAGED_OPS_VARIANT_ARGS softcap, window_left, sinks, alibi_slopes, lse, batch_invariant, window_right

namespace paged {

struct AttentionVariants {
  double softcap = 0.0;  // > 0: s = softcap * tanh(s / softcap)
  int64_t window_left = -1;  // >= 0: keys p - window_left .. p only
  std::optional<at::Tensor> sinks;  // float32 [num_heads]
  std::optional<at::Tensor> alibi_slopes;  // float32 [num_heads]
  std::optional<at::Tensor> lse;  // out: float32 [num_tokens, num_heads], contiguous
  bool batch_invariant = false;
  int64_t window_right = -1;  // >= 0: keys up to p + window_right only (causal stops at p anyway)

  // Pointers the kernels take (null: argument not given).
  const float* sinks_ptr() const { return sinks ? sinks->data_ptr<float>() : nullptr; }
  const float* alibi_slopes_ptr() const { return alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr; }
  float* lse_ptr() const { return lse ? lse->data_ptr<float>() : nullptr; }
};

inline AttentionVariants attention_variants(PAGED_OPS_VARIANT_PARAMS) {
  return AttentionVariants{softcap, window_left, sinks, alibi_slopes, lse, batch_invariant, window_right};
}

// Where an fp8 scale (k_scale / v_scale, validated) keeps the value of (sequence s, KV head h):
// scale[s * seq_stride + h * head_stride]. One element: per tensor (0, 0); 1-D [num_kv_heads]:
// per KV head (0, 1); 2-D [num_seqs, num_kv_heads]: per sequence and KV head (its strides).
// K and V each have their own form. Absent (not fp8): (0, 0) and a null pointer.
struct ScaleStrides {
  int64_t seq_stride = 0, head_stride = 0;
};
inline ScaleStrides scale_strides(const std::optional<at::Tensor>& scale) {
  if (!scale || scale->numel() == 1) return {};
  if (scale->dim() == 2) return {scale->stride(0), scale->stride(1)};
  return {0, 1};
}

}  // namespace paged

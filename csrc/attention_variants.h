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
      const std::optional<at::Tensor>&alibi_slopes, const std::optional<at::Tensor>&lse, bool batch_invariant
#define PAGED_OPS_VARIANT_ARGS softcap, window_left, sinks, alibi_slopes, lse, batch_invariant

namespace paged {

struct AttentionVariants {
  double softcap = 0.0;  // > 0: s = softcap * tanh(s / softcap)
  int64_t window_left = -1;  // >= 0: keys p - window_left .. p only
  std::optional<at::Tensor> sinks;  // float32 [num_heads]
  std::optional<at::Tensor> alibi_slopes;  // float32 [num_heads]
  std::optional<at::Tensor> lse;  // out: float32 [num_tokens, num_heads], contiguous
  bool batch_invariant = false;

  // Pointers the kernels take (null: argument not given).
  const float* sinks_ptr() const { return sinks ? sinks->data_ptr<float>() : nullptr; }
  const float* alibi_slopes_ptr() const { return alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr; }
  float* lse_ptr() const { return lse ? lse->data_ptr<float>() : nullptr; }
};

inline AttentionVariants attention_variants(PAGED_OPS_VARIANT_PARAMS) {
  return AttentionVariants{softcap, window_left, sinks, alibi_slopes, lse, batch_invariant};
}

}  // namespace paged

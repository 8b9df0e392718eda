// The cpu backend: C++/OpenMP kernels; attention computes in fp32 and keeps its running sums in fp64.
// Inputs are validated before they get here (the public op path, csrc/public/); semantics: paged_ops/reference.py.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>

#include "attention_variants.h"

// The kernels built once per instruction set (csrc/cpu/isa.h): declared in paged::cpu, where
// csrc/cpu/dispatch.cpp forwards them to the active ISA's build, and in each ISA's namespace.
#define PAGED_CPU_DECLARE_ISA_KERNELS                                                                    \
  void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache,                       \
                         Tensor& value_cache, const Tensor& slot_mapping, const OptTensor& k_scale,       \
                         const OptTensor& v_scale);                                                       \
  void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache,                        \
                        const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,    \
                        double scale, const OptTensor& k_scale, const OptTensor& v_scale,                 \
                        PAGED_OPS_VARIANT_PARAMS);                                                         \
  void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache,                       \
                         const Tensor& value_cache, const Tensor& block_tables,                           \
                         const Tensor& cu_seqlens_q, const Tensor& seq_lens, int64_t max_seqlen_q,        \
                         double scale, bool causal, const OptTensor& k_scale, const OptTensor& v_scale,   \
                         PAGED_OPS_VARIANT_PARAMS);                                                        \
  void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale);                               \
  void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale);

namespace paged::cpu {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

PAGED_CPU_DECLARE_ISA_KERNELS
// Whole-block memcpy: no arithmetic to vectorize, so built once.
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const Tensor& block_mapping);
void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping);
// Memory-bound, fp32 math: built once, with the baseline flags.
void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                            const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse);
// The N-way merge (states [num_tokens, num_states, num_heads, head_size]): also memory-bound, fp32 math.
void merge_states(Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse);
}  // namespace paged::cpu

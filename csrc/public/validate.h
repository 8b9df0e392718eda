// Input validation of the public ops (torch.ops.paged.*), run before any backend sees the tensors.
//
// Dtype, rank, shape, device, stride and size checks read only tensor metadata and always run.
// Checks that read tensor contents (block ids of used blocks, slots, copy/swap indices, seq_lens,
// cu_seqlens_q, max_seqlen_q against the longest query) always run on CPU tensors, in place;
// on CUDA tensors they would cost a device sync, so they run only with PAGED_OPS_CHECK=1 (then
// on a host copy). Every failure is a c10::ValueError (Python: ValueError) naming the argument.
// What a backend may then assume: docs/CONTRACT_NOTES.md.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace paged::api {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

void check_reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& slot_mapping,
                             const OptTensor& k_scale, const OptTensor& v_scale);
// MLA's latent cache write: latent [num_tokens, kv_lora_rank], rope [num_tokens, rope_dim],
// latent_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]; scale for fp8 caches only.
void check_concat_and_cache_mla(const Tensor& latent, const Tensor& rope, const Tensor& latent_cache,
                                const Tensor& slot_mapping, const OptTensor& scale);
void check_decode_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                            const Tensor& value_cache, const Tensor& block_tables,
                            const Tensor& seq_lens, const OptTensor& k_scale,
                            const OptTensor& v_scale);
void check_prefill_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& block_tables,
                             const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                             int64_t max_seqlen_q, const OptTensor& k_scale,
                             const OptTensor& v_scale);
// The keyword-only variant arguments of both attention ops (csrc/attention_variants.h).
void check_attention_variants(const Tensor& out, const Tensor& query, double softcap, int64_t window_left,
                              const OptTensor& sinks, const OptTensor& alibi_slopes, const OptTensor& lse,
                              bool batch_invariant, int64_t window_right);
// The attention ops' outputs (out, lse) apart from every input and from each other
// (cu_seqlens_q: prefill only).
void check_attention_outputs_apart(const Tensor& out, const OptTensor& lse, const Tensor& query,
                                   const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                                   const Tensor& seq_lens, const OptTensor& cu_seqlens_q, const OptTensor& k_scale,
                                   const OptTensor& v_scale, const OptTensor& sinks, const OptTensor& alibi_slopes);
// Shapes/dtypes/devices of merge_attention_states; its outputs must not overlap any input or each other.
void check_merge_attention_states(const Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                                  const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse);
// merge_states: states [num_tokens, num_states, num_heads, head_size], states_lse
// [num_tokens, num_states, num_heads]; outputs apart from the inputs and each other.
void check_merge_states(const Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse);
void check_quantize_fp8(const Tensor& out, const Tensor& input, const Tensor& scale);
void check_dequantize_fp8(const Tensor& out, const Tensor& input, const Tensor& scale);
void check_copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                       const Tensor& block_mapping);
void check_swap_blocks(const Tensor& src, const Tensor& dst, const Tensor& block_mapping);

// CPU memory that stands for device memory: the cuda_emu backend's test buffers that the host
// cannot read (csrc/cuda_emu/backend.cpp). Content checks treat tensors in it as they treat CUDA
// tensors (only with PAGED_OPS_CHECK=1, then through copy_to_host, the emulator's cudaMemcpy).
// Installed once by a backend; csrc/public knows nothing else of the emulator.
struct EmulatedDeviceMemory {
  bool (*holds)(const void* data);
  void (*copy_to_host)(void* dst, const void* src, size_t bytes);
};
void set_emulated_device_memory(const EmulatedDeviceMemory* memory);

}  // namespace paged::api

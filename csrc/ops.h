// The op contract of namespace `paged`, written once.
//
// TORCH_LIBRARY(paged, m) registers it as the public API; every backend registers the same
// schemas in its own namespace (paged_cpu, paged_cuda_emu, paged_cuda in C++, paged_triton
// defined in C++ with Python kernels) so that each implementation stays callable on its own
// (paged_ops.backend(name)) while torch.ops.paged.* validates and routes between them
// (csrc/public/). Semantics: paged_ops/reference.py.
//
// Conventions, so that every namespace's kernel has the one C++ signature the public op calls
// through the dispatcher (csrc/public/dispatch.cpp): `Tensor(a!)` -> at::Tensor&, `Tensor` ->
// const at::Tensor&, `Tensor?` -> const std::optional<at::Tensor>&, `Tensor[]` -> at::TensorList,
// `float` -> double, `SymInt` -> int64_t in a backend kernel (c10::SymInt in the public op).
// Size-like ints are SymInt so torch.compile(dynamic=True) traces them symbolically instead of
// recompiling per value. New optional arguments go at the end, with a default, so existing
// callers keep working.
#pragma once

#define PAGED_OPS_SCHEMA_RESHAPE_AND_CACHE                                                     \
  "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, " \
  "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
// The keyword-only tail decode_attention and prefill_attention share (reference.attention):
// logit soft-cap (0: none), sliding window (-1: none), per-head sinks and ALiBi slopes (float32
// [num_heads]), the rows' log-sum-exp out (float32 [num_tokens, num_heads]), and the
// batch-invariant mode (bitwise results independent of the rest of the batch; the public op also
// turns it on inside paged_ops.batch_invariant() and with PAGED_OPS_BATCH_INVARIANT=1), and the
// right edge of a sliding window (-1: none; FlashAttention's local attention without causal).
#define PAGED_OPS_SCHEMA_ATTENTION_VARIANTS                                                    \
  "*, float softcap=0.0, int window_left=-1, Tensor? sinks=None, Tensor? alibi_slopes=None, "  \
  "Tensor(b!)? lse=None, bool batch_invariant=False, int window_right=-1"
#define PAGED_OPS_SCHEMA_DECODE_ATTENTION                                                      \
  "decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "      \
  "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale=None, "                  \
  "Tensor? v_scale=None, " PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()"
#define PAGED_OPS_SCHEMA_PREFILL_ATTENTION                                                     \
  "prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "     \
  "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, SymInt max_seqlen_q, "           \
  "float scale, bool causal=True, Tensor? k_scale=None, Tensor? v_scale=None, "               \
  PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()"
#define PAGED_OPS_SCHEMA_QUANTIZE_FP8 "quantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()"
#define PAGED_OPS_SCHEMA_DEQUANTIZE_FP8 \
  "dequantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()"
#define PAGED_OPS_SCHEMA_COPY_BLOCKS \
  "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()"
#define PAGED_OPS_SCHEMA_SWAP_BLOCKS \
  "swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()"

// MLA's latent cache (vLLM's concat_and_cache_mla): token t's latent [kv_lora_rank] and RoPE part
// [rope_dim], concatenated, into slot slot_mapping[t] of a [num_blocks, block_size, 1,
// kv_lora_rank + rope_dim] cache (one KV head: the attention ops read it as key_cache, and its
// first kv_lora_rank columns as value_cache); fp8 caches take one per-tensor scale.
#define PAGED_OPS_SCHEMA_CONCAT_AND_CACHE_MLA                                                  \
  "concat_and_cache_mla(Tensor latent, Tensor rope, Tensor(a!) latent_cache, Tensor slot_mapping, " \
  "Tensor? scale=None) -> ()"
#define PAGED_OPS_SCHEMA_MERGE_ATTENTION_STATES                                                       \
  "merge_attention_states(Tensor(a!) out, Tensor(b!)? out_lse, Tensor prefix_out, Tensor prefix_lse, " \
  "Tensor suffix_out, Tensor suffix_lse) -> ()"
// N-way merge (split-KV, context parallelism): states [num_tokens, num_states, num_heads, head_size],
// states_lse [num_tokens, num_states, num_heads].
#define PAGED_OPS_SCHEMA_MERGE_STATES \
  "merge_states(Tensor(a!) out, Tensor(b!)? out_lse, Tensor states, Tensor states_lse) -> ()"

#define PAGED_OPS_DEFINE_SCHEMAS(m)              \
  m.def(PAGED_OPS_SCHEMA_RESHAPE_AND_CACHE);     \
  m.def(PAGED_OPS_SCHEMA_DECODE_ATTENTION);      \
  m.def(PAGED_OPS_SCHEMA_PREFILL_ATTENTION);     \
  m.def(PAGED_OPS_SCHEMA_MERGE_ATTENTION_STATES); \
  m.def(PAGED_OPS_SCHEMA_MERGE_STATES);          \
  m.def(PAGED_OPS_SCHEMA_QUANTIZE_FP8);          \
  m.def(PAGED_OPS_SCHEMA_DEQUANTIZE_FP8);        \
  m.def(PAGED_OPS_SCHEMA_COPY_BLOCKS);           \
  m.def(PAGED_OPS_SCHEMA_SWAP_BLOCKS);           \
  m.def(PAGED_OPS_SCHEMA_CONCAT_AND_CACHE_MLA)

// The op contract of namespace `paged`, written once.
//
// TORCH_LIBRARY(paged, m) registers it as the public API; every C++ backend registers the same
// schemas in its own namespace (paged_cpu, paged_cuda_emu, paged_cuda) so that each
// implementation stays callable on its own (paged_ops.backend(name)) while torch.ops.paged.*
// routes between them. Semantics: paged_ops/reference.py.
#pragma once

#define PAGED_OPS_DEFINE_SCHEMAS(m)                                                              \
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "                     \
        "Tensor(b!) value_cache, Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale) -> ()"); \
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "  \
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, "                   \
        "Tensor? v_scale) -> ()");                                                               \
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "                     \
        "Tensor value_cache, Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, "        \
        "int max_seqlen_q, float scale, bool causal, Tensor? k_scale, Tensor? v_scale) -> ()");  \
  m.def("quantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");                       \
  m.def("dequantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");                     \
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, "                       \
        "Tensor block_mapping) -> ()");                                                          \
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()")

// Plain-data parameter blocks shared by the launchers (csrc/cuda/*.cu), the emulator bindings
// (csrc/cuda_emu/*.cpp) and the torch bindings (csrc/cuda/*.cpp). No CUDA or torch types, so every
// compiler in the build can include it.
#pragma once
#include <cstdint>

namespace paged_cuda {

// Launch configuration of the attention kernels. 0 = let the launcher pick its default.
struct LaunchConfig {
  int threads = 0;         // threads per block (multiple of 32)
  int partition_size = 0;  // decode: KV tokens per split-KV partition; < 0 forces the one-pass kernel
  int kv_tile = 0;         // prefill, and decode for query groups > 8: KV tokens per shared-memory tile
  int force_split = 0;     // decode: 1 = always split-KV (tests), 0 = heuristic
  int tensor_cores = 0;    // prefill: 1 / 0 (default) = mma.sync path for fp16/bf16, -1 = CUDA cores
};

struct AttentionParams {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;  // prefill only
  const float* k_scale;         // fp8 caches only; nullptr otherwise
  const float* v_scale;
  int k_scale_per_head, v_scale_per_head;
  int dtype, cache_dtype;       // paged_cuda::DType codes
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int max_seqlen_q;             // prefill only
  int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head;
  int64_t k_stride_block, k_stride_tok, k_stride_head;
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  int64_t bt_stride;
  float scale;
  bool causal;
  int num_sms;                  // for the split-KV heuristic
};

struct ReshapeCacheParams {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  const float* k_scale;
  const float* v_scale;
  int k_scale_per_head, v_scale_per_head;
  int dtype, cache_dtype;
  int num_tokens, num_kv_heads, head_size, block_size;
  int64_t key_stride_tok, key_stride_head, value_stride_tok, value_stride_head;
  int64_t k_stride_block, k_stride_tok, k_stride_head;
  int64_t v_stride_block, v_stride_tok, v_stride_head;
};

// One cache tensor of one layer for copy_blocks: base pointer and its element strides.
struct CacheDesc {
  int64_t ptr;  // device address
  int64_t stride_block, stride_tok, stride_head;
  int32_t block_size, num_heads, head_size, elem_bytes;
};

}  // namespace paged_cuda

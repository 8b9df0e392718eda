// Plain-data parameters of the paged ops, as the kernels see them: raw pointers, element strides and
// sizes. No torch and no CUDA types, so every compiler of the build can include it: nvcc (the GPU
// kernels), the host compiler over the emulator (csrc/cuda_emu), the cpu backend's kernels
// (csrc/cpu) and the bindings. Every C++ backend takes these structs: one meaning per field.
// Semantics of every field: paged_ops/reference.py (the specification).
#pragma once
#include <cstdint>

namespace paged {

// dtype codes the bindings pass in (no torch enum below the bindings).
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, E4M3 = 3, E5M2 = 4 };

// A launch's stream: a cudaStream_t on a GPU, null on the emulator (no CUDA types here).
using Stream = void*;

inline int dtype_bytes(DType d) { return d == DType::F32 ? 4 : (d == DType::F16 || d == DType::BF16) ? 2 : 1; }

// Launch configuration of the attention kernels. 0 = the launcher's default. The GPU binding takes
// it from the tuned-config table (csrc/cuda/tuning.h); tests pass one explicitly through the test
// namespace's *_config ops.
struct LaunchConfig {
  int threads = 0;         // threads per block (multiple of 32)
  int partition_size = 0;  // decode: KV tokens per split-KV partition; < 0 forces the one-pass kernel
  int kv_tile = 0;         // prefill, and decode for query groups > 8: KV tokens per shared-memory tile
  int force_split = 0;     // decode: 1 = always split-KV (tests), 0 = heuristic
  int tensor_cores = 0;    // prefill: 1 / 0 (default) = mma.sync path for fp16/bf16, -1 = CUDA cores
};

// decode_attention (cu_seqlens_q == nullptr: one query token per sequence) and prefill_attention.
// Keys and values may differ in head size (MLA): query and key_cache have head_size (Dk), value_cache
// and out value_head_size (Dv <= Dk). value_cache may be a view into key_cache's storage (absorbed
// MLA: its first Dv columns), so nothing may assume the two are apart; neither is written.
struct AttentionParams {
  void* out;          // [num_tokens, num_heads, value_head_size]
  const void* query;  // [num_tokens, num_heads, head_size]
  int64_t q_stride_token, q_stride_head, o_stride_token, o_stride_head;
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_size] by strides
  const void* value_cache;  // [num_blocks, block_size, num_kv_heads, value_head_size] by strides
  int64_t k_stride_block, k_stride_token, k_stride_head;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], rows block_table_stride apart
  int64_t max_blocks_per_seq, block_table_stride;
  const int32_t* cu_seqlens_q;  // prefill: [num_seqs + 1]; decode: nullptr
  const int32_t* seq_lens;      // [num_seqs]
  // fp8 caches: the scale of (sequence s, KV head h) is k_scale[s * k_scale_seq_stride +
  // h * k_scale_head_stride]: strides (0, 0) per tensor, (0, 1) per KV head, (num_kv_heads, 1) per
  // sequence and KV head (paged::scale_strides). K and V each have their own. nullptr: not fp8.
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_seq_stride, k_scale_head_stride, v_scale_seq_stride, v_scale_head_stride;
  DType dtype, cache_dtype;
  // int64: the cpu backend takes any size a tensor can have (a stride-0 view of block_size 2^32 + 16);
  // the CUDA binding rejects what does not fit the kernels' 32-bit indices (binding int_size), and
  // the kernels narrow to int where they index.
  int64_t num_seqs, num_tokens;
  int64_t num_heads, num_kv_heads, head_size, block_size;
  int64_t value_head_size;  // Dv: value_cache's and out's head size, <= head_size
  // prefill: sizes the grid, never trusted for correctness (every row of every sequence is
  // computed whatever it says); clamped to num_tokens by the plan.
  int64_t max_seqlen_q;
  float scale;
  bool causal;
  int num_sms;  // of the device, for the split-KV heuristic
  int max_cluster_size;  // thread-block cluster blocks the device launches (16 from sm_90; 0: none)
  // The variants (paged_ops/reference.py attention): defaults 0, -1, -1, nullptr, nullptr, nullptr, false.
  float softcap;               // > 0: s = softcap * tanh(s / softcap)
  int64_t window_left;         // >= 0: query at position p sees no key before p - window_left
  int64_t window_right;        // >= 0: ... and none after p + window_right (causal stops at p anyway)
  const float* sinks;          // [num_heads]: one more logit per head in the denominator
  const float* alibi_slopes;   // [num_heads]: s += slope * (j - p)
  float* lse;                  // [num_tokens, num_heads], contiguous: ln of the row's denominator
  bool batch_invariant;        // bitwise independent of the rest of the batch and of the plan
};

// value_cache is key_cache's first value_head_size columns: the same base and strides (absorbed MLA:
// value_cache = key_cache[..., :Dv]). A kernel may then take each V row from the K row it already
// loaded instead of reading the latent a second time.
inline bool values_in_key_rows(const AttentionParams& p) {
  return p.value_cache == p.key_cache && p.v_stride_block == p.k_stride_block &&
         p.v_stride_token == p.k_stride_token && p.v_stride_head == p.k_stride_head &&
         p.value_head_size <= p.head_size;
}

struct ReshapeCacheParams {
  const void* key;    // [num_tokens, num_kv_heads, head_size]
  const void* value;
  void* key_cache;    // as AttentionParams
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]; < 0: padding token, skipped
  // Per tensor (stride 0) or per KV head (stride 1): no sequences here. nullptr: not fp8.
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_head_stride, v_scale_head_stride;
  DType dtype, cache_dtype;
  int64_t num_tokens;
  int num_kv_heads, head_size, block_size;
  int value_head_size;  // may differ from head_size (MLA: the latent and its RoPE part)
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  int64_t k_stride_block, k_stride_token, k_stride_head;
  int64_t v_stride_block, v_stride_token, v_stride_head;
};

// quantize_fp8 / dequantize_fp8 over contiguous tensors of n elements.
struct Fp8Params {
  void* out;
  const void* input;
  const float* scale;  // one element
  DType out_dtype, input_dtype;
  int64_t n;
  int max_blocks;  // grid cap of the grid-stride loop
};

// merge_attention_states (paged_ops/reference.py): rows [num_tokens, num_heads, head_size] by
// strides (last dim contiguous), log-sum-exps float32 [num_tokens, num_heads] contiguous.
struct MergeParams {
  void* out;
  float* out_lse;  // nullptr: not asked for
  const void* prefix_out;
  const float* prefix_lse;
  const void* suffix_out;
  const float* suffix_lse;
  int64_t o_stride_token, o_stride_head;
  int64_t prefix_stride_token, prefix_stride_head;
  int64_t suffix_stride_token, suffix_stride_head;
  DType dtype;
  int64_t num_tokens;
  int num_heads, head_size;
  bool aligned;    // head_size % 8 == 0 and every row of the three tensors starts on an 8-element vector
  int max_blocks;  // grid cap of the grid-stride loop
};

// merge_states (paged_ops/reference.py): out [num_tokens, num_heads, head_size] = the log-sum-exp
// weighted mean of num_states states [num_tokens, num_states, num_heads, head_size] (last dim
// contiguous, other strides any, 0 included), their lses float32 [num_tokens, num_states, num_heads]
// by any strides; out_lse float32 [num_tokens, num_heads] contiguous (nullptr: not asked for).
struct MergeStatesParams {
  void* out;
  float* out_lse;
  const void* states;
  const float* states_lse;
  int64_t o_stride_token, o_stride_head;
  int64_t s_stride_token, s_stride_state, s_stride_head;
  int64_t lse_stride_token, lse_stride_state, lse_stride_head;
  DType dtype;
  int64_t num_tokens, num_states;
  int num_heads, head_size;
  bool aligned;    // head_size % 8 == 0 and every row of out and states starts on an 8-element vector
  int max_blocks;  // grid cap of the grid-stride loop
};

// One cache tensor of one layer for copy_blocks: base address and its element strides.
struct CacheDesc {
  int64_t ptr;  // device address
  int64_t stride_block, stride_token, stride_head;
  int32_t block_size, num_heads, head_size, elem_bytes;
};

}  // namespace paged

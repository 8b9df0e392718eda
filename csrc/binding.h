// The one binding of every C++ backend (cpu, cuda, cuda_emu): tensors -> the kernels/params.h
// structs -> one call of a backend's launchers, and the registration of the contract's ops written
// once for all of them (Ops<Backend>, PAGED_OPS_REGISTER_BACKEND below).
//
// A C++ backend is a folder with its kernels and a backend.cpp that defines its Target (where a call
// runs: its launchers, stream, device facts) and registers itself:
//
//   struct Backend {
//     using Guard = ...;  // constructed from the call's device: c10::cuda::CUDAGuard, or NoGuard
//     static paged::binding::Target target(const at::Device& device);
//   };
//   PAGED_OPS_REGISTER_BACKEND(paged_cuda, CUDA, paged_cuda::Backend)
//
// plus its row in csrc/backends.h. Path of a call: torch.ops.paged.* (csrc/public/dispatch.cpp) ->
// this file -> the Target's launcher (cuda/decode.cu, cuda_emu/kernels_decode.cpp,
// cpu/kernels/attention.cpp, ...) -> the kernel (kernels/*.cuh, cpu/attention.h).
//
// Inputs were validated by the public op (csrc/public) before any of this runs; the backend
// namespaces' own ops trust their caller. Nothing here re-checks contents, and nothing reads the
// environment: the launch configuration is an argument.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <limits>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_variants.h"
#include "inference_only.h"
#include "kernels/launch.h"
#include "kernels/params.h"
#include "kernels/plan.h"
#include "ops.h"

namespace paged {
namespace binding {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Where a call runs: the launchers of one build (addresses of the launcher objects, read at call
// time), its stream, the device's SM count, and how it copies bytes (swap_blocks).
struct Target {
  // Attention, either planned here (kernels/plan.h) and launched through `decode` / `prefill`
  // (the CUDA kernels, on a GPU or the emulator), or, where `attention` is set, one call that plans
  // its own work (the cpu backend; decode when p.cu_seqlens_q is null).
  const DecodeLauncher* decode;
  const PrefillLauncher* prefill;
  void (*attention)(const AttentionParams& p);
  const CacheLaunchers* cache;
  const MergeLauncher* merge;
  const MergeStatesLauncher* merge_states;
  Stream stream;
  int num_sms;
  void (*copy_bytes)(void* dst, const void* src, size_t bytes, Stream stream);
  // The launch configuration of a call that names none: the tuned one for its shape (GPU), or
  // null for the kernels' defaults.
  LaunchConfig (*tuned_config)(const AttentionParams& p, bool decode);
  // The kernels index heads, rows and blocks with int: larger sizes are rejected before a launch
  // (int_size). False: every size is int64 all the way (the cpu backend).
  bool int32_sizes;
  // Blocks a thread-block cluster may have on the device (16 from sm_90: the decode plan's cluster merge,
  // kernels/plan.h plan_cluster_merge); 0: no clusters.
  int max_cluster_size = 0;
};

// An explicit configuration (the test namespace's *_config ops), else the target's choice.
inline LaunchConfig resolve_config(const Target& tgt, const LaunchConfig* cfg, const AttentionParams& p, bool decode) {
  if (cfg) return *cfg;
  return tgt.tuned_config ? tgt.tuned_config(p, decode) : LaunchConfig{};
}

inline DType dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat8_e4m3fn: return DType::E4M3;
    case at::kFloat8_e5m2: return DType::E5M2;
    default: TORCH_CHECK_VALUE(false, "paged_cuda: unsupported dtype ", t);
  }
}

// Sizes the kernels index with int: a larger one is rejected here rather than narrowed.
inline int int_size(int64_t v, const char* what) {
  TORCH_CHECK_VALUE(v >= 0 && v <= INT_MAX, what, "=", v, " does not fit the kernels' 32-bit index");
  return int(v);
}
inline int64_t size_for(const Target& tgt, int64_t v, const char* what) {
  return tgt.int32_sizes ? int_size(v, what) : v;
}

// [threads, partition_size, kv_tile, force_split, tensor_cores]; missing entries are 0 (default).
inline LaunchConfig config_from_list(at::IntArrayRef c) {
  TORCH_CHECK_VALUE(c.size() <= 5, "config: at most 5 entries [threads, partition_size, kv_tile, force_split, "
                                   "tensor_cores], got ", c.size());
  LaunchConfig cfg;
  int* fields[] = {&cfg.threads, &cfg.partition_size, &cfg.kv_tile, &cfg.force_split, &cfg.tensor_cores};
  for (size_t i = 0; i < c.size(); ++i) {
    TORCH_CHECK_VALUE(c[i] >= INT_MIN && c[i] <= INT_MAX, "config[", i, "]=", c[i], " does not fit an int");
    *fields[i] = int(c[i]);
  }
  return cfg;
}

inline const float* scale_ptr(const OptTensor& s) { return s ? s->data_ptr<float>() : nullptr; }

// The cache fields AttentionParams and ReshapeCacheParams share: pointers, strides, fp8 scales (their
// strides: per P, since reshape_and_cache's scales have no sequence dimension).
template <typename P>
void set_cache_fields(const Target& tgt, P& p, const Tensor& key_cache, const Tensor& value_cache,
                      const OptTensor& k_scale, const OptTensor& v_scale) {
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_scale = scale_ptr(k_scale);
  p.v_scale = scale_ptr(v_scale);
  const ScaleStrides ks = scale_strides(k_scale), vs = scale_strides(v_scale);
  if constexpr (std::is_same_v<P, AttentionParams>) {
    p.k_scale_seq_stride = ks.seq_stride;
    p.v_scale_seq_stride = vs.seq_stride;
  }
  p.k_scale_head_stride = ks.head_stride;
  p.v_scale_head_stride = vs.head_stride;
  p.cache_dtype = dtype_code(key_cache.scalar_type());
  if constexpr (std::is_same_v<decltype(p.block_size), int>) {
    p.block_size = int_size(key_cache.size(1), "block_size");  // a 32-bit field on every target
  } else {
    p.block_size = size_for(tgt, key_cache.size(1), "block_size");
  }
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_token = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_token = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
}

inline AttentionParams attention_params(const Target& tgt, const Tensor& out, const Tensor& query,
                                        const Tensor& key_cache, const Tensor& value_cache,
                                        const Tensor& block_tables, const Tensor& seq_lens,
                                        const Tensor* cu_seqlens_q, int64_t max_seqlen_q, double scale, bool causal,
                                        const OptTensor& k_scale, const OptTensor& v_scale,
                                        const AttentionVariants& variants) {
  AttentionParams p{};
  set_cache_fields(tgt, p, key_cache, value_cache, k_scale, v_scale);
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.max_blocks_per_seq = block_tables.size(1);
  p.block_table_stride = block_tables.stride(0);
  p.cu_seqlens_q = cu_seqlens_q ? cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.dtype = dtype_code(query.scalar_type());
  p.num_seqs = seq_lens.size(0);
  p.num_tokens = query.size(0);
  p.num_heads = size_for(tgt, query.size(1), "num_heads");
  p.num_kv_heads = size_for(tgt, key_cache.size(2), "num_kv_heads");
  p.head_size = size_for(tgt, query.size(2), "head_size");
  p.value_head_size = size_for(tgt, value_cache.size(3), "value head_size");
  p.max_seqlen_q = max_seqlen_q;
  p.scale = float(scale);
  p.causal = causal;
  p.num_sms = tgt.num_sms;
  p.max_cluster_size = tgt.max_cluster_size;
  // softcap in float, kept > 0 and finite when it is (validation bounds it; a direct call of a
  // backend namespace does not validate, and inf * tanh(0) would make every score NaN).
  p.softcap = variants.softcap > 0 ? std::clamp(float(variants.softcap), std::numeric_limits<float>::denorm_min(),
                                                std::numeric_limits<float>::max())
                                   : 0.f;
  p.window_left = variants.window_left;
  p.window_right = variants.window_right;
  p.sinks = variants.sinks_ptr();
  p.alibi_slopes = variants.alibi_slopes_ptr();
  p.lse = variants.lse_ptr();
  p.batch_invariant = variants.batch_invariant;
  return p;
}

inline void decode_attention(const Target& tgt, const LaunchConfig* cfg, Tensor& out, const Tensor& query,
                             const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                             const Tensor& seq_lens, double scale, const OptTensor& k_scale, const OptTensor& v_scale,
                             const AttentionVariants& variants) {
  if (query.size(0) == 0) return;
  const AttentionParams p = attention_params(tgt, out, query, key_cache, value_cache, block_tables, seq_lens, nullptr,
                                             1, scale, true, k_scale, v_scale, variants);
  if (tgt.attention) return tgt.attention(p);
  const DecodePlan plan = plan_decode(p, resolve_config(tgt, cfg, p, /*decode=*/true));
  Tensor workspace;
  if (plan.workspace_floats) workspace = at::empty({int64_t(plan.workspace_floats)}, query.options().dtype(at::kFloat));
  (*tgt.decode)(p, plan, plan.workspace_floats ? workspace.data_ptr<float>() : nullptr, tgt.stream);
}

inline void prefill_attention(const Target& tgt, const LaunchConfig* cfg, Tensor& out, const Tensor& query,
                              const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                              const Tensor& cu_seqlens_q, const Tensor& seq_lens, int64_t max_seqlen_q, double scale,
                              bool causal, const OptTensor& k_scale, const OptTensor& v_scale,
                              const AttentionVariants& variants) {
  if (query.size(0) == 0 || seq_lens.size(0) == 0) return;  // no query row: nothing to write
  const AttentionParams p = attention_params(tgt, out, query, key_cache, value_cache, block_tables, seq_lens,
                                             &cu_seqlens_q, max_seqlen_q, scale, causal, k_scale, v_scale, variants);
  if (tgt.attention) return tgt.attention(p);
  if (p.batch_invariant) {
    // Every row through the decode kernel (kernels/decode.cuh "Rows"): a causal row at position p
    // computes exactly what a decode of seq_len p + 1 does, so chunked prefill and decode give the
    // same bits. The kernel finds each row's sequence in cu_seqlens_q itself: no host sync.
    const DecodePlan plan = plan_decode(p, LaunchConfig{});
    Tensor workspace = at::empty({int64_t(plan.workspace_floats)}, query.options().dtype(at::kFloat));
    (*tgt.decode)(p, plan, workspace.data_ptr<float>(), tgt.stream);
    return;
  }
  (*tgt.prefill)(p, plan_prefill(p, resolve_config(tgt, cfg, p, /*decode=*/false)), tgt.stream);
}

// Rows [num_tokens, num_heads, head_size] by strides; vector loads when every row start allows.
inline void merge_attention_states(const Target& tgt, Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                                   const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse) {
  if (out.size(0) == 0 || out.size(1) == 0) return;
  MergeParams p{};
  p.out = out.data_ptr();
  p.out_lse = out_lse ? out_lse->data_ptr<float>() : nullptr;
  p.prefix_out = prefix_out.data_ptr();
  p.prefix_lse = prefix_lse.data_ptr<float>();
  p.suffix_out = suffix_out.data_ptr();
  p.suffix_lse = suffix_lse.data_ptr<float>();
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.prefix_stride_token = prefix_out.stride(0);
  p.prefix_stride_head = prefix_out.stride(1);
  p.suffix_stride_token = suffix_out.stride(0);
  p.suffix_stride_head = suffix_out.stride(1);
  p.dtype = dtype_code(out.scalar_type());
  p.num_tokens = out.size(0);
  p.num_heads = int_size(out.size(1), "num_heads");
  p.head_size = int_size(out.size(2), "head_size");
  p.aligned = p.head_size % 8 == 0 && chunk_aligned(p.out, p.dtype, {p.o_stride_token, p.o_stride_head}) &&
              chunk_aligned(p.prefix_out, p.dtype, {p.prefix_stride_token, p.prefix_stride_head}) &&
              chunk_aligned(p.suffix_out, p.dtype, {p.suffix_stride_token, p.suffix_stride_head});
  p.max_blocks = std::max(tgt.num_sms, 1) * 8;
  (*tgt.merge)(p, tgt.stream);
}

// states [num_tokens, num_states, num_heads, head_size] and their lses [num_tokens, num_states,
// num_heads] by any strides (last dim of states contiguous); vector loads when every row allows.
inline void merge_states(const Target& tgt, Tensor& out, const OptTensor& out_lse, const Tensor& states,
                         const Tensor& states_lse) {
  if (out.size(0) == 0 || out.size(1) == 0) return;
  MergeStatesParams p{};
  p.out = out.data_ptr();
  p.out_lse = out_lse ? out_lse->data_ptr<float>() : nullptr;
  p.states = states.data_ptr();
  p.states_lse = states_lse.data_ptr<float>();
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.s_stride_token = states.stride(0);
  p.s_stride_state = states.stride(1);
  p.s_stride_head = states.stride(2);
  p.lse_stride_token = states_lse.stride(0);
  p.lse_stride_state = states_lse.stride(1);
  p.lse_stride_head = states_lse.stride(2);
  p.dtype = dtype_code(out.scalar_type());
  p.num_tokens = out.size(0);
  p.num_states = states.size(1);
  p.num_heads = int_size(out.size(1), "num_heads");
  p.head_size = int_size(out.size(2), "head_size");
  p.aligned = p.head_size % 8 == 0 && chunk_aligned(p.out, p.dtype, {p.o_stride_token, p.o_stride_head}) &&
              chunk_aligned(p.states, p.dtype, {p.s_stride_token, p.s_stride_state, p.s_stride_head});
  p.max_blocks = std::max(tgt.num_sms, 1) * 8;
  (*tgt.merge_states)(p, tgt.stream);
}

inline void reshape_and_cache(const Target& tgt, const Tensor& key, const Tensor& value, Tensor& key_cache,
                              Tensor& value_cache, const Tensor& slot_mapping, const OptTensor& k_scale,
                              const OptTensor& v_scale) {
  if (key.size(0) == 0) return;
  ReshapeCacheParams p{};
  set_cache_fields(tgt, p, key_cache, value_cache, k_scale, v_scale);
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.dtype = dtype_code(key.scalar_type());
  p.num_tokens = key.size(0);
  p.num_kv_heads = int_size(key.size(1), "num_kv_heads");
  p.head_size = int_size(key.size(2), "head_size");
  p.value_head_size = int_size(value.size(2), "value head_size");
  p.key_stride_token = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_token = value.stride(0);
  p.value_stride_head = value.stride(1);
  tgt.cache->reshape_and_cache(p, tgt.stream);
}

inline Fp8Params fp8_params(const Target& tgt, Tensor& out, const Tensor& input, const Tensor& scale) {
  return Fp8Params{out.data_ptr(), input.data_ptr(), scale.data_ptr<float>(), dtype_code(out.scalar_type()),
                   dtype_code(input.scalar_type()), input.numel(), std::max(tgt.num_sms, 1) * 8};
}
inline void quantize_fp8(const Target& tgt, Tensor& out, const Tensor& input, const Tensor& scale) {
  if (input.numel()) tgt.cache->quantize_fp8(fp8_params(tgt, out, input, scale), tgt.stream);
}
inline void dequantize_fp8(const Target& tgt, Tensor& out, const Tensor& input, const Tensor& scale) {
  if (input.numel()) tgt.cache->dequantize_fp8(fp8_params(tgt, out, input, scale), tgt.stream);
}

inline CacheDesc cache_desc(const Tensor& c) {
  CacheDesc d{};
  d.ptr = reinterpret_cast<int64_t>(c.data_ptr());
  d.stride_block = c.stride(0);
  d.stride_token = c.stride(1);
  d.stride_head = c.stride(2);
  d.block_size = int_size(c.size(1), "block_size");
  d.num_heads = int_size(c.size(2), "num_kv_heads");
  d.head_size = int_size(c.size(3), "head_size");
  d.elem_bytes = int32_t(c.element_size());
  return d;
}

// The device copy of a set of caches' descriptors, built once per set (key: the descriptors' own
// bytes, so a cache freed and reallocated elsewhere is a new set): a per-call host -> device upload
// would be a copy out of a pinned buffer that a captured CUDA graph replays after the buffer was
// reused, and a descriptor table that changes with nothing. Bounded: the oldest set goes first.
inline std::atomic<int64_t>& descriptor_tables_built() {
  static std::atomic<int64_t> n{0};
  return n;
}
inline Tensor descriptor_table(const std::vector<CacheDesc>& descs, const at::Device& dev) {
  static std::mutex mutex;
  static std::vector<std::tuple<at::Device, std::string, Tensor>> tables;  // oldest first
  constexpr size_t kMaxTables = 16;
  std::string key(reinterpret_cast<const char*>(descs.data()), descs.size() * sizeof(CacheDesc));
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [d, k, table] : tables)
    if (d == dev && k == key) return table;
  // Host -> GPU through pinned memory with a non_blocking copy: ordered on the stream, no sync
  // (torch's pinned allocator keeps the buffer alive until its copy has run).
  const bool to_gpu = dev.is_cuda();
  Tensor host = at::empty({int64_t(key.size())}, at::TensorOptions(at::kByte).pinned_memory(to_gpu));
  std::memcpy(host.data_ptr(), key.data(), key.size());
  Tensor table = host.to(dev, /*non_blocking=*/true);
  if (tables.size() == kMaxTables) tables.erase(tables.begin());
  tables.emplace_back(dev, std::move(key), table);
  ++descriptor_tables_built();
  return table;
}

// All layers in one launch, reading the caches' descriptors from descriptor_table.
inline void copy_blocks(const Target& tgt, at::TensorList key_caches, at::TensorList value_caches,
                        const Tensor& block_mapping) {
  if (block_mapping.size(0) == 0 || key_caches.empty()) return;
  std::vector<CacheDesc> descs;
  for (const Tensor& c : key_caches) descs.push_back(cache_desc(c));
  for (const Tensor& c : value_caches) descs.push_back(cache_desc(c));
  TORCH_CHECK_VALUE(int64_t(descs.size()) <= kMaxGridYZ, "copy_blocks: too many caches (", descs.size(), ")");
  const at::Device dev = key_caches[0].device();
  const bool to_gpu = dev.is_cuda();
  const Tensor on_dev = descriptor_table(descs, dev);
  // A host mapping (the contract allows one) is uploaded per call: pass a device mapping to
  // capture copy_blocks in a CUDA graph.
  Tensor mapping = block_mapping.contiguous();
  if (mapping.device() != dev) {
    if (to_gpu && mapping.is_cpu() && !mapping.is_pinned()) mapping = mapping.pin_memory();
    mapping = mapping.to(dev, /*non_blocking=*/true);
  }
  tgt.cache->copy_blocks(reinterpret_cast<const CacheDesc*>(on_dev.data_ptr()), int(descs.size()),
                         mapping.data_ptr<int64_t>(), mapping.size(0), tgt.stream);
}

// Ordered on the target's stream, not complete on return (paged_ops/reference.py swap_blocks): one
// asynchronous copy per block when a block is one dense byte range laid out alike in src and dst
// (NHD or HND, contiguous caches), else a strided non-blocking torch copy of that block. No sync:
// block_mapping is a CPU tensor (validated), read on the host.
inline void swap_blocks(const Target& tgt, const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const int64_t n = block_mapping.size(0);
  if (n == 0) return;
  const Tensor pairs = block_mapping.contiguous();
  const int64_t* m = pairs.data_ptr<int64_t>();
  const bool dense = src.strides().slice(1) == dst.strides().slice(1) && src[0].is_non_overlapping_and_dense();
  const size_t bytes = size_t(src[0].numel()) * src.element_size();
  for (int64_t i = 0; i < n; ++i) {
    if (dense) {
      const char* s = static_cast<const char*>(src.data_ptr()) + m[2 * i] * src.stride(0) * src.element_size();
      char* d = static_cast<char*>(dst.data_ptr()) + m[2 * i + 1] * dst.stride(0) * dst.element_size();
      tgt.copy_bytes(d, s, bytes, tgt.stream);
    } else {
      dst[m[2 * i + 1]].copy_(src[m[2 * i]], /*non_blocking=*/true);
    }
  }
}

}  // namespace binding
}  // namespace paged

// ---- the one registration of the ops ------------------------------------------------------------
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
  // The latent and its RoPE part are reshape_and_cache's key and value (one KV head each), stored
  // into the two column ranges of the same cache rows: one launch.
  static void concat_and_cache_mla(const Tensor& latent, const Tensor& rope, Tensor& latent_cache,
                                   const Tensor& slot_mapping, const OptTensor& scale) {
    const int64_t rank = latent.size(1);
    Tensor latent_part = latent_cache.narrow(3, 0, rank), rope_part = latent_cache.narrow(3, rank, rope.size(1));
    reshape_and_cache(latent.unsqueeze(1), rope.unsqueeze(1), latent_part, rope_part, slot_mapping, scale, scale);
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
    m.impl("concat_and_cache_mla", &concat_and_cache_mla);
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

#define PAGED_OPS_REGISTER_BACKEND(ns, key, Backend)                                    \
  TORCH_LIBRARY(ns, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }                                 \
  TORCH_LIBRARY_IMPL(ns, key, m) { ::paged::registration::Ops<Backend>::impl(m); }      \
  TORCH_LIBRARY_IMPL(ns, Autograd, m) { PAGED_OPS_IMPL_INFERENCE_ONLY(m); }

// config = [threads, partition_size, kv_tile, force_split, tensor_cores] ([] = the defaults).
#define PAGED_OPS_REGISTER_TEST_OPS(ns, key, Backend)                                \
  TORCH_LIBRARY(ns, m) { ::paged::registration::Ops<Backend>::define_test_ops(m); }  \
  TORCH_LIBRARY_IMPL(ns, key, m) { ::paged::registration::Ops<Backend>::impl_test_ops(m); }

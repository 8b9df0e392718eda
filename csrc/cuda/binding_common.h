// Tensor -> raw-pointer glue shared by the two hosts of the CUDA kernels: the real GPU backend
// (csrc/cuda/ops.cpp, namespace paged_cuda) and the CPU emulator (csrc/cuda_emu/ops.cpp, namespace
// paged_cuda_emu). Each op body is written once here, templated on a `Backend` that says how to
// launch (GPU stream launchers or emulated launches) and how to move bytes.
//
// Inputs are validated in Python (paged_ops/_validate.py) before any of this runs, so nothing here
// re-checks contents; it only reads shapes, strides and dtypes.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels/params.h"

namespace paged_cuda {
namespace binding {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kFloat8_e4m3fn: return 3;
    case at::kFloat8_e5m2: return 4;
    default: TORCH_CHECK(false, "paged_cuda: unsupported dtype ", t);
  }
}

// PAGED_CUDA_CONFIG="threads=128,partition=64,kv_tile=32,force_split=1,tc=-1" overrides the launch
// configuration of the attention kernels (tests force the split-KV path with it; the tuner times
// candidates with it). Read at every call: it is a handful of characters.
inline LaunchConfig config_from_env(const char* var = "PAGED_CUDA_CONFIG") {
  LaunchConfig c;
  const char* s = std::getenv(var);
  if (!s) return c;
  std::string str(s);
  size_t pos = 0;
  while (pos < str.size()) {
    size_t end = str.find(',', pos);
    if (end == std::string::npos) end = str.size();
    const std::string item = str.substr(pos, end - pos);
    const size_t eq = item.find('=');
    if (eq != std::string::npos) {
      const std::string k = item.substr(0, eq);
      const int v = std::atoi(item.c_str() + eq + 1);
      if (k == "threads") c.threads = v;
      else if (k == "partition") c.partition_size = v;
      else if (k == "kv_tile") c.kv_tile = v;
      else if (k == "force_split") c.force_split = v;
      else if (k == "tc") c.tensor_cores = v;
      else TORCH_CHECK(false, "PAGED_CUDA_CONFIG: unknown key '", k, "'");
    }
    pos = end + 1;
  }
  return c;
}

inline const float* scale_ptr(const OptTensor& s) { return s ? s->data_ptr<float>() : nullptr; }
inline int per_head(const OptTensor& s) { return s && s->numel() > 1 ? 1 : 0; }

// The cache fields AttentionParams and ReshapeCacheParams share: pointers, strides, fp8 scales.
template <typename P>
void set_cache_fields(P& p, const Tensor& key_cache, const Tensor& value_cache, const OptTensor& k_scale,
                      const OptTensor& v_scale) {
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_scale = scale_ptr(k_scale);
  p.v_scale = scale_ptr(v_scale);
  p.k_scale_per_head = per_head(k_scale);
  p.v_scale_per_head = per_head(v_scale);
  p.cache_dtype = dtype_code(key_cache.scalar_type());
  p.block_size = int(key_cache.size(1));
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_tok = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
}

inline AttentionParams attention_params(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                                        const Tensor& value_cache, const Tensor& block_tables,
                                        const Tensor& seq_lens, const Tensor* cu_seqlens_q, int64_t max_seqlen_q,
                                        double scale, bool causal, const OptTensor& k_scale,
                                        const OptTensor& v_scale) {
  AttentionParams p{};
  set_cache_fields(p, key_cache, value_cache, k_scale, v_scale);
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.cu_seqlens_q = cu_seqlens_q ? cu_seqlens_q->data_ptr<int32_t>() : nullptr;
  p.dtype = dtype_code(query.scalar_type());
  p.num_seqs = int(seq_lens.size(0));
  p.num_heads = int(query.size(1));
  p.num_kv_heads = int(key_cache.size(2));
  p.head_size = int(query.size(2));
  p.max_blocks_per_seq = int(block_tables.size(1));
  p.max_seqlen_q = int(max_seqlen_q);
  p.q_stride_tok = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_tok = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.bt_stride = block_tables.stride(0);
  p.scale = float(scale);
  p.causal = causal;
  return p;
}

template <class B>
void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, double scale, const OptTensor& k_scale,
                      const OptTensor& v_scale) {
  AttentionParams p = attention_params(out, query, key_cache, value_cache, block_tables, seq_lens, nullptr, 1, scale,
                                       true, k_scale, v_scale);
  p.num_sms = B::num_sms(query);
  const LaunchConfig cfg = B::config(p, /*decode=*/true);
  const size_t ws = B::decode_workspace_floats(p, cfg);
  Tensor workspace;
  if (ws) workspace = at::empty({int64_t(ws)}, query.options().dtype(at::kFloat));
  B::decode(p, cfg, ws ? workspace.data_ptr<float>() : nullptr);
}

template <class B>
void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                       int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                       const OptTensor& v_scale) {
  AttentionParams p = attention_params(out, query, key_cache, value_cache, block_tables, seq_lens, &cu_seqlens_q,
                                       max_seqlen_q, scale, causal, k_scale, v_scale);
  p.num_sms = B::num_sms(query);
  if (max_seqlen_q <= 0) return;  // every sequence has q_len 0: nothing to write
  B::prefill(p, B::config(p, /*decode=*/false));
}

template <class B>
void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
  ReshapeCacheParams p{};
  set_cache_fields(p, key_cache, value_cache, k_scale, v_scale);
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.dtype = dtype_code(key.scalar_type());
  p.num_tokens = int(key.size(0));
  p.num_kv_heads = int(key.size(1));
  p.head_size = int(key.size(2));
  p.key_stride_tok = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_tok = value.stride(0);
  p.value_stride_head = value.stride(1);
  if (p.num_tokens == 0) return;
  B::reshape_and_cache(p);
}

template <class B>
void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  if (input.numel() == 0) return;
  B::quantize(out.data_ptr(), dtype_code(out.scalar_type()), input.data_ptr(), dtype_code(input.scalar_type()),
              scale.data_ptr<float>(), input.numel(), B::num_sms(input) * 8);
}

template <class B>
void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  if (input.numel() == 0) return;
  B::dequantize(out.data_ptr(), dtype_code(out.scalar_type()), input.data_ptr(), dtype_code(input.scalar_type()),
                scale.data_ptr<float>(), input.numel(), B::num_sms(input) * 8);
}

inline CacheDesc cache_desc(const Tensor& c) {
  CacheDesc d{};
  d.ptr = reinterpret_cast<int64_t>(c.data_ptr());
  d.stride_block = c.stride(0);
  d.stride_tok = c.stride(1);
  d.stride_head = c.stride(2);
  d.block_size = int32_t(c.size(1));
  d.num_heads = int32_t(c.size(2));
  d.head_size = int32_t(c.size(3));
  d.elem_bytes = int32_t(c.element_size());
  return d;
}

// All layers in one launch: the per-cache descriptors travel to the device in one small copy.
template <class B>
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
  if (block_mapping.size(0) == 0) return;
  std::vector<CacheDesc> descs;
  for (const Tensor& c : key_caches) descs.push_back(cache_desc(c));
  for (const Tensor& c : value_caches) descs.push_back(cache_desc(c));
  const at::Device dev = key_caches[0].device();
  Tensor host = at::empty({int64_t(descs.size() * sizeof(CacheDesc))}, at::kByte);
  std::memcpy(host.data_ptr(), descs.data(), descs.size() * sizeof(CacheDesc));
  Tensor on_dev = host.to(dev, /*non_blocking=*/false);
  Tensor mapping = block_mapping.to(dev).contiguous();
  B::copy_blocks(reinterpret_cast<const CacheDesc*>(on_dev.data_ptr()), int(descs.size()),
                 mapping.data_ptr<int64_t>(), int(mapping.size(0)));
}

// One memcpy per block when a block is one dense byte range laid out alike in src and dst (NHD or
// HND, contiguous caches); otherwise a strided torch copy of that block.
template <class B>
void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const int64_t n = block_mapping.size(0);
  if (n == 0) return;
  const Tensor pairs = block_mapping.cpu().contiguous();
  const int64_t* m = pairs.data_ptr<int64_t>();
  const bool dense = src.strides().slice(1) == dst.strides().slice(1) && src[0].is_non_overlapping_and_dense();
  const size_t bytes = size_t(src[0].numel()) * src.element_size();
  for (int64_t i = 0; i < n; ++i) {
    if (dense) {
      const char* s = static_cast<const char*>(src.data_ptr()) + m[2 * i] * src.stride(0) * src.element_size();
      char* d = static_cast<char*>(dst.data_ptr()) + m[2 * i + 1] * dst.stride(0) * dst.element_size();
      B::memcpy(d, s, bytes, src.device(), dst.device());
    } else {
      dst[m[2 * i + 1]].copy_(src[m[2 * i]], /*non_blocking=*/true);
    }
  }
  B::after_swap(src.device(), dst.device());
}

}  // namespace binding
}  // namespace paged_cuda

// Backend `cuda`: registers the GPU kernels as torch.ops.paged_cuda.* (CUDA dispatch key). Each op
// sets the device guard and names its target (launcher tables, current stream, SM count, tuned
// launch configuration); csrc/cuda/binding.h does the rest. Test-only ops (an explicit launch
// configuration) are in the separate namespace paged_cuda_test.
// c10/cuda only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers a minimal toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "cuda/binding.h"
#include "cuda/tuning.h"
#include "ops.h"

namespace paged_cuda {
namespace {

namespace B = paged::binding;
using at::Tensor;
using B::OptTensor;

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "paged_cuda: ", what, ": ", cudaGetErrorString(e));
}

int num_sms(int device) {
  static std::array<std::atomic<int>, 64> cached{};  // 0 = not asked yet
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cached[device] : nullptr;
  if (slot && slot->load(std::memory_order_relaxed)) return slot->load(std::memory_order_relaxed);
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (slot) slot->store(n, std::memory_order_relaxed);
  return n;
}

// Any direction (host<->device, device<->device): unified addressing lets cudaMemcpyDefault infer
// it. Asynchronous on the stream when the host side is pinned.
void copy_bytes(void* dst, const void* src, size_t bytes, paged::Stream stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
}

B::Target target(const at::Device& device) {
  const int index = device.index() >= 0 ? device.index() : c10::cuda::current_device();
  return B::Target{&paged::kCudaDecode, &paged::kCudaPrefill, &paged::kCudaCache,
                   c10::cuda::getCurrentCUDAStream(index).stream(), num_sms(index), copy_bytes, tuning::tuned_config,
                   &paged::kCudaMerge, &paged::kCudaMergeStates};
}

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, const OptTensor& k_scale, const OptTensor& v_scale) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  B::reshape_and_cache(target(key_cache.device()), key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}
void decode_attention_with(const paged::LaunchConfig* cfg, Tensor& out, const Tensor& query, const Tensor& key_cache,
                           const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens, double scale,
                           const OptTensor& k_scale, const OptTensor& v_scale, const paged::AttentionVariants& variants) {
  const c10::cuda::CUDAGuard guard(query.device());
  B::decode_attention(target(query.device()), cfg, out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                      k_scale, v_scale, variants);
}
void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& seq_lens, double scale, const OptTensor& k_scale,
                      const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  decode_attention_with(nullptr, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                        paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void prefill_attention_with(const paged::LaunchConfig* cfg, Tensor& out, const Tensor& query, const Tensor& key_cache,
                            const Tensor& value_cache, const Tensor& block_tables, const Tensor& cu_seqlens_q,
                            const Tensor& seq_lens, int64_t max_seqlen_q, double scale, bool causal,
                            const OptTensor& k_scale, const OptTensor& v_scale, const paged::AttentionVariants& variants) {
  const c10::cuda::CUDAGuard guard(query.device());
  B::prefill_attention(target(query.device()), cfg, out, query, key_cache, value_cache, block_tables, cu_seqlens_q,
                       seq_lens, max_seqlen_q, scale, causal, k_scale, v_scale, variants);
}
void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                       int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                       const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  prefill_attention_with(nullptr, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                         max_seqlen_q, scale, causal, k_scale, v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out, const Tensor& prefix_lse,
                            const Tensor& suffix_out, const Tensor& suffix_lse) {
  const c10::cuda::CUDAGuard guard(out.device());
  B::merge_attention_states(target(out.device()), out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
}
void merge_states(Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse) {
  const c10::cuda::CUDAGuard guard(out.device());
  B::merge_states(target(out.device()), out, out_lse, states, states_lse);
}
void quantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  B::quantize_fp8(target(input.device()), out, input, scale);
}
void dequantize_fp8(Tensor& out, const Tensor& input, const Tensor& scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  B::dequantize_fp8(target(input.device()), out, input, scale);
}
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
  if (key_caches.empty()) return;
  const c10::cuda::CUDAGuard guard(key_caches[0].device());
  B::copy_blocks(target(key_caches[0].device()), key_caches, value_caches, block_mapping);
}
// src or dst may be on the CPU (pinned, for the copy to be asynchronous): the op is dispatched on
// whichever is the CUDA tensor, and ordered on that device's current stream.
void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  B::swap_blocks(target(device), src, dst, block_mapping);
}

// ---- test namespace: the same kernels with an explicit launch configuration ----------------------
void decode_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, double scale,
                             const OptTensor& k_scale, const OptTensor& v_scale, at::IntArrayRef config,
                             PAGED_OPS_VARIANT_PARAMS) {
  const paged::LaunchConfig cfg = B::config_from_list(config);
  decode_attention_with(&cfg, out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                        paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}
void prefill_attention_config(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                              int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                              const OptTensor& v_scale, at::IntArrayRef config, PAGED_OPS_VARIANT_PARAMS) {
  const paged::LaunchConfig cfg = B::config_from_list(config);
  prefill_attention_with(&cfg, out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                         scale, causal, k_scale, v_scale, paged::attention_variants(PAGED_OPS_VARIANT_ARGS));
}

}  // namespace
}  // namespace paged_cuda

TORCH_LIBRARY(paged_cuda, m) {
  PAGED_OPS_DEFINE_SCHEMAS(m);
  paged_cuda::tuning::define_ops(m);  // the tuning store's hooks (paged_ops/tuning.py)
}

TORCH_LIBRARY_IMPL(paged_cuda, CUDA, m) {
  m.impl("reshape_and_cache", &paged_cuda::reshape_and_cache);
  m.impl("decode_attention", &paged_cuda::decode_attention);
  m.impl("prefill_attention", &paged_cuda::prefill_attention);
  m.impl("merge_attention_states", &paged_cuda::merge_attention_states);
  m.impl("merge_states", &paged_cuda::merge_states);
  m.impl("quantize_fp8", &paged_cuda::quantize_fp8);
  m.impl("dequantize_fp8", &paged_cuda::dequantize_fp8);
  m.impl("copy_blocks", &paged_cuda::copy_blocks);
  m.impl("swap_blocks", &paged_cuda::swap_blocks);
}

// Test-only (tests, the tuner): config = [threads, partition_size, kv_tile, force_split,
// tensor_cores], kernels/params.h LaunchConfig; no validation of the tensors.
TORCH_LIBRARY(paged_cuda_test, m) {
  m.def("decode_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
        PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
  m.def("prefill_attention_config(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
        "Tensor? k_scale, Tensor? v_scale, int[] config, " PAGED_OPS_SCHEMA_ATTENTION_VARIANTS ") -> ()");
}

TORCH_LIBRARY_IMPL(paged_cuda_test, CUDA, m) {
  m.impl("decode_attention_config", &paged_cuda::decode_attention_config);
  m.impl("prefill_attention_config", &paged_cuda::prefill_attention_config);
}

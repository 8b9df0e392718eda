// Backend `cuda`: torch bindings of the GPU kernels (launchers in csrc/cuda/*.cu). Tensors become raw
// pointers and strides here; the kernels run on the current CUDA stream of the tensors' device.
// c10/cuda only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers a minimal toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/binding_common.h"
#include "cuda/launchers.h"
#include "cuda/tuning.h"
#include "ops.h"

namespace paged_cuda {
namespace {
namespace L = launchers;

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "paged_cuda: ", what, ": ", cudaGetErrorString(e));
}

struct CudaBackend {
  static int num_sms(const at::Tensor& t) {
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, t.get_device()), "cudaDeviceGetAttribute");
    return n;
  }
  // The tuned configuration for this shape if one was recorded (paged_ops/cuda_tuning.py), else
  // the kernels' defaults; PAGED_CUDA_CONFIG overrides both (the tuner times candidates with it).
  static LaunchConfig config(const AttentionParams& p, bool decode) {
    if (std::getenv("PAGED_CUDA_CONFIG")) return binding::config_from_env();
    return tuning::lookup(tuning::shape_key(p, decode));
  }
  static size_t decode_workspace_floats(const AttentionParams& p, const LaunchConfig& c) {
    return L::decode_workspace_floats(p, c);
  }
  static void decode(const AttentionParams& p, const LaunchConfig& c, float* ws) {
    L::decode_attention(p, c, ws, stream());
  }
  static void prefill(const AttentionParams& p, const LaunchConfig& c) { L::prefill_attention(p, c, stream()); }
  static void reshape_and_cache(const ReshapeCacheParams& p) { L::reshape_and_cache(p, stream()); }
  static void quantize(void* o, int od, const void* i, int id, const float* s, int64_t n, int mb) {
    L::quantize_fp8(o, od, i, id, s, n, mb, stream());
  }
  static void dequantize(void* o, int od, const void* i, int id, const float* s, int64_t n, int mb) {
    L::dequantize_fp8(o, od, i, id, s, n, mb, stream());
  }
  static void copy_blocks(const CacheDesc* c, int nc, const int64_t* m, int np) { L::copy_blocks(c, nc, m, np, stream()); }
  // Any direction (host<->device, device<->device): unified addressing lets cudaMemcpyDefault infer it.
  static void memcpy(void* d, const void* s, size_t n, at::Device, at::Device) {
    check(cudaMemcpyAsync(d, s, n, cudaMemcpyDefault, stream()), "cudaMemcpyAsync");
  }
  static void after_swap(at::Device, at::Device) {}
};

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, const binding::OptTensor& k_scale,
                       const binding::OptTensor& v_scale) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  binding::reshape_and_cache<CudaBackend>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      double scale, const binding::OptTensor& k_scale, const binding::OptTensor& v_scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  binding::decode_attention<CudaBackend>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale,
                                         v_scale);
}
void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                       const at::Tensor& seq_lens, int64_t max_seqlen_q, double scale, bool causal,
                       const binding::OptTensor& k_scale, const binding::OptTensor& v_scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  binding::prefill_attention<CudaBackend>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                          max_seqlen_q, scale, causal, k_scale, v_scale);
}
void quantize_fp8(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  binding::quantize_fp8<CudaBackend>(out, input, scale);
}
void dequantize_fp8(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(input.device());
  binding::dequantize_fp8<CudaBackend>(out, input, scale);
}
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  const c10::cuda::CUDAGuard guard(key_caches[0].device());
  binding::copy_blocks<CudaBackend>(key_caches, value_caches, block_mapping);
}
// src or dst may be on the CPU: the op is dispatched on whichever is the CUDA tensor.
void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  binding::swap_blocks<CudaBackend>(src, dst, block_mapping);
}

}  // namespace
}  // namespace paged_cuda

TORCH_LIBRARY(paged_cuda, m) {
  PAGED_OPS_DEFINE_SCHEMAS(m);
  // Launch tuning (paged_ops/cuda_tuning.py): the key a call of this shape looks up, recording a
  // tuned config for a key, and reading back what a key resolves to.
  m.def("tuning_key(Tensor query, Tensor key_cache, Tensor block_tables, int max_seqlen_q, bool decode) -> str",
        &paged_cuda::tuning::key_for_tensors);
  m.def("set_tuned_config(str key, int threads, int partition_size, int kv_tile, int tensor_cores=0) -> ()",
        &paged_cuda::tuning::set_config);
  m.def("tuned_config(str key) -> int[]", &paged_cuda::tuning::get_config);
}

TORCH_LIBRARY_IMPL(paged_cuda, CUDA, m) {
  m.impl("reshape_and_cache", &paged_cuda::reshape_and_cache);
  m.impl("decode_attention", &paged_cuda::decode_attention);
  m.impl("prefill_attention", &paged_cuda::prefill_attention);
  m.impl("quantize_fp8", &paged_cuda::quantize_fp8);
  m.impl("dequantize_fp8", &paged_cuda::dequantize_fp8);
  m.impl("copy_blocks", &paged_cuda::copy_blocks);
  m.impl("swap_blocks", &paged_cuda::swap_blocks);
}

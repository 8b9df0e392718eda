// KV-cache maintenance kernels: reshape_and_cache (with fused fp8 quantisation) and per-tensor fp8
// quantize / dequantize. copy_blocks is in copy_blocks.cuh (a non-template kernel: one TU only).
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"

namespace PAGED_KERNEL_NS {
namespace cache {

// One block per token; a thread moves one 8-element chunk of one head (16-byte loads/stores for
// 16-bit types), for K and V. Negative slots are padding tokens and are skipped.
template <typename T, typename C>
__global__ void __launch_bounds__(256) reshape_and_cache_kernel(ReshapeCacheParams p, bool aligned) {
  const int t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t blk = slot / p.block_size, off = slot % p.block_size;
  const int chunks = p.head_size / 8;
  for (int i = threadIdx.x; i < p.num_kv_heads * chunks; i += blockDim.x) {
    const int h = i / chunks, d = (i % chunks) * 8;
    float x[8];
    load8(static_cast<const T*>(p.key) + t * p.key_stride_tok + h * p.key_stride_head + d, x, aligned);
    const float ks = cache_scale(p.k_scale, p.k_scale_per_head, h);
    store8(static_cast<C*>(p.key_cache) + blk * p.k_stride_block + off * p.k_stride_tok + h * p.k_stride_head + d, x,
           aligned, ks);
    load8(static_cast<const T*>(p.value) + t * p.value_stride_tok + h * p.value_stride_head + d, x, aligned);
    const float vs = cache_scale(p.v_scale, p.v_scale_per_head, h);
    store8(static_cast<C*>(p.value_cache) + blk * p.v_stride_block + off * p.v_stride_tok + h * p.v_stride_head + d,
           x, aligned, vs);
  }
}

inline void launch_reshape_and_cache(const ReshapeCacheParams& p, cudaStream_t stream) {
  dispatch_float(DType(p.dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto ct) {
      using C = typename decltype(ct)::type;
      // One flag for all four tensors: the common case (contiguous tensors) is aligned everywhere.
      const bool aligned =
          chunk_aligned<T>(p.key, {p.key_stride_tok, p.key_stride_head}) &&
          chunk_aligned<T>(p.value, {p.value_stride_tok, p.value_stride_head}) &&
          chunk_aligned<C>(p.key_cache, {p.k_stride_block, p.k_stride_tok, p.k_stride_head}) &&
          chunk_aligned<C>(p.value_cache, {p.v_stride_block, p.v_stride_tok, p.v_stride_head});
      const int work = p.num_kv_heads * (p.head_size / 8);
      const int threads = work >= 256 ? 256 : ((work + 31) / 32) * 32;
      auto kernel = reshape_and_cache_kernel<T, C>;
      PAGED_LAUNCH(kernel, dim3(p.num_tokens), dim3(threads), 0, stream, p, aligned);
      PAGED_CHECK_LAUNCH("reshape_and_cache_kernel");
    });
  });
}

// Elementwise fp8 <-> float over contiguous tensors: grid-stride loop over 8-element chunks, then a
// scalar tail (numel need not be a multiple of 8 here).
template <typename T, typename F8>
__global__ void __launch_bounds__(256) quantize_kernel(F8* out, const T* in, const float* scale, int64_t n,
                                                        bool aligned) {
  const float s = *scale;
  const int64_t chunks = n / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    float x[8];
    load8(in + c * 8, x, aligned);
    store8(out + c * 8, x, aligned, s);
  }
  for (int64_t i = chunks * 8 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = quantize_fp8<F8>(to_float(in[i]), s);
}

template <typename T, typename F8>
__global__ void __launch_bounds__(256) dequantize_kernel(T* out, const F8* in, const float* scale, int64_t n,
                                                          bool aligned) {
  const float s = *scale;
  const int64_t chunks = n / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    float x[8];
    load8(in + c * 8, x, aligned, s);  // fp8 -> float is exact; the product rounds once in fp32
    store8(out + c * 8, x, aligned);
  }
  for (int64_t i = chunks * 8 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = from_float<T>(to_float(in[i]) * s);
}

inline dim3 elementwise_grid(int64_t n, int max_blocks) {
  const int64_t want = (n / 8 + 255) / 256;
  return dim3(unsigned(want < 1 ? 1 : (want > max_blocks ? max_blocks : want)));
}

inline void launch_quantize(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                            int max_blocks, cudaStream_t stream) {
  dispatch_float(DType(in_dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_fp8(DType(out_dtype), [&](auto ft) {
      using F8 = typename decltype(ft)::type;
      const bool aligned = chunk_aligned<T>(in, {}) && chunk_aligned<F8>(out, {});
      auto kernel = quantize_kernel<T, F8>;
      PAGED_LAUNCH(kernel, elementwise_grid(n, max_blocks), dim3(256), 0, stream, static_cast<F8*>(out),
                   static_cast<const T*>(in), scale, n, aligned);
      PAGED_CHECK_LAUNCH("quantize_kernel");
    });
  });
}

inline void launch_dequantize(void* out, int out_dtype, const void* in, int in_dtype, const float* scale, int64_t n,
                              int max_blocks, cudaStream_t stream) {
  dispatch_float(DType(out_dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_fp8(DType(in_dtype), [&](auto ft) {
      using F8 = typename decltype(ft)::type;
      const bool aligned = chunk_aligned<T>(out, {}) && chunk_aligned<F8>(in, {});
      auto kernel = dequantize_kernel<T, F8>;
      PAGED_LAUNCH(kernel, elementwise_grid(n, max_blocks), dim3(256), 0, stream, static_cast<T*>(out),
                   static_cast<const F8*>(in), scale, n, aligned);
      PAGED_CHECK_LAUNCH("dequantize_kernel");
    });
  });
}

}  // namespace cache
}  // namespace PAGED_KERNEL_NS

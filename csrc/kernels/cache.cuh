// KV-cache maintenance kernels and their launchers, in one place (as vLLM's cache_kernels.cu):
// reshape_and_cache (with fused fp8 quantisation), per-tensor fp8 quantize / dequantize, and
// copy_blocks over all layers in one launch. Included by one translation unit per build
// (csrc/cuda/cache_kernels.cu, csrc/cuda_emu/kernels_cache.cpp): copy_blocks_kernel is not a
// template.
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"
#include "kernels/plan.h"

namespace PAGED_KERNEL_NS {
namespace cache {

// One block per token (grid-stride over tokens past the grid's x limit); a thread moves one
// 8-element chunk of one head (16-byte loads/stores for 16-bit types), of K, then of V (whose head
// size may differ: MLA's latent and RoPE part). Negative slots are padding tokens and are skipped.
template <typename T, typename C>
__global__ void __launch_bounds__(256) reshape_and_cache_kernel(ReshapeCacheParams p, bool aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  const int k_chunks = p.head_size / 8, v_chunks = p.value_head_size / 8;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;  // block-uniform: no barrier in this kernel anyway
    for (int i = threadIdx.x; i < p.num_kv_heads * k_chunks; i += blockDim.x) {
      const int h = i / k_chunks, d = (i % k_chunks) * 8;
      float x[8];
      load8(static_cast<const T*>(p.key) + t * p.key_stride_token + h * p.key_stride_head + d, x, aligned);
      store8(slot_row<C>(p.key_cache, slot, p.block_size, p.k_stride_block, p.k_stride_token, p.k_stride_head, h) + d,
             x, aligned, cache_scale(p.k_scale, 0, p.k_scale_head_stride, 0, h));
    }
    for (int i = threadIdx.x; i < p.num_kv_heads * v_chunks; i += blockDim.x) {
      const int h = i / v_chunks, d = (i % v_chunks) * 8;
      float x[8];
      load8(static_cast<const T*>(p.value) + t * p.value_stride_token + h * p.value_stride_head + d, x, aligned);
      store8(slot_row<C>(p.value_cache, slot, p.block_size, p.v_stride_block, p.v_stride_token, p.v_stride_head, h) +
                 d,
             x, aligned, cache_scale(p.v_scale, 0, p.v_scale_head_stride, 0, h));
    }
  }
}

inline void launch_reshape_and_cache(const ReshapeCacheParams& p, Stream stream) {
  dispatch_float(p.dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(p.dtype, p.cache_dtype, [&](auto ct) {
      using C = typename decltype(ct)::type;
      // One flag for all four tensors: the common case (contiguous tensors) is aligned everywhere.
      const bool aligned = chunk_aligned(p.key, p.dtype, {p.key_stride_token, p.key_stride_head}) &&
                           chunk_aligned(p.value, p.dtype, {p.value_stride_token, p.value_stride_head}) &&
                           chunk_aligned(p.key_cache, p.cache_dtype, {p.k_stride_block, p.k_stride_token, p.k_stride_head}) &&
                           chunk_aligned(p.value_cache, p.cache_dtype, {p.v_stride_block, p.v_stride_token, p.v_stride_head});
      const int widest = p.head_size > p.value_head_size ? p.head_size : p.value_head_size;
      const int work = p.num_kv_heads * (widest / 8);
      const int threads = work >= 256 ? 256 : ((work + 31) / 32) * 32;
      const int64_t blocks = p.num_tokens < kMaxGridX ? p.num_tokens : kMaxGridX;
      auto kernel = reshape_and_cache_kernel<T, C>;
      PAGED_LAUNCH(kernel, dim3(unsigned(blocks)), dim3(threads), 0, stream, p, aligned);
      PAGED_CHECK_LAUNCH("reshape_and_cache_kernel");
    });
  });
}

// Elementwise fp8 <-> float over contiguous tensors: grid-stride loop over 8-element chunks, then a
// scalar tail (numel need not be a multiple of 8 here).
template <typename T, typename F8>
__global__ void __launch_bounds__(256) quantize_kernel(F8* out, const T* in, const float* scale, int64_t n,
                                                        bool aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
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
  PAGED_LAUNCH_BOUNDS_CHECK(256);
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

inline void launch_quantize(const Fp8Params& p, Stream stream) {
  dispatch_float(p.input_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_fp8(p.out_dtype, [&](auto ft) {
      using F8 = typename decltype(ft)::type;
      const bool aligned = chunk_aligned(p.input, p.input_dtype, {}) && chunk_aligned(p.out, p.out_dtype, {});
      auto kernel = quantize_kernel<T, F8>;
      PAGED_LAUNCH(kernel, elementwise_grid(p.n, p.max_blocks), dim3(256), 0, stream, static_cast<F8*>(p.out),
                   static_cast<const T*>(p.input), p.scale, p.n, aligned);
      PAGED_CHECK_LAUNCH("quantize_kernel");
    });
  });
}

inline void launch_dequantize(const Fp8Params& p, Stream stream) {
  dispatch_float(p.out_dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_fp8(p.input_dtype, [&](auto ft) {
      using F8 = typename decltype(ft)::type;
      const bool aligned = chunk_aligned(p.out, p.out_dtype, {}) && chunk_aligned(p.input, p.input_dtype, {});
      auto kernel = dequantize_kernel<T, F8>;
      PAGED_LAUNCH(kernel, elementwise_grid(p.n, p.max_blocks), dim3(256), 0, stream, static_cast<T*>(p.out),
                   static_cast<const F8*>(p.input), p.scale, p.n, aligned);
      PAGED_CHECK_LAUNCH("dequantize_kernel");
    });
  });
}

// copy_blocks: grid (pair, cache). Block (pair, cache) copies block src -> dst of one cache tensor
// (every layer's K and V caches are entries of `caches`, a device array), row by row: a row is one
// (token, head) = head_size contiguous elements, whatever the cache's layout. Rows are copied in
// 16-byte words when the row's byte length and addresses allow it. Pairs past the grid's x limit
// are walked with a grid stride.
__global__ void __launch_bounds__(256) copy_blocks_kernel(const CacheDesc* caches, const int64_t* mapping,
                                                          int64_t num_pairs) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  const CacheDesc c = caches[blockIdx.y];
  char* base = reinterpret_cast<char*>(c.ptr);
  const int64_t eb = c.elem_bytes;
  const int row_bytes = c.head_size * c.elem_bytes;
  const int rows = c.block_size * c.num_heads;
  const bool vec = row_bytes % 16 == 0 && c.ptr % 16 == 0 && (c.stride_block * eb) % 16 == 0 &&
                   (c.stride_token * eb) % 16 == 0 && (c.stride_head * eb) % 16 == 0;
  const int words = vec ? row_bytes / 16 : row_bytes;
  for (int64_t pair = blockIdx.x; pair < num_pairs; pair += gridDim.x) {
    const int64_t src = mapping[2 * pair], dst = mapping[2 * pair + 1];
    for (int64_t i = threadIdx.x; i < int64_t(rows) * words; i += blockDim.x) {
      const int r = int(i / words), w = int(i % words);
      const int64_t tok = r / c.num_heads, h = r % c.num_heads;
      const int64_t row_off = (tok * c.stride_token + h * c.stride_head) * eb;
      const char* s = base + src * c.stride_block * eb + row_off;
      char* d = base + dst * c.stride_block * eb + row_off;
      if (vec)
        reinterpret_cast<uint4*>(d)[w] = reinterpret_cast<const uint4*>(s)[w];
      else
        d[w] = s[w];
    }
  }
}

inline void launch_copy_blocks(const CacheDesc* caches_dev, int num_caches, const int64_t* mapping_dev,
                               int64_t num_pairs, Stream stream) {
  const int64_t blocks = num_pairs < kMaxGridX ? num_pairs : kMaxGridX;
  PAGED_LAUNCH(copy_blocks_kernel, dim3(unsigned(blocks), unsigned(num_caches)), dim3(256), 0, stream, caches_dev,
               mapping_dev, num_pairs);
  PAGED_CHECK_LAUNCH("copy_blocks_kernel");
}

}  // namespace cache
}  // namespace PAGED_KERNEL_NS

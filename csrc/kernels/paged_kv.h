// Paged KV addressing, in one place: how a token position becomes a cache row (through the
// block table), and which vector widths a cache view allows.
//
// Host part (any compiler, no CUDA): alignment decisions the launch plan takes once per call.
// Device part (nvcc, or the emulator; compiled once kernels/common.cuh has set up the kernels' namespace):
// PagedKV, the paged_kv_t of the kernels: a (sequence, KV head) view of one cache whose row(t) is
// the address of token t's head_size elements. All offsets are int64: block id x block stride and
// head x head stride pass 2^31 elements in a large cache.
// Included twice by design (host part, then device part): guarded per part, not with pragma once.
#ifndef PAGED_KV_HOST_PART
#define PAGED_KV_HOST_PART
#include <cstdint>
#include <initializer_list>

#include "attention_rules.h"  // PAGED_HOST_DEVICE
#include "kernels/params.h"

namespace paged {

// n / d and n % d for 0 <= n < 2^31 and a divisor 1 <= d < 2^31 fixed for a launch (the block size,
// the GQA group): a multiply and a shift instead of a division's ~20 instructions, and for a
// power-of-two d the same as n >> log2 d. With 2^(s-1) < d <= 2^s and mul = ceil(2^(31+s) / d),
// floor(n mul / 2^(31+s)) = floor(n / d) for every n < 2^31 (the error mul d - 2^(31+s) is below
// d <= 2^s: Granlund & Montgomery's round-up method). mul < 2^32, but held in 64 bits: a 32-bit mul
// moved the pipelined prefill's register allocation the wrong way (stack 80 -> 88 B and spill loads
// in its interior tile at <bf16, 128, 128> on sm_90). Plain data: the decode plan makes it on the host.
struct FastDivmod {
  int d, shift;
  uint64_t mul;
  FastDivmod() = default;
  PAGED_HOST_DEVICE explicit FastDivmod(int divisor) : d(divisor), shift(0) {
    while ((1u << shift) < unsigned(d)) ++shift;
    mul = ((uint64_t(1) << (31 + shift)) + uint64_t(d) - 1) / uint64_t(d);
  }
  PAGED_HOST_DEVICE int div(int n) const { return int((uint64_t(n) * mul) >> (31 + shift)); }
  PAGED_HOST_DEVICE int mod(int n) const { return n - div(n) * d; }
};

// True when base + k * stride is a multiple of `bytes` for every k (and every listed stride).
inline bool aligned_to(const void* base, int elem_bytes, std::initializer_list<int64_t> strides, int bytes) {
  if (reinterpret_cast<uintptr_t>(base) % bytes) return false;
  for (int64_t s : strides)
    if ((s * elem_bytes) % bytes) return false;
  return true;
}

// The kernels move rows in 8-element chunks (head_size is a multiple of 8): one 16-byte vector for
// 16-bit types, 8 bytes for fp8, 2 x 16 for fp32. A view whose base or strides break that falls
// back to element loads instead of faulting.
inline bool chunk_aligned(const void* base, DType dtype, std::initializer_list<int64_t> strides) {
  return aligned_to(base, dtype_bytes(dtype), strides, 8 * dtype_bytes(dtype));
}
inline bool key_cache_aligned(const AttentionParams& p) {
  return chunk_aligned(p.key_cache, p.cache_dtype, {p.k_stride_block, p.k_stride_token, p.k_stride_head});
}
inline bool value_cache_aligned(const AttentionParams& p) {
  return chunk_aligned(p.value_cache, p.cache_dtype, {p.v_stride_block, p.v_stride_token, p.v_stride_head});
}

// The widest asynchronous copy (16 bytes down to 1) every K/V row start and row length allows.
inline int widest_row_copy(const AttentionParams& p) {
  const int elem = dtype_bytes(p.cache_dtype);
  int u = 16;
  while (u > 1 &&
         !(int64_t(p.head_size) * elem % u == 0 &&
           aligned_to(p.key_cache, elem, {p.k_stride_block, p.k_stride_token, p.k_stride_head}, u) &&
           aligned_to(p.value_cache, elem, {p.v_stride_block, p.v_stride_token, p.v_stride_head}, u)))
    u >>= 1;
  return u;
}

// widest_row_copy for caches of two head sizes (keys head_size, values value_head_size): every K and
// V row start and both row lengths.
inline int widest_kv_row_copy(const AttentionParams& p) {
  const int elem = dtype_bytes(p.cache_dtype);
  int u = 16;
  while (u > 1 &&
         !(int64_t(p.head_size) * elem % u == 0 && int64_t(p.value_head_size) * elem % u == 0 &&
           aligned_to(p.key_cache, elem, {p.k_stride_block, p.k_stride_token, p.k_stride_head}, u) &&
           aligned_to(p.value_cache, elem, {p.v_stride_block, p.v_stride_token, p.v_stride_head}, u)))
    u >>= 1;
  return u;
}

}  // namespace paged
#endif  // PAGED_KV_HOST_PART

#if defined(PAGED_KERNELS_COMMON) && !defined(PAGED_KV_DEVICE_PART)  // after kernels/common.cuh
#define PAGED_KV_DEVICE_PART
namespace PAGED_KERNEL_NS {

// One sequence's view of one KV head of a paged cache of element type KV.
template <typename KV>
struct PagedKV {
  const KV* base;               // cache + kv_head * stride_head
  const int32_t* block_table;   // the sequence's row of the block table
  int64_t stride_block, stride_token;
  int block_size;

  // Token t's head_size elements (t < seq_len: callers never address a slot past the sequence).
  __device__ __forceinline__ const KV* row(int t) const {
    const int64_t blk = block_table[t / block_size], off = t % block_size;
    return base + blk * stride_block + off * stride_token;
  }
};

template <typename KV>
__device__ __forceinline__ PagedKV<KV> paged_k(const AttentionParams& p, int64_t seq, int kv_head) {
  return {static_cast<const KV*>(p.key_cache) + kv_head * p.k_stride_head, p.block_tables + seq * p.block_table_stride,
          p.k_stride_block, p.k_stride_token, int(p.block_size)};
}
template <typename KV>
__device__ __forceinline__ PagedKV<KV> paged_v(const AttentionParams& p, int64_t seq, int kv_head) {
  return {static_cast<const KV*>(p.value_cache) + kv_head * p.v_stride_head, p.block_tables + seq * p.block_table_stride,
          p.v_stride_block, p.v_stride_token, int(p.block_size)};
}

// The row a write to `slot` (block id x block_size + offset, reshape_and_cache's slot_mapping)
// lands in, for KV head `head`.
template <typename C>
__device__ __forceinline__ C* slot_row(void* cache, int64_t slot, int block_size, int64_t stride_block,
                                       int64_t stride_token, int64_t stride_head, int head) {
  const int64_t blk = slot / block_size, off = slot % block_size;
  return static_cast<C*>(cache) + blk * stride_block + off * stride_token + head * stride_head;
}

}  // namespace PAGED_KERNEL_NS
#endif  // PAGED_KV_DEVICE_PART

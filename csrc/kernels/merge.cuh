// merge_attention_states: attention over two disjoint key sets from attention over each (cascade /
// shared-prefix attention, split contexts), as paged_ops/reference.py defines it:
//   out = (e^a prefix_out + e^b suffix_out) / (e^a + e^b),  out_lse = ln(e^a + e^b)
// with a, b the two rows' log-sum-exps, computed relative to max(a, b) so nothing overflows.
//
// Work split. Memory bound (two rows read, one written, no reuse), so one thread owns one 8-element
// chunk of one (token, head) row and a grid-stride loop covers them all: consecutive threads take
// consecutive chunks of a row, and a warp's loads are whole lines. Each thread recomputes its row's
// two weights from the two lses (two loads every thread of the row shares through L1, two exps)
// rather than staging them: cheaper than a barrier. Chunks are one 16-byte vector (16-bit types) or
// two (fp32) when every row start allows it (MergeParams::aligned, decided once by the binding), else
// element loads; a head size that is not a multiple of 8 ends in a partial chunk of element loads.
//
// NaN/inf, as the reference: a side with lse -inf contributes nothing, not even its out (attention
// over no keys may leave that NaN, and 0 * NaN would be NaN); both -inf give out 0 and lse -inf
// (attention over no keys at all); a +inf or NaN lse makes the row NaN.
//
// merge_states is the same merge over N states per row (FlashInfer's merge_states): the thread of a
// chunk walks the row's states twice, for the max of their lses, then for the weighted sum
// (states at -inf never read), in state order.
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"

#include <algorithm>
#include <cmath>

namespace PAGED_KERNEL_NS {
namespace merge {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) merge_kernel(MergeParams p) {
  PAGED_LAUNCH_BOUNDS_CHECK(kThreads);
  const int D = p.head_size;
  // head_size 0 still has lses to write: one (empty) chunk per row.
  const int chunks = D > 0 ? (D + 7) / 8 : 1;
  const int64_t total = p.num_tokens * p.num_heads * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks;  // token * num_heads + head: the lses' index (contiguous)
    const int d0 = int(i - row * chunks) * 8;
    const int64_t tok = row / p.num_heads;
    const int head = int(row - tok * p.num_heads);
    const float a = p.prefix_lse[row], b = p.suffix_lse[row];
    // fmaxf drops a NaN operand, but the NaN then reaches its own weight: exp(NaN - m) = NaN.
    float m = fmaxf(a, b);
    const bool none = m == -INFINITY;  // both -inf: out 0 (nothing to weigh), ln 0 = -inf
    if (none) m = 0.f;
    const float wa = expf(a - m), wb = expf(b - m);
    const float total_w = wa + wb;
    const bool use_a = a != -INFINITY, use_b = b != -INFINITY;  // a side at -inf: its out is not read
    const float inv = none ? 0.f : 1.f / total_w;
    if (d0 == 0 && p.out_lse) p.out_lse[row] = m + logf(total_w);
    if (d0 >= D) continue;
    const T* po = static_cast<const T*>(p.prefix_out) + tok * p.prefix_stride_token + head * p.prefix_stride_head + d0;
    const T* so = static_cast<const T*>(p.suffix_out) + tok * p.suffix_stride_token + head * p.suffix_stride_head + d0;
    T* o = static_cast<T*>(p.out) + tok * p.o_stride_token + head * p.o_stride_head + d0;
    if (d0 + 8 <= D) {
      float x[8] = {}, y[8] = {}, r[8];
      if (use_a) load8(po, x, p.aligned);
      if (use_b) load8(so, y, p.aligned);
#pragma unroll
      for (int k = 0; k < 8; ++k) r[k] = ((use_a ? wa * x[k] : 0.f) + (use_b ? wb * y[k] : 0.f)) * inv;
      store8(o, r, p.aligned);
    } else {
      for (int k = 0; k < D - d0; ++k) {
        const float x = use_a ? wa * to_float(po[k]) : 0.f, y = use_b ? wb * to_float(so[k]) : 0.f;
        o[k] = from_float<T>((x + y) * inv);
      }
    }
  }
}

// One thread per 8-element chunk of one (token, head) row, grid-stride, as merge_kernel.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_states_kernel(MergeStatesParams p) {
  PAGED_LAUNCH_BOUNDS_CHECK(kThreads);
  const int D = p.head_size;
  const int chunks = D > 0 ? (D + 7) / 8 : 1;  // head_size 0: the lse still written
  const int64_t total = p.num_tokens * p.num_heads * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks;  // token * num_heads + head: out_lse's index (contiguous)
    const int d0 = int(i - row * chunks) * 8;
    const int64_t tok = row / p.num_heads;
    const int head = int(row - tok * p.num_heads);
    const float* lse = p.states_lse + tok * p.lse_stride_token + head * p.lse_stride_head;
    // fmaxf drops a NaN lse, but the NaN then reaches its own weight: exp(NaN - m) = NaN.
    float m = -INFINITY;
    for (int64_t k = 0; k < p.num_states; ++k) m = fmaxf(m, lse[k * p.lse_stride_state]);
    const bool none = m == -INFINITY;  // no state, or every one at -inf: out 0, lse -inf
    if (none) m = 0.f;
    const T* st = static_cast<const T*>(p.states) + tok * p.s_stride_token + head * p.s_stride_head + d0;
    const int n = d0 + 8 <= D ? 8 : D - d0;  // < 8: the row's partial last chunk (or none)
    float acc[8] = {}, total_w = 0.f;
    for (int64_t k = 0; k < p.num_states; ++k) {
      const float a = lse[k * p.lse_stride_state];
      const float w = expf(a - m);
      total_w += w;
      if (a == -INFINITY || n <= 0) continue;  // a state at -inf: its out is not read
      float x[8] = {};
      if (n == 8) {
        load8(st + k * p.s_stride_state, x, p.aligned);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)  // constant indices: x and acc stay in registers
          if (e < n) x[e] = to_float(st[k * p.s_stride_state + e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += w * x[e];
    }
    if (d0 == 0 && p.out_lse) p.out_lse[row] = m + logf(total_w);
    if (n <= 0) continue;
    const float inv = none ? 0.f : 1.f / total_w;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= inv;
    T* o = static_cast<T*>(p.out) + tok * p.o_stride_token + head * p.o_stride_head + d0;
    if (n == 8) {
      store8(o, acc, p.aligned);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (e < n) o[e] = from_float<T>(acc[e]);
    }
  }
}

inline void launch_states(const MergeStatesParams& p, Stream stream) {
  const int64_t chunks = p.head_size > 0 ? (p.head_size + 7) / 8 : 1;
  const int64_t total = p.num_tokens * p.num_heads * chunks;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, std::max(p.max_blocks, 1));
  dispatch_float(p.dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    PAGED_LAUNCH(merge_states_kernel<T>, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, p);
    PAGED_CHECK_LAUNCH("merge_states_kernel");
  });
}

inline void launch(const MergeParams& p, Stream stream) {
  const int64_t chunks = p.head_size > 0 ? (p.head_size + 7) / 8 : 1;
  const int64_t total = p.num_tokens * p.num_heads * chunks;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, std::max(p.max_blocks, 1));
  dispatch_float(p.dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    PAGED_LAUNCH(merge_kernel<T>, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, p);
    PAGED_CHECK_LAUNCH("merge_kernel");
  });
}

}  // namespace merge
}  // namespace PAGED_KERNEL_NS

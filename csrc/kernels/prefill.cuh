// Varlen paged prefill attention (flash-attention style, CUDA cores).
//
// Rows are "packed GQA": the block for (sequence, KV head, row tile) owns BM consecutive rows of
// the sequence's q_len x group (query position, query head) matrix, so each K/V tile loaded into
// shared memory serves every query head of the group. Bottom-right causal masking: query i of a
// sequence with q_len queries and seq_len cached tokens sees KV 0 .. seq_len - q_len + i; q_len = 1
// rows (decode rows in a mixed batch) and cached context (seq_len > q_len) need nothing special.
//
// Per KV tile of BN tokens: K -> smem (dequantised to float, zero past the last visible token so
// NaN slots are never read), S = Q K^T with the mask applied as -inf, online softmax per row (one
// thread per row), V -> smem (same buffer), O = O * alpha + P V with each thread owning head_size / 8
// output elements of one row. The K/V tile rows are padded by one float so threads reading
// different tokens at the same dimension hit different banks.
//
// This is the CUDA-core path; it is what the emulator runs and the reference the GPU suite compares
// any tensor-core variant with.
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"

#include <algorithm>
#include <cmath>

namespace PAGED_KERNEL_NS {
namespace prefill {

constexpr int kMaxChunksPerThread = 32;  // head_size 256 / 8 threads per row

template <typename T, typename KV>
__global__ void __launch_bounds__(256) prefill_kernel(AttentionParams p, int row_tiles, int BN, bool k_aligned,
                                                       bool v_aligned) {
  const int nt = blockDim.x;
  const int BM = nt / 8;
  const int seq = blockIdx.x / row_tiles, rt = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int q0 = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q0;
  const int group = p.num_heads / p.num_kv_heads;
  const int row0 = rt * BM;
  if (row0 >= q_len * group) return;  // block-uniform exit
  const int seq_len = p.seq_lens[seq];
  const int D = p.head_size, ld = D + 1, nchunks = D / 8;
  const int nrows = min(BM, q_len * group - row0);
  const int qi_max = (row0 + nrows - 1) / group;
  const int kv_end = p.causal ? seq_len - q_len + qi_max + 1 : seq_len;

  PAGED_DYNAMIC_SMEM(float, sm, size_t(BM) * D + size_t(BN) * ld + size_t(BM) * BN + 3 * BM);
  float* Qs = sm;
  float* KVs = Qs + BM * D;
  float* S = KVs + BN * ld;
  float* rm = S + BM * BN;
  float* rl = rm + BM;
  float* ra = rl + BM;

  const float qmul = p.scale * kLog2e;
  for (int e = threadIdx.x; e < BM * D; e += nt) {
    const int r = e / D, d = e % D;
    float x = 0.f;
    if (r < nrows) {
      const int qi = (row0 + r) / group, g = (row0 + r) % group;
      x = to_float(static_cast<const T*>(p.query)[(q0 + qi) * p.q_stride_tok + (kvh * group + g) * p.q_stride_head + d]) *
          qmul;
    }
    Qs[e] = x;
  }
  if (threadIdx.x < BM) {
    rm[threadIdx.x] = -INFINITY;
    rl[threadIdx.x] = 0.f;
  }
  const int myr = threadIdx.x / 8, myc = threadIdx.x % 8;
  float acc[kMaxChunksPerThread];
#pragma unroll
  for (int k = 0; k < kMaxChunksPerThread; ++k) acc[k] = 0.f;

  const float kscale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kvh : 0] : 1.f;
  const float vscale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kvh : 0] : 1.f;
  const KV* kc = static_cast<const KV*>(p.key_cache) + kvh * p.k_stride_head;
  const KV* vc = static_cast<const KV*>(p.value_cache) + kvh * p.v_stride_head;
  const int32_t* bt = p.block_tables + seq * p.bt_stride;
  __syncthreads();

  for (int kv0 = 0; kv0 < kv_end; kv0 += BN) {
    // K tile; rows past kv_end are zeros, never loads.
    for (int e = threadIdx.x; e < BN * nchunks; e += nt) {
      const int j = e / nchunks, c = (e % nchunks) * 8, t = kv0 + j;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
      if (t < kv_end) {
        const int64_t blk = bt[t / p.block_size], off = t % p.block_size;
        load8(kc + blk * p.k_stride_block + off * p.k_stride_tok + c, x, k_aligned, kscale);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) KVs[j * ld + c + i] = x[i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < BM * BN; e += nt) {
      const int r = e / BN, j = e % BN, t = kv0 + j;
      const int lim = r < nrows ? (p.causal ? seq_len - q_len + (row0 + r) / group + 1 : seq_len) : 0;
      float s = -INFINITY;
      if (t < lim) {
        s = 0.f;
        const float* qr = Qs + r * D;
        const float* kr = KVs + j * ld;
        for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
      }
      S[e] = s;
    }
    __syncthreads();
    // V tile into the same buffer, while the first BM threads do the softmax bookkeeping.
    for (int e = threadIdx.x; e < BN * nchunks; e += nt) {
      const int j = e / nchunks, c = (e % nchunks) * 8, t = kv0 + j;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
      if (t < kv_end) {
        const int64_t blk = bt[t / p.block_size], off = t % p.block_size;
        load8(vc + blk * p.v_stride_block + off * p.v_stride_tok + c, x, v_aligned, vscale);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) KVs[j * ld + c + i] = x[i];
    }
    if (threadIdx.x < BM) {
      const int r = threadIdx.x;
      float* sr = S + r * BN;
      float mx = rm[r];
      for (int j = 0; j < BN; ++j) mx = fmaxf(mx, sr[j]);
      if (mx == -INFINITY) {  // nothing visible yet in this row (or a padding row)
        for (int j = 0; j < BN; ++j) sr[j] = 0.f;
        ra[r] = 1.f;
      } else {
        const float a = exp2f(rm[r] - mx);
        float sum = 0.f;
        for (int j = 0; j < BN; ++j) {
          const float pr = sr[j] == -INFINITY ? 0.f : exp2f(sr[j] - mx);
          sr[j] = pr;
          sum += pr;
        }
        rl[r] = rl[r] * a + sum;
        rm[r] = mx;
        ra[r] = a;
      }
    }
    __syncthreads();
    {
      const float a = ra[myr];
      const float* pr = S + myr * BN;
#pragma unroll
      for (int k = 0; k < kMaxChunksPerThread; ++k) {
        if (k < nchunks) {
          const int d = myc + 8 * k;
          float sum = 0.f;
          for (int j = 0; j < BN; ++j) sum += pr[j] * KVs[j * ld + d];
          acc[k] = acc[k] * a + sum;
        }
      }
    }
    __syncthreads();
  }

  if (myr < nrows) {
    const int qi = (row0 + myr) / group, g = (row0 + myr) % group;
    const float inv = rl[myr] > 0.f ? 1.f / rl[myr] : 0.f;
    T* o = static_cast<T*>(p.out) + (q0 + qi) * p.o_stride_tok + (kvh * group + g) * p.o_stride_head;
#pragma unroll
    for (int k = 0; k < kMaxChunksPerThread; ++k)
      if (k < nchunks) o[myc + 8 * k] = from_float<T>(acc[k] * inv);
  }
}

struct Plan {
  int threads, kv_tile, row_tiles;
  size_t smem;
};

inline Plan plan(const AttentionParams& p, const LaunchConfig& cfg) {
  Plan pl{};
  pl.threads = cfg.threads > 0 ? cfg.threads : 128;
  pl.kv_tile = cfg.kv_tile > 0 ? cfg.kv_tile : 32;
  const int BM = pl.threads / 8;
  const int group = p.num_heads / p.num_kv_heads;
  pl.row_tiles = std::max(1, (std::max(p.max_seqlen_q, 1) * group + BM - 1) / BM);
  pl.smem = (size_t(BM) * p.head_size + size_t(pl.kv_tile) * (p.head_size + 1) + size_t(BM) * pl.kv_tile + 3 * BM) *
            sizeof(float);
  return pl;
}

inline void launch(const AttentionParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const Plan pl = plan(p, cfg);
  if (pl.threads % 32 || pl.threads < 64 || pl.threads > 256)
    throw std::runtime_error("paged_cuda: prefill threads must be 64, 96, ..., 256");
  dispatch_float(DType(p.dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto kt) {
      using KV = typename decltype(kt)::type;
      const bool ka = chunk_aligned<KV>(p.key_cache, {p.k_stride_block, p.k_stride_tok, p.k_stride_head});
      const bool va = chunk_aligned<KV>(p.value_cache, {p.v_stride_block, p.v_stride_tok, p.v_stride_head});
      auto kernel = prefill_kernel<T, KV>;
      PAGED_ALLOW_SMEM(kernel, pl.smem);
      PAGED_LAUNCH(kernel, dim3(unsigned(int64_t(pl.row_tiles) * p.num_seqs), p.num_kv_heads), dim3(pl.threads),
                   pl.smem, stream, p, pl.row_tiles, pl.kv_tile, ka, va);
      PAGED_CHECK_LAUNCH("prefill_kernel");
    });
  });
}

}  // namespace prefill
}  // namespace PAGED_KERNEL_NS

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
#include "kernels/mma.cuh"
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

  const float kscale = cache_scale(p.k_scale, p.k_scale_per_head, kvh);
  const float vscale = cache_scale(p.v_scale, p.v_scale_per_head, kvh);
  const KV* kc = static_cast<const KV*>(p.key_cache) + kvh * p.k_stride_head;
  const KV* vc = static_cast<const KV*>(p.value_cache) + kvh * p.v_stride_head;
  const int32_t* bt = p.block_tables + seq * p.bt_stride;
  // One K or V tile of BN tokens into KVs as float; rows past kv_end are zeros, never loads.
  auto stage = [&](const KV* cache, int64_t stride_block, int64_t stride_tok, bool aligned, float mul, int kv0) {
    for (int e = threadIdx.x; e < BN * nchunks; e += nt) {
      const int j = e / nchunks, c = (e % nchunks) * 8, t = kv0 + j;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.f;
      if (t < kv_end) {
        const int64_t blk = bt[t / p.block_size], off = t % p.block_size;
        load8(cache + blk * stride_block + off * stride_tok + c, x, aligned, mul);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) KVs[j * ld + c + i] = x[i];
    }
  };
  __syncthreads();

  for (int kv0 = 0; kv0 < kv_end; kv0 += BN) {
    stage(kc, p.k_stride_block, p.k_stride_tok, k_aligned, kscale, kv0);  // K tile
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
    stage(vc, p.v_stride_block, p.v_stride_tok, v_aligned, vscale, kv0);
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

// ---- tensor-core path (fp16 / bf16 queries) ------------------------------------------------------
// FlashAttention-2 structure on mma.sync m16n8k16 (kernels/mma.cuh): 4 warps, each owning 16 packed
// rows of a 64-row tile; per KV tile of 32 tokens, S = Q K^T (fp32 accumulators), the mask and the
// online softmax on the accumulator fragments (a row's values live in the 4 lanes of one quad:
// two xor-shuffles reduce them), then P is re-packed from the S accumulators straight into A
// fragments (no shared-memory round trip) and O += P V. Q/K/V sit in shared memory as the query's
// 16-bit type (fp8 K/V dequantised once per tile), rows padded by 8 elements so the fragment loads
// of a warp hit 32 different banks. head_size is rounded up to 16 with zero columns for the k-steps.
// Rounding P to 16 bits before P V is the usual flash-attention trade (error ~2^-9 relative for
// bf16); fp32 queries keep the CUDA-core kernel.
namespace PAGED_KERNEL_NS {
namespace prefill {

constexpr int kTcRows = 64, kTcKv = 32, kTcThreads = 128;

template <typename T, typename KV, int DMAX>
__global__ void __launch_bounds__(128) prefill_tc_kernel(AttentionParams p, int row_tiles, bool k_aligned,
                                                          bool v_aligned) {
  constexpr int BM = kTcRows, BN = kTcKv;
  constexpr int NT_O = DMAX / 8, KS_MAX = DMAX / 16, NT_S = BN / 8;
  const int seq = blockIdx.x / row_tiles, rt = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int q0 = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q0;
  const int group = p.num_heads / p.num_kv_heads;
  const int row0 = rt * BM;
  if (row0 >= q_len * group) return;  // block-uniform exit
  const int seq_len = p.seq_lens[seq];
  const int D = p.head_size, Dp = (D + 15) / 16 * 16, ld = Dp + 8;
  const int nrows = min(BM, q_len * group - row0);
  const int qi_max = (row0 + nrows - 1) / group;
  const int kv_end = p.causal ? seq_len - q_len + qi_max + 1 : seq_len;

  PAGED_DYNAMIC_SMEM(T, sm, size_t(BM + 2 * BN) * ld);
  T* Qs = sm;
  T* Ks = Qs + BM * ld;
  T* Vs = Ks + BN * ld;
  const T zero = from_float<T>(0.f);
  for (int e = threadIdx.x; e < BM * Dp; e += kTcThreads) {
    const int r = e / Dp, d = e % Dp;
    T x = zero;
    if (r < nrows && d < D) {
      const int qi = (row0 + r) / group, g = (row0 + r) % group;
      x = static_cast<const T*>(p.query)[(q0 + qi) * p.q_stride_tok + (kvh * group + g) * p.q_stride_head + d];
    }
    Qs[r * ld + d] = x;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    lim[h] = r < nrows ? (p.causal ? seq_len - q_len + (row0 + r) / group + 1 : seq_len) : 0;
  }
  float o[NT_O][4];
#pragma unroll
  for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const float kscale = cache_scale(p.k_scale, p.k_scale_per_head, kvh);
  const float vscale = cache_scale(p.v_scale, p.v_scale_per_head, kvh);
  const KV* kc = static_cast<const KV*>(p.key_cache) + kvh * p.k_stride_head;
  const KV* vc = static_cast<const KV*>(p.value_cache) + kvh * p.v_stride_head;
  const int32_t* bt = p.block_tables + seq * p.bt_stride;
  const int cpr = Dp / 8;  // 8-element chunks per padded row

  for (int kv0 = 0; kv0 < kv_end; kv0 += BN) {
    __syncthreads();  // the previous tile's K/V (and, first time, nothing) are no longer read
    for (int e = threadIdx.x; e < BN * cpr; e += kTcThreads) {
      const int j = e / cpr, c = (e % cpr) * 8, tok = kv0 + j;
      float x[8], y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = y[i] = 0.f;
      if (tok < kv_end && c < D) {  // never touch slots past the last visible token (may be NaN)
        const int64_t blk = bt[tok / p.block_size], off = tok % p.block_size;
        load8(kc + blk * p.k_stride_block + off * p.k_stride_tok + c, x, k_aligned, kscale);
        load8(vc + blk * p.v_stride_block + off * p.v_stride_tok + c, y, v_aligned, vscale);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        Ks[j * ld + c + i] = from_float<T>(x[i]);
        Vs[j * ld + c + i] = from_float<T>(y[i]);
      }
    }
    __syncthreads();

    float s[NT_S][4];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS_MAX; ++ks) {
      if (ks * 16 < Dp) {
        uint32_t a[4];
        load_a_frag(a, Qs, ld, warp * 16, ks * 16);
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
          uint32_t b[2];
          load_b_frag_nk(b, Ks, ld, nt * 8, ks * 16);
          mma_16816<T>(s[nt], a, b);
        }
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int tok = kv0 + nt * 8 + 2 * t + (i % 2);
        const float v = tok < lim[i / 2] ? s[nt][i] * sl2 : -INFINITY;
        s[nt][i] = v;
        mx[i / 2] = fmaxf(mx[i / 2], v);
      }
    }
    float alpha[2], rs[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);
      alpha[h] = mn == -INFINITY ? 1.f : exp2f(m[h] - mn);  // -inf - -inf would be NaN
      m[h] = mn;
    }
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pr = s[nt][i] == -INFINITY ? 0.f : exp2f(s[nt][i] - m[i / 2]);
        s[nt][i] = pr;
        rs[i / 2] += pr;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rs[h] += __shfl_xor_sync(kFullMask, rs[h], 1);
      rs[h] += __shfl_xor_sync(kFullMask, rs[h], 2);
      l[h] = l[h] * alpha[h] + rs[h];
    }
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      o[nt][0] *= alpha[0];
      o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1];
      o[nt][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        if (nt * 8 < D) {
          uint32_t b[2];
          load_b_frag_kn(b, Vs, ld, kk * 16, nt * 8);
          mma_16816<T>(o[nt], a, b);
        }
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    if (r < nrows) {
      const int qi = (row0 + r) / group, gg = (row0 + r) % group;
      const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
      T* out = static_cast<T*>(p.out) + (q0 + qi) * p.o_stride_tok + (kvh * group + gg) * p.o_stride_head;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        if (nt * 8 < D) {
          out[nt * 8 + 2 * t] = from_float<T>(o[nt][2 * h] * inv);
          out[nt * 8 + 2 * t + 1] = from_float<T>(o[nt][2 * h + 1] * inv);
        }
      }
    }
  }
}

template <typename T>
inline void launch_tc(const AttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const int row_tiles = std::max(1, (std::max(p.max_seqlen_q, 1) * group + kTcRows - 1) / kTcRows);
  const int Dp = (p.head_size + 15) / 16 * 16;
  const size_t smem = size_t(kTcRows + 2 * kTcKv) * (Dp + 8) * sizeof(T);
  dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto kt) {
    using KV = typename decltype(kt)::type;
    const bool ka = chunk_aligned<KV>(p.key_cache, {p.k_stride_block, p.k_stride_tok, p.k_stride_head});
    const bool va = chunk_aligned<KV>(p.value_cache, {p.v_stride_block, p.v_stride_tok, p.v_stride_head});
    auto run = [&](auto kernel) {
      PAGED_ALLOW_SMEM(kernel, smem);
      PAGED_LAUNCH(kernel, dim3(unsigned(int64_t(row_tiles) * p.num_seqs), p.num_kv_heads), dim3(kTcThreads), smem,
                   stream, p, row_tiles, ka, va);
      PAGED_CHECK_LAUNCH("prefill_tc_kernel");
    };
    if (p.head_size <= 64) run(prefill_tc_kernel<T, KV, 64>);
    else if (p.head_size <= 128) run(prefill_tc_kernel<T, KV, 128>);
    else run(prefill_tc_kernel<T, KV, 256>);
  });
}

// The op's entry: tensor cores for 16-bit queries unless the configuration says otherwise.
inline void launch_auto(const AttentionParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const DType dt = DType(p.dtype);
  if (cfg.tensor_cores >= 0 && dt == DType::F16) return launch_tc<__half>(p, stream);
  if (cfg.tensor_cores >= 0 && dt == DType::BF16) return launch_tc<__nv_bfloat16>(p, stream);
  launch(p, cfg, stream);
}

}  // namespace prefill
}  // namespace PAGED_KERNEL_NS

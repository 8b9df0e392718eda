// Paged decode attention: one query token per sequence against its whole paged KV history.
//
// Work split. A thread block owns one KV head of one sequence and (up to kGroupTile <= 8 of) the
// query heads that share it, so every KV token is read from memory once per query group, not once
// per query head as in vLLM's original paged-attention kernel. Within the block, a "token group" of
// TPT lanes reads one token: each lane loads an 8-element chunk of the K row (one 16-byte load for
// 16-bit caches), dots it with its chunk of every query head in registers, and the TPT partial dots
// are summed with xor-shuffles. TPT = head_size / 8 rounded up to 8, 16 or 32, so a warp reads
// 32 / TPT tokens at once and loads of a warp are full 128-byte lines for 64/128/256-wide heads.
// head_size is a runtime value (any multiple of 8 up to 256): only the lanes-per-token class is a
// template parameter, which keeps nvcc's instantiations at 3 per dtype pair.
//
// Softmax is online (running max, running sum) per token group, in the log2 domain (exp2 is one
// instruction; q is pre-multiplied by scale * log2(e)). The token groups' partial states are merged
// through shared memory at the end. fp8 caches are dequantised in registers (value * scale).
//
// Tokens at or past seq_len are never loaded: cache slots there may hold NaN, and a 0 probability
// times a NaN value would still be NaN.
//
// Split-KV (flash-decoding). With few sequences x KV heads the one-pass grid cannot fill the GPU,
// so the context is cut into partitions of `partition_size` tokens along gridDim.z; each writes a
// normalised partial output plus its (max, sum) to a float32 workspace and decode_reduce_kernel
// merges them with log-sum-exp weights. Partitions past a sequence's length exit at once.
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace PAGED_KERNEL_NS {
namespace decode {

// Query heads per block: the group (rounded up to 1, 2, 4 or 8), at most 8. The accumulators are
// kGroupTile x 8 floats per lane, so an MHA model (group 1) must not pay for 8.
constexpr int kMaxGroupTile = 8;
inline int group_tile(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

inline int lanes_per_token(int head_size) { return head_size <= 64 ? 8 : head_size <= 128 ? 16 : 32; }

template <typename T, typename KV, int TPT, int kGroupTile>
__global__ void __launch_bounds__(256) decode_kernel(AttentionParams p, int partition_size, int num_partitions,
                                                      float* tmp_out, float* tmp_ml, int n_gtiles,
                                                      bool k_aligned, bool v_aligned) {
  const int group = p.num_heads / p.num_kv_heads;
  // Sequences on x (up to 2^31 - 1; y/z stop at 65535), (KV head, group tile) on y, partitions on z.
  const int kvh = blockIdx.y / n_gtiles;
  const int g0 = (blockIdx.y % n_gtiles) * kGroupTile;
  const int gcount = min(kGroupTile, group - g0);
  const int gmax = min(kGroupTile, group);  // the smem layout's stride, same for every block
  const int seq = blockIdx.x;
  const int part = blockIdx.z;
  const int seq_len = p.seq_lens[seq];
  const int start = num_partitions > 1 ? part * partition_size : 0;
  if (start >= seq_len) return;  // whole block leaves together: no barrier is skipped by a subset
  const int end = num_partitions > 1 ? min(seq_len, start + partition_size) : seq_len;
  const int D = p.head_size;

  constexpr int kGroupsPerWarp = 32 / TPT;
  const int lane = threadIdx.x % 32;
  const int sub = lane % TPT;
  const int tg = (threadIdx.x / 32) * kGroupsPerWarp + lane / TPT;
  const int ntg = (blockDim.x / 32) * kGroupsPerWarp;
  const int d0 = sub * 8;
  const bool active = d0 < D;  // head sizes that are not 8*TPT leave the top lanes idle
  const int head0 = kvh * group + g0;

  float q[kGroupTile][8];
  const float qmul = p.scale * kLog2e;
  const T* qrow = static_cast<const T*>(p.query) + seq * p.q_stride_tok + d0;
#pragma unroll
  for (int g = 0; g < kGroupTile; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      q[g][i] = (g < gcount && active) ? to_float(qrow[(head0 + g) * p.q_stride_head + i]) * qmul : 0.f;
  }
  const float kscale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kvh : 0] : 1.f;
  const float vscale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kvh : 0] : 1.f;
  const KV* kc = static_cast<const KV*>(p.key_cache) + kvh * p.k_stride_head + d0;
  const KV* vc = static_cast<const KV*>(p.value_cache) + kvh * p.v_stride_head + d0;
  const int32_t* bt = p.block_tables + seq * p.bt_stride;

  float m[kGroupTile], l[kGroupTile], acc[kGroupTile][8];
#pragma unroll
  for (int g = 0; g < kGroupTile; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }

  // Every lane runs the same number of iterations (the bound is block-uniform) so the shuffles
  // below always see the full warp; tokens past `end` just contribute nothing.
  // K/V of this token group's next token are loaded one iteration ahead (register double
  // buffering): a warp keeps two tokens' 16-byte loads in flight while it computes, which is what
  // hides memory latency at the low occupancy the per-lane accumulators allow.
  float kn[8], vn[8];
  auto fetch = [&](int t) {
#pragma unroll
    for (int i = 0; i < 8; ++i) kn[i] = vn[i] = 0.f;
    if (t < end && active) {  // only tokens < seq_len: slots past it may hold NaN
      const int64_t blk = bt[t / p.block_size], off = t % p.block_size;
      load8(kc + blk * p.k_stride_block + off * p.k_stride_tok, kn, k_aligned, kscale);
      load8(vc + blk * p.v_stride_block + off * p.v_stride_tok, vn, v_aligned, vscale);
    }
  };
  fetch(start + tg);
  for (int base = start; base < end; base += ntg) {
    const bool valid = base + tg < end;
    float k[8], v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) k[i] = kn[i], v[i] = vn[i];
    fetch(base + ntg + tg);
    float s[kGroupTile];
#pragma unroll
    for (int g = 0; g < kGroupTile; ++g) {
      if (g < gcount) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d += q[g][i] * k[i];
#pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(kFullMask, d, o);
        s[g] = d;
      }
    }
    if (valid) {
#pragma unroll
      for (int g = 0; g < kGroupTile; ++g) {
        if (g < gcount) {
          const float mn = fmaxf(m[g], s[g]);
          const float a = exp2f(m[g] - mn);  // m = -inf on the first token: a = 0
          const float pr = exp2f(s[g] - mn);
          l[g] = l[g] * a + pr;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * a + pr * v[i];
          m[g] = mn;
        }
      }
    }
  }

  // Merge the token groups: [ntg][gmax][2] (max, sum) then [ntg][gmax][D] accumulators.
  PAGED_DYNAMIC_SMEM(float, sm, size_t(ntg) * gmax * (D + 2));
  float* sml = sm;
  float* sacc = sm + size_t(ntg) * gmax * 2;
#pragma unroll
  for (int g = 0; g < kGroupTile; ++g) {
    if (g < gcount) {
      if (sub == 0) {
        sml[(tg * gmax + g) * 2] = m[g];
        sml[(tg * gmax + g) * 2 + 1] = l[g];
      }
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sacc[size_t(tg * gmax + g) * D + d0 + i] = acc[g][i];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < gcount * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int j = 0; j < ntg; ++j) M = fmaxf(M, sml[(j * gmax + g) * 2]);
    float L = 0.f, A = 0.f;
    for (int j = 0; j < ntg; ++j) {
      const float lj = sml[(j * gmax + g) * 2 + 1];
      if (lj == 0.f) continue;  // a token group that saw no token (its max is -inf)
      const float w = exp2f(sml[(j * gmax + g) * 2] - M);
      L += w * lj;
      A += w * sacc[size_t(j * gmax + g) * D + d];
    }
    const float o = A / L;
    if (num_partitions == 1) {
      static_cast<T*>(p.out)[seq * p.o_stride_tok + (head0 + g) * p.o_stride_head + d] = from_float<T>(o);
    } else {
      const size_t row = (size_t(seq) * p.num_heads + head0 + g) * num_partitions + part;
      tmp_out[row * D + d] = o;
      if (d == 0) {
        tmp_ml[row * 2] = M;
        tmp_ml[row * 2 + 1] = L;
      }
    }
  }
}

// Log-sum-exp merge of the split-KV partials of one (sequence, query head).
template <typename T>
__global__ void __launch_bounds__(128) decode_reduce_kernel(AttentionParams p, int partition_size, int num_partitions,
                                                            const float* tmp_out, const float* tmp_ml) {
  const int seq = blockIdx.x, head = blockIdx.y;
  const int D = p.head_size;
  const int nparts = ceil_div(p.seq_lens[seq], partition_size);  // only these were written
  const size_t row0 = (size_t(seq) * p.num_heads + head) * num_partitions;
  PAGED_DYNAMIC_SMEM(float, w, num_partitions);
  float M = -INFINITY;
  for (int j = 0; j < nparts; ++j) M = fmaxf(M, tmp_ml[(row0 + j) * 2]);
  for (int j = threadIdx.x; j < nparts; j += blockDim.x)
    w[j] = exp2f(tmp_ml[(row0 + j) * 2] - M) * tmp_ml[(row0 + j) * 2 + 1];
  __syncthreads();
  float L = 0.f;
  for (int j = 0; j < nparts; ++j) L += w[j];
  const float inv = 1.f / L;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int j = 0; j < nparts; ++j) o += w[j] * tmp_out[(row0 + j) * D + d];
    static_cast<T*>(p.out)[seq * p.o_stride_tok + head * p.o_stride_head + d] = from_float<T>(o * inv);
  }
}

struct Plan {
  int threads, tpt, gtile, n_gtiles, gmax, partition_size, num_partitions;
  size_t smem, reduce_smem;
  size_t workspace_floats;  // tmp_out + tmp_ml
};

constexpr int kDefaultThreads = 128;
constexpr int kDefaultPartition = 512;
constexpr int kMaxPartitions = 8192;  // keeps the reduce kernel's weights in 32 KB of smem

inline Plan plan(const AttentionParams& p, const LaunchConfig& cfg) {
  Plan pl{};
  pl.threads = cfg.threads > 0 ? cfg.threads : kDefaultThreads;
  if (pl.threads % 32 || pl.threads > 256)
    throw std::runtime_error("paged_cuda: decode threads per block must be 32, 64, ..., 256");
  pl.tpt = lanes_per_token(p.head_size);
  const int group = p.num_heads / p.num_kv_heads;
  pl.gtile = group_tile(group);
  pl.n_gtiles = (group + pl.gtile - 1) / pl.gtile;
  pl.gmax = std::min(pl.gtile, group);
  const int ntg = pl.threads / 32 * (32 / pl.tpt);
  pl.smem = size_t(ntg) * pl.gmax * (p.head_size + 2) * sizeof(float);
  // Upper bound of any context: the block table's width (the real max would need a device sync).
  const int64_t max_ctx = int64_t(p.max_blocks_per_seq) * p.block_size;
  int part = cfg.partition_size > 0 ? cfg.partition_size : kDefaultPartition;
  part = int(std::max<int64_t>(part, (max_ctx + kMaxPartitions - 1) / kMaxPartitions));
  const int64_t blocks = int64_t(p.num_seqs) * p.num_kv_heads * pl.n_gtiles;
  const int64_t sms = std::max(p.num_sms, 1);
  const bool split = cfg.partition_size >= 0 && max_ctx > part && (cfg.force_split || blocks < 2 * sms);
  if (split && !cfg.force_split) {
    // Enough partitions to give every SM ~4 blocks, no more: longer contexts get longer partitions
    // instead, which bounds the float32 workspace (num_seqs x heads x partitions x head_size).
    const int64_t max_parts = std::max<int64_t>(2, (4 * sms + blocks - 1) / blocks);
    part = int(std::max<int64_t>(part, (max_ctx + max_parts - 1) / max_parts));
  }
  pl.partition_size = part;
  pl.num_partitions = split ? int((max_ctx + part - 1) / part) : 1;
  pl.reduce_smem = size_t(pl.num_partitions) * sizeof(float);
  pl.workspace_floats = split ? size_t(p.num_seqs) * p.num_heads * pl.num_partitions * (p.head_size + 2) : 0;
  return pl;
}

// `workspace` must hold plan(p, cfg).workspace_floats floats (may be null when that is 0).
inline void launch(const AttentionParams& p, const LaunchConfig& cfg, float* workspace, cudaStream_t stream) {
  const Plan pl = plan(p, cfg);
  float* tmp_out = workspace;
  float* tmp_ml = workspace ? workspace + size_t(p.num_seqs) * p.num_heads * pl.num_partitions * p.head_size : nullptr;
  dispatch_float(DType(p.dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto kt) {
      using KV = typename decltype(kt)::type;
      const bool ka = chunk_aligned<KV>(p.key_cache, {p.k_stride_block, p.k_stride_tok, p.k_stride_head});
      const bool va = chunk_aligned<KV>(p.value_cache, {p.v_stride_block, p.v_stride_tok, p.v_stride_head});
      const dim3 grid(p.num_seqs, p.num_kv_heads * pl.n_gtiles, pl.num_partitions);
      auto run = [&](auto kernel) {
        PAGED_ALLOW_SMEM(kernel, pl.smem);
        PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.partition_size, pl.num_partitions,
                     tmp_out, tmp_ml, pl.n_gtiles, ka, va);
        PAGED_CHECK_LAUNCH("decode_kernel");
      };
      auto by_group = [&](auto tpt) {
        constexpr int TPT = decltype(tpt)::value;
        switch (pl.gtile) {
          case 1: return run(decode_kernel<T, KV, TPT, 1>);
          case 2: return run(decode_kernel<T, KV, TPT, 2>);
          case 4: return run(decode_kernel<T, KV, TPT, 4>);
          default: return run(decode_kernel<T, KV, TPT, 8>);
        }
      };
      if (pl.tpt == 8) by_group(std::integral_constant<int, 8>{});
      else if (pl.tpt == 16) by_group(std::integral_constant<int, 16>{});
      else by_group(std::integral_constant<int, 32>{});
    });
    if (pl.num_partitions > 1) {
      auto kernel = decode_reduce_kernel<T>;
      PAGED_LAUNCH(kernel, dim3(p.num_seqs, p.num_heads), dim3(128), pl.reduce_smem, stream, p, pl.partition_size,
                   pl.num_partitions, static_cast<const float*>(tmp_out), static_cast<const float*>(tmp_ml));
      PAGED_CHECK_LAUNCH("decode_reduce_kernel");
    }
  });
}

}  // namespace decode
}  // namespace PAGED_KERNEL_NS

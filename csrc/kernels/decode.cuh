// Paged decode attention: one query token per sequence against its whole paged KV history.
//
// Work split. Decode is bound by reading the KV cache, so the unit of work is what shares a KV
// row: a thread block owns one KV head of one sequence and every query head of its group, and each
// KV token is read from memory once per group, not once per query head as in vLLM's original
// paged-attention kernel. Within a block, a "token group" of TPT lanes works on one token: each
// lane owns an 8-element chunk of the head dimension, dots it with its chunk of up to 8 query heads
// held in registers (kMaxGroupTile: 8 heads x 8 dims of q and of the accumulators per lane is what
// the register file allows at 256 threads), and the TPT partial dots are summed with
// xor-shuffles. TPT = head_size / 8 rounded up to 8, 16 or 32, so a warp reads 32 / TPT tokens at
// once and its loads are full 128-byte lines for 64/128/256-wide heads. head_size is a runtime
// value (any multiple of 8 up to 256).
//
// Two kernels, one set of stages, named as in FlashInfer: load_q, compute_qk (per-lane dots summed
// over the token group), update_softmax (per-lane online softmax), compute_pv, merge_and_store:
//  * group <= 8 (decode_kernel): the whole group fits one lane's registers, so every token group
//    streams its own tokens straight from global memory into registers, one token ahead (register
//    double buffering). The head tile is a template parameter (1, 2, 4, 8) so an MHA model does
//    not pay for 8 heads' registers.
//  * group > 8 (decode_shared_kv_kernel; GQA with big groups, MQA): no lane can hold the group, so
//    warps are split among tiles of 8 heads, and the KV tokens they all need are staged once per
//    block in shared memory: all threads copy a chunk of K and V rows (raw cache bytes, cp.async
//    on sm_80+, double-buffered so the next chunk is in flight while this one is consumed), then
//    each tile's token groups walk the chunk out of shared memory (fp8 is dequantised there). One
//    block reads each KV token from DRAM once for up to 64 heads (8 tiles x 8 heads at 256
//    threads). Larger groups (> 64) are cut into head chunks of up to 64 on grid x, next to each
//    other (x = seq * chunks + chunk), so the chunks of one (sequence, KV head) run back to back
//    and their re-reads of the same KV hit L2: DRAM still sees about one read per group.
//
// Softmax is online (running max, running sum) per token group, in the log2 domain (exp2 is one
// instruction; q is pre-multiplied by scale * log2(e)). The token groups' partial states are merged
// through shared memory at the end. fp8 caches are dequantised in registers (value * scale).
//
// Only the row's visible keys are ever loaded (a block's KV loop runs over exactly its row's
// span): cache slots past seq_len may hold NaN, and a key hidden from the row by the mask may hold
// inf or NaN, and a 0 probability times either would still be NaN. A row that sees no key (seq_len
// 0, a prefill row before the cache under causal alignment, a window that excludes everything)
// writes out 0 and lse -inf or its sink's (finish_softmax: attention_rules.h's end_row) and reads
// nothing.
//
// Split-KV (flash-decoding). With few sequences x KV heads the one-pass grid cannot fill the GPU,
// so the context is cut into partitions of `partition_size` tokens along gridDim.z; each writes a
// normalised partial output plus its (max, sum) to a float32 workspace and decode_reduce_kernel
// merges them with log-sum-exp weights. Partitions past a sequence's length exit at once.
// Partitions are aligned to multiples of partition_size from the row's first visible key's
// partition, so a given key range is always cut the same way.
//
// Variants (paged_ops/reference.py attention), all runtime values uniform over a launch:
//  * window_left / window_right: a row sees keys [p - window_left, p] (causal) or
//    [p - window_left, p + window_right]; the KV loop runs over exactly those (blocks outside are
//    never read), and the plan sizes the partitions by the window, so the cost is O(window), not
//    O(context);
//  * softcap: q is then pre-scaled by `scale` only, and s = softcap * log2(e) * tanh(s / softcap)
//    moves the capped score into the log2 domain; alibi_slopes add slope * log2(e) * (j - p);
//  * sinks: one more logit per head in the denominator, added once where the row's state is final
//    (merge_and_store in one pass, the reduce kernel after a split);
//  * lse: ln of the denominator, (m + log2 l) * ln 2, written where the output is.
// Rows. Decode has one row per sequence (p = seq_len - 1). With p.cu_seqlens_q set, the rows are
// prefill_attention's query rows (the batch-invariant mode runs prefill through this kernel): a
// row finds its sequence by binary search over cu_seqlens_q, p = seq_len - q_len + i, and a causal
// row sees keys < p + 1 — exactly a decode of seq_len p + 1, so both give the same bits (a row with
// p < 0 sees nothing, as a decode of seq_len 0).
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"
#include "kernels/plan.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace PAGED_KERNEL_NS {
namespace decode {

// ---- stages shared by both kernels ------------------------------------------------------------

// The query row a block serves and the keys it sees: [begin, end) (visible_keys, empty when
// begin >= end).
struct RowSpan {
  int64_t seq;  // its sequence: block-table row and seq_lens entry
  int pos;      // the query's position p
  int begin, end;
};

__device__ __forceinline__ RowSpan row_span(const AttentionParams& p, int64_t row) {
  RowSpan r;
  int seq_len;
  if (p.cu_seqlens_q) {
    // The last s with cu_seqlens_q[s] <= row: a sequence with no rows shares its start with the
    // next, and the last of them is the one that owns the row.
    int64_t lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens_q[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    r.seq = lo;
    seq_len = p.seq_lens[lo];
    const int q0 = p.cu_seqlens_q[lo], q_len = p.cu_seqlens_q[lo + 1] - q0;
    r.pos = seq_len - q_len + int(row - q0);
  } else {
    r.seq = row;
    seq_len = p.seq_lens[row];
    r.pos = seq_len - 1;  // causal: decode_attention's params say so
  }
  const KeyRange keys = visible_keys(p, r.pos, seq_len);
  r.begin = keys.lo;
  r.end = keys.hi;
  return r;
}

// The first token of the row's first partition: partitions are aligned to multiples of
// partition_size, so the same key range is always cut the same way (the batch-invariant mode).
__device__ __forceinline__ int64_t first_partition_token(const RowSpan& r, int partition_size) {
  return int64_t(r.begin / partition_size) * partition_size;
}
// 0 for a row that sees no key.
__device__ __forceinline__ int row_partitions(const RowSpan& r, int partition_size) {
  if (r.begin >= r.end) return 0;
  return int((r.end - first_partition_token(r, partition_size) + partition_size - 1) / partition_size);
}

// Keys [start, end) of partition `part` of the row (all of them in one pass); empty when the row
// needs fewer partitions than the grid has.
__device__ __forceinline__ void partition_keys(const RowSpan& r, bool split, int partition_size, int part, int& start,
                                               int& end) {
  if (!split) {
    start = r.begin;
    end = r.end;
    return;
  }
  const int64_t lo = first_partition_token(r, partition_size) + int64_t(part) * partition_size;
  const int64_t hi = lo + partition_size;
  start = int(lo > r.begin ? (lo < r.end ? lo : r.end) : r.begin);
  end = int(hi < r.end ? hi : r.end);
}

// q's pre-scale: into the log2 domain at once, or (soft-cap) the natural one, which the cap needs.
__device__ __forceinline__ float query_multiplier(const AttentionParams& p) {
  return p.softcap > 0.f ? p.scale : p.scale * kLog2e;
}

// The score modifications after q . k, per lane for its G heads: soft-cap, then ALiBi, leaving the
// score in the log2 domain. The slopes are read per key (L1 hits) rather than held in G registers
// beside the group-8 kernel's q and accumulators.
template <int G>
struct ScoreMod {
  float cap, cap_log2;   // softcap, softcap * log2(e); cap = 0: none
  const float* slopes;   // ALiBi slopes of heads head0 .. head0 + G - 1; nullptr: none
  int pos;
  __device__ __forceinline__ void init(const AttentionParams& p, int head0, int position) {
    cap = p.softcap;
    cap_log2 = p.softcap * kLog2e;
    slopes = p.alibi_slopes ? p.alibi_slopes + head0 : nullptr;
    pos = position;
  }
  // s: the G heads' scores of key t.
  __device__ __forceinline__ void apply(float (&s)[G], int t, int gcount) const {
    if (cap > 0.f) {
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g < gcount) s[g] = cap_log2 * tanhf(s[g] / cap);
    }
    if (slopes) {
      const float distance = float(t - pos) * kLog2e;  // (j - p) log2(e); j - p exact below 2^24
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g < gcount) s[g] += slopes[g] * distance;
    }
  }
};

// This lane's 8 dims of `gcount` query heads from `head0`, pre-scaled (query_multiplier); zeros
// for the heads past gcount and for idle lanes.
template <typename T, int G>
__device__ __forceinline__ void load_q(float (&q)[G][8], const AttentionParams& p, int64_t row, int head0, int gcount,
                                       int d0, bool active) {
  const float qmul = query_multiplier(p);
  const T* qrow = static_cast<const T*>(p.query) + row * p.q_stride_token + d0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      q[g][i] = (g < gcount && active) ? to_float(qrow[(head0 + g) * p.q_stride_head + i]) * qmul : 0.f;
  }
}

// Scores of one token for the G heads: this lane's partial dots summed over the token group's tpt
// lanes. gcount must be warp-uniform (the shuffles need the whole warp). tpt is a constant in
// decode_kernel (the loop unrolls) and a runtime value in the shared-KV kernel.
template <int G>
__device__ __forceinline__ void compute_qk(const float (&q)[G][8], const float (&k)[8], float (&s)[G], int gcount,
                                          int tpt) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    s[g] = 0.f;
    if (g < gcount) {
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) d += q[g][i] * k[i];
#pragma unroll
      for (int o = tpt / 2; o > 0; o >>= 1) d += __shfl_xor_sync(kFullMask, d, o);
      s[g] = d;
    }
  }
}

// Per-lane online softmax state of G heads over this lane's 8 dims: running max m and sum l (log2
// domain) and the unnormalised output accumulators.
template <int G>
struct OnlineSoftmax {
  float m[G], l[G], acc[G][8];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }
  }
  // Folds one token's scores into the running max and sum, rescales the accumulators to the new
  // max, and turns s into the token's probabilities. A NaN score gives NaN probabilities (and so a
  // NaN row), as in the reference; a -inf score (an infinite query or key) has probability 0, not
  // exp2(-inf - -inf) = NaN while the row has seen nothing finite yet.
  __device__ __forceinline__ void update_softmax(float (&s)[G], int gcount) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < gcount) {
        const float mn = fmaxf(m[g], s[g]);
        // 0 at the first finite score (m = -inf); 1 while none (-inf - -inf would be NaN)
        const float a = mn == -INFINITY ? 1.f : exp2f(m[g] - mn);
        s[g] = s[g] == -INFINITY ? 0.f : exp2f(s[g] - mn);
        l[g] = l[g] * a + s[g];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] *= a;
        m[g] = mn;
      }
    }
  }
  // acc += p * v for the token's probabilities p (update_softmax's output) and value row v.
  __device__ __forceinline__ void compute_pv(const float (&pr)[G], const float (&v)[8], int gcount) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < gcount) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] += pr[g] * v[i];
      }
    }
  }
};

// Where a block's results go: the output row (one pass) or its split-KV partition's workspace rows.
struct Dest {
  int64_t row;
  int part, num_partitions;
  bool split;
  float* tmp_out;
  float* tmp_ml;
};

// A row that sees no key (one pass: the block's heads head0 .. head0 + nheads - 1): out 0 and lse
// -inf, or the sink's (finish_softmax). Every thread of the block calls it, then the block exits.
template <typename T>
__device__ __forceinline__ void store_empty_row(const AttentionParams& p, int64_t row, int head0, int nheads) {
  const int D = int(p.head_size);
  for (int idx = threadIdx.x; idx < nheads * D; idx += blockDim.x) {
    const int head = head0 + idx / D, d = idx % D;
    const RowEnd<float> e = finish_softmax(p, -INFINITY, 0.f, head);
    static_cast<T*>(p.out)[row * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(0.f * e.mul);
    if (p.lse && d == 0) p.lse[row * int(p.num_heads) + head] = e.lse;
  }
}

// Merges the token groups' states through shared memory `sm` (merge_floats(ntg, gstride, D)) and
// writes the block's `nheads` heads from `head0`. Token groups are numbered tile-major: the head tile
// t (block heads [t * gstride, (t + 1) * gstride)) is served by token groups
// [t * ntg_tile, (t + 1) * ntg_tile). Has a __syncthreads: every thread of the block calls it.
template <typename T, int G>
__device__ __forceinline__ void merge_and_store(const AttentionParams& p, const OnlineSoftmax<G>& st, float* sm,
                                                int ntg, int ntg_tile, int gstride, int tg, int gcount, bool lead,
                                                bool active, int d0, int head0, int nheads, const Dest& o) {
  const int D = int(p.head_size), num_heads = int(p.num_heads);
  float* sml = sm;
  float* sacc = sm + size_t(ntg) * gstride * 2;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < gcount) {
      if (lead) {
        sml[(tg * gstride + g) * 2] = st.m[g];
        sml[(tg * gstride + g) * 2 + 1] = st.l[g];
      }
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sacc[size_t(tg * gstride + g) * D + d0 + i] = st.acc[g][i];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nheads * D; idx += blockDim.x) {
    const int h = idx / D, d = idx % D;
    const int g = h % gstride, j0 = (h / gstride) * ntg_tile;
    float M = -INFINITY;
    for (int j = j0; j < j0 + ntg_tile; ++j) M = fmaxf(M, sml[(j * gstride + g) * 2]);
    float L = 0.f, A = 0.f;
    for (int j = j0; j < j0 + ntg_tile; ++j) {
      const float lj = sml[(j * gstride + g) * 2 + 1];
      if (lj == 0.f) continue;  // a token group that saw no token (its max is -inf)
      const float w = exp2f(sml[(j * gstride + g) * 2] - M);
      L += w * lj;
      A += w * sacc[size_t(j * gstride + g) * D + d];
    }
    const int head = head0 + h;
    if (!o.split) {
      const RowEnd<float> e = finish_softmax(p, M, L, head);  // L = 0: no finite score (out 0)
      static_cast<T*>(p.out)[o.row * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(A * e.mul);
      if (p.lse && d == 0) p.lse[o.row * num_heads + head] = e.lse;
    } else {
      const size_t row = (size_t(o.row) * num_heads + head) * o.num_partitions + o.part;
      o.tmp_out[row * D + d] = A / L;
      if (d == 0) {
        o.tmp_ml[row * 2] = M;
        o.tmp_ml[row * 2 + 1] = L;
      }
    }
  }
}

// ---- group <= 8: KV streamed into registers ----------------------------------------------------
template <typename T, typename KV, int TPT, int kGroupTile>
__global__ void __launch_bounds__(256) decode_kernel(AttentionParams p, bool split, int partition_size,
                                                      int num_partitions, float* tmp_out, float* tmp_ml, bool k_aligned,
                                                      bool v_aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  // AttentionParams' sizes are int64 (the cpu backend's); the binding checks they fit int, and the
  // kernels narrow them once: 64-bit division and products cost registers and instructions.
  const int group = int(p.num_heads) / int(p.num_kv_heads);  // <= kGroupTile: the whole group
  // Rows on x (up to 2^31 - 1; y/z stop at 65535), KV heads on y, partitions on z.
  const int kvh = blockIdx.y;
  const int64_t row = blockIdx.x;
  const int part = blockIdx.z;
  const RowSpan rs = row_span(p, row);
  int start, end;
  partition_keys(rs, split, partition_size, part, start, end);
  if (start >= end) {  // whole block leaves together: no barrier is skipped by a subset
    // A split row's empty partitions write nothing (the reduce reads only the row's partitions).
    if (!split) store_empty_row<T>(p, row, kvh * group, group);
    return;
  }
  const int64_t seq = rs.seq;
  const int D = int(p.head_size);

  constexpr int kGroupsPerWarp = 32 / TPT;
  const int lane = threadIdx.x % 32;
  const int sub = lane % TPT;
  const int tg = (threadIdx.x / 32) * kGroupsPerWarp + lane / TPT;
  const int ntg = (blockDim.x / 32) * kGroupsPerWarp;
  const int d0 = sub * 8;
  const bool active = d0 < D;  // head sizes that are not 8*TPT leave the top lanes idle
  const int head0 = kvh * group;

  float q[kGroupTile][8];
  load_q<T>(q, p, row, head0, group, d0, active);
  ScoreMod<kGroupTile> mod;
  mod.init(p, head0, rs.pos);
  const float kscale = cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh);
  const float vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);

  OnlineSoftmax<kGroupTile> st;
  st.init();

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
      load8(K.row(t) + d0, kn, k_aligned, kscale);
      load8(V.row(t) + d0, vn, v_aligned, vscale);
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
    compute_qk(q, k, s, group, TPT);
    if (valid) {
      mod.apply(s, base + tg, group);
      st.update_softmax(s, group);
      st.compute_pv(s, v, group);
    }
  }

  PAGED_DYNAMIC_SMEM(float, sm, merge_floats(ntg, group, D));
  merge_and_store<T>(p, st, sm, ntg, ntg, group, tg, group, sub == 0, active, d0, head0, group,
                     Dest{row, part, num_partitions, split, tmp_out, tmp_ml});
}

// ---- group > 8: KV staged once per block in shared memory --------------------------------------
// sk: the staging shape (plan_decode, kernels/plan.h).
template <typename T, typename KV>
__global__ void __launch_bounds__(256) decode_shared_kv_kernel(AttentionParams p, SharedKV sk, bool split,
                                                                int partition_size, int num_partitions, float* tmp_out,
                                                                float* tmp_ml) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  const int group = int(p.num_heads) / int(p.num_kv_heads);  // int: see decode_kernel
  // (row, head chunk) on x, chunks adjacent: see the header comment.
  const int64_t row = blockIdx.x / sk.n_hchunks;
  const int hchunk = blockIdx.x % sk.n_hchunks;
  const int kvh = blockIdx.y;
  const int part = blockIdx.z;
  const RowSpan rs = row_span(p, row);
  int start, end;
  partition_keys(rs, split, partition_size, part, start, end);
  if (start >= end) {  // whole block leaves together
    if (!split) {
      const int hb = hchunk * sk.heads_per_block;
      store_empty_row<T>(p, row, kvh * group + hb, min(sk.heads_per_block, group - hb));
    }
    return;
  }
  const int64_t seq = rs.seq;
  const int D = int(p.head_size);

  const int tpt = sk.tpt;
  const int gpw = 32 / tpt;  // token groups per warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = warp / sk.warps_per_tile;
  const int sub = lane % tpt;
  const int tg = warp * gpw + lane / tpt;  // tile-major, as merge_and_store expects
  const int ntg_tile = sk.warps_per_tile * gpw;
  const int tg_in_tile = tg - tile * ntg_tile;
  const int ntg = blockDim.x / 32 * gpw;
  const int d0 = sub * 8;
  const bool active = d0 < D;
  const int hb = hchunk * sk.heads_per_block;         // first group-relative head of the block
  const int nheads = min(sk.heads_per_block, group - hb);
  const int gcount = max(0, min(kMaxGroupTile, nheads - tile * kMaxGroupTile));  // warp-uniform
  const int head0 = kvh * group + hb;

  float q[kMaxGroupTile][8];
  load_q<T>(q, p, row, head0 + tile * kMaxGroupTile, gcount, d0, active);
  ScoreMod<kMaxGroupTile> mod;
  mod.init(p, head0 + tile * kMaxGroupTile, rs.pos);
  const float kscale = cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh);
  const float vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);

  PAGED_DYNAMIC_SMEM(unsigned char, smem, shared_kv_smem(sk, blockDim.x, D));
  const int C = sk.chunk, pitch = sk.pitch, cb = sk.copy_bytes;
  const int units = D * int(sizeof(KV)) / cb;  // copies per row
  auto buffer = [&](int b) { return smem + size_t(b) * 2 * C * pitch; };  // K rows, then V rows
  // All threads copy the K and V rows of tokens [c0, min(c0 + C, end)) into buffer b: nothing at or
  // past `end` is read.
  auto stage = [&](int c0, int b) {
    unsigned char* buf = buffer(b);
    const int n = min(C, end - c0);
    for (int idx = threadIdx.x; idx < n * units; idx += blockDim.x) {
      const int r = idx / units, u = idx - r * units;
      const int t = c0 + r;
      copy_async(buf + size_t(r) * pitch + u * cb, reinterpret_cast<const char*>(K.row(t)) + u * cb, cb);
      copy_async(buf + size_t(C + r) * pitch + u * cb, reinterpret_cast<const char*>(V.row(t)) + u * cb, cb);
    }
    cp_async_commit();
  };

  OnlineSoftmax<kMaxGroupTile> st;
  st.init();
  const int nchunks = ceil_div(end - start, C);  // block-uniform: every thread meets every barrier
  stage(start, 0);
  for (int c = 0; c < nchunks; ++c) {
    const int c0 = start + c * C;
    if (c + 1 < nchunks) {
      stage(c0 + C, (c + 1) & 1);  // its buffer was last read before the previous iteration's barrier
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // chunk c is in shared memory for everybody
    const unsigned char* buf = buffer(c & 1);
    const int n = min(C, end - c0);
    if (gcount > 0) {
      for (int base = 0; base < n; base += ntg_tile) {  // warp-uniform bound: shuffles see the full warp
        const int r = base + tg_in_tile;
        const bool valid = r < n;
        float k[8], v[8];
        if (valid && active) {
          load8(reinterpret_cast<const KV*>(buf + size_t(r) * pitch) + d0, k, true, kscale);
          load8(reinterpret_cast<const KV*>(buf + size_t(C + r) * pitch) + d0, v, true, vscale);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) k[i] = v[i] = 0.f;
        }
        float s[kMaxGroupTile];
        compute_qk(q, k, s, gcount, tpt);
        if (valid) {
          mod.apply(s, c0 + r, gcount);
          st.update_softmax(s, gcount);
          st.compute_pv(s, v, gcount);
        }
      }
    }
    __syncthreads();  // buffer c & 1 is free for chunk c + 2
  }

  // The staging buffers are idle now (last copies waited for, last reads behind the barrier).
  merge_and_store<T>(p, st, reinterpret_cast<float*>(smem), ntg, ntg_tile, kMaxGroupTile, tg, gcount, sub == 0,
                     active, d0, head0, nheads, Dest{row, part, num_partitions, split, tmp_out, tmp_ml});
}

// Log-sum-exp merge of the split-KV partials of one (row, query head), in one fixed order (partition
// 0, 1, ...), adding the head's sink once (finish_softmax); writes the output and the lse. Every
// thread computes the partitions' weights itself (no shared memory, so no bound on the partition
// count) in the same order, so all of them see the same L. Only the row's own partitions were
// written (none for a row that sees no key: out 0, lse -inf or the sink's).
template <typename T>
__global__ void __launch_bounds__(128) decode_reduce_kernel(AttentionParams p, int partition_size, int num_partitions,
                                                            const float* tmp_out, const float* tmp_ml) {
  PAGED_LAUNCH_BOUNDS_CHECK(128);
  const int64_t row = blockIdx.x;
  const int head = blockIdx.y;
  const int D = int(p.head_size), num_heads = int(p.num_heads);
  const int nparts = row_partitions(row_span(p, row), partition_size);  // only these were written
  const size_t row0 = (size_t(row) * num_heads + head) * num_partitions;
  float M = -INFINITY;
  for (int j = 0; j < nparts; ++j) M = fmaxf(M, tmp_ml[(row0 + j) * 2]);
  float L = 0.f;
  // A partition with no finite score (l = 0, m = -inf, out 0 / 0) adds nothing, as in merge_and_store.
  for (int j = 0; j < nparts; ++j) {
    const float lj = tmp_ml[(row0 + j) * 2 + 1];
    if (lj != 0.f) L += exp2f(tmp_ml[(row0 + j) * 2] - M) * lj;
  }
  const RowEnd<float> e = finish_softmax(p, M, L, head);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int j = 0; j < nparts; ++j) {
      const float lj = tmp_ml[(row0 + j) * 2 + 1];
      if (lj != 0.f) o += exp2f(tmp_ml[(row0 + j) * 2] - M) * lj * tmp_out[(row0 + j) * D + d];
    }
    static_cast<T*>(p.out)[row * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(o * e.mul);
  }
  if (p.lse && threadIdx.x == 0) p.lse[row * num_heads + head] = e.lse;
}

// `pl`: plan_decode(p, cfg) (kernels/plan.h), computed once by the binding. `workspace` holds
// pl.workspace_floats floats (null when that is 0).
inline void launch(const AttentionParams& p, const DecodePlan& pl, float* workspace, Stream stream) {
  float* tmp_out = workspace;
  float* tmp_ml = workspace ? workspace + size_t(pl.num_rows) * p.num_heads * pl.num_partitions * p.head_size : nullptr;
  const dim3 grid(unsigned(pl.grid_x), pl.grid_y, pl.grid_z);
  dispatch_float(DType(p.dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto kt) {
      using KV = typename decltype(kt)::type;
      if (pl.shared_kv) {
        auto kernel = decode_shared_kv_kernel<T, KV>;
        PAGED_ALLOW_SMEM(kernel, pl.smem);
        PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.sk, pl.split, pl.partition_size,
                     pl.num_partitions, tmp_out, tmp_ml);
        PAGED_CHECK_LAUNCH("decode_shared_kv_kernel");
        return;
      }
      const bool ka = pl.k_aligned, va = pl.v_aligned;
      auto run = [&](auto kernel) {
        PAGED_ALLOW_SMEM(kernel, pl.smem);
        PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.split, pl.partition_size,
                     pl.num_partitions, tmp_out, tmp_ml, ka, va);
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
    if (pl.split) {
      auto kernel = decode_reduce_kernel<T>;
      PAGED_LAUNCH(kernel, dim3(unsigned(pl.num_rows), p.num_heads), dim3(128), 0, stream, p, pl.partition_size,
                   pl.num_partitions, static_cast<const float*>(tmp_out), static_cast<const float*>(tmp_ml));
      PAGED_CHECK_LAUNCH("decode_reduce_kernel");
    }
  });
}

}  // namespace decode
}  // namespace PAGED_KERNEL_NS

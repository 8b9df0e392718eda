// Paged decode attention: one query token per sequence against its whole paged KV history.
//
// Work split. Decode is bound by reading the KV cache, so the unit of work is what shares a KV
// row: a thread block owns one KV head of one sequence and every query head of its group (up to
// kMaxHeadsPerBlock; larger groups are cut into head chunks on grid x, next to each other so their
// re-reads of the same KV hit L2), and each KV token is read from memory once per block.
//
// One kernel (decode_kernel), its stages named as in FlashInfer: load_q, compute_qk,
// update_softmax, compute_pv, merge_and_store. Per block:
//  * K/V by a cp.async ring: the block's keys are cut into tiles of C tokens; kDecodeStages tiles
//    are resident in shared memory, the next ones in flight while one is read, K and V of a tile in
//    separate commit groups, so the QK of tile i runs while its V is still arriving. Copies are 16
//    bytes where the view allows (the plan's copy_bytes), down to 1 byte for odd views.
//  * Page offsets once per token, not per lane: the K and V byte offsets of a tile's tokens (block
//    table lookup, division by the block size: FastDivmod, a multiply and a shift) are computed by
//    one thread per token into shared memory a tile ahead; the copies read them from there.
//  * The group spread across threads: a "token group" of TPT lanes works on one token, each lane
//    owning an 8-element chunk of the head dimension (TPT = head_size / 8 rounded up to 8, 16 or
//    32; head_size any multiple of 8 up to 256), and serves a head tile of G <= 4 heads (q and the
//    accumulators of 4 heads x 8 dims fit 128 registers); the block's token groups are divided
//    among its head tiles, each tile's groups walking the staged tile's tokens.
//  * Keys and values of their own head sizes: q / K have head_size Dk, V and out value_head_size
//    Dv <= Dk (MLA). A lane's chunks past Dk (Dv) are idle. Key heads over 256, up to 576 (MLA's
//    latent), take decode_wide_kernel: 32 lanes a token, each owning KC = 3 chunks of q / K and
//    VC = 3 of V (chunk_dim), one head per token group (plan.h decode_wide_chunks says why), and
//    ring stages of a whole 16 KB budget. When value_cache is key_cache's first Dv columns (same
//    base and strides: absorbed MLA), the wide kernel stages each latent row once and reads V from
//    the staged K rows, so a block reads each latent row from memory once for all its heads (16
//    heads: two blocks of 8 a row, next to each other on grid x, so the second reads hit L2).
//  * Softmax rescale once per step of decode_rows_per_step tokens per token group (the default tile
//    is one step), not per token.
//  * The common case compiled on its own: decode_kernel<..., kFast = true, kScoreMods> (plan.h
//    decode_fast_path: 16-byte copies, keys and values of one head size up to the lanes' 8 x TPT, any
//    block size) has none of the other cases' code in its KV loop: the copies unrolled at a constant
//    pitch, fp8 scales moved onto q and the accumulators, exp2 by one ex2.approx (exp2_approx). The
//    soft-cap and ALiBi are compiled into it only in its kScoreMods instances (Gemma 2's soft-cap,
//    ALiBi models, over any cache); the general loop (decode_kernel<..., false, true>) keeps every
//    case. Everything else (windows, sinks, lse,
//    split-KV) acts outside the loop and takes either kernel. The fast loop sums a step's dot
//    products over the token group by recursive halving (reduce_scatter_scores: each lane ends with
//    its share of the sums, the score modifiers, the row mask and the softmax's exponentials applied
//    there once per score: OwnedSoftmax; at G = 4 each lane computes its scores in its own order, so
//    the halving picks no halves) and hands every probability back by indexed shuffles (but at G = 1
//    without modifiers); the general loop's compute_qk copies every sum to every lane.
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
// normalised partial output (Dv floats) plus its (max, sum) to a float32 workspace and decode_reduce_kernel
// merges them with log-sum-exp weights. Partitions past a sequence's length exit at once.
// Partitions are aligned to multiples of partition_size from the row's first visible key's
// partition, so a given key range is always cut the same way. plan_decode (kernels/plan.h) sizes
// them from the device's SM count: a grid short of kDecodeFillBlocksPerSM blocks per SM is cut into
// partitions down to two pages; the batch-invariant mode keeps its constant size. On sm_90 a row's
// partitions may instead be one thread-block cluster (plan_cluster_merge: sh.cluster_blocks), whose
// blocks push their partials into each other's shared memory and merge them there (push_partial,
// merge_and_store's phase 1): no workspace, no reduce kernel; its empty partitions stay to the merge.
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
// score in the log2 domain. The slopes are read per key rather than held in G registers beside the
// group-8 kernel's q and accumulators, from the block's copy in shared memory (block_alibi_slopes):
// a global load per key and head would stall the warp's in-order issue a memory latency each (the
// general loop's 8-14 dependent rounds in bench/sass.py's model before it took the copy too).
template <int G>
struct ScoreMod {
  float cap, cap_log2, inv_cap;  // softcap, softcap * log2(e), 1 / softcap; cap = 0: none
  const float* slopes;           // ALiBi slopes of heads head0 .. head0 + G - 1; nullptr: none
  int pos;
  __device__ __forceinline__ void init(const AttentionParams& p, int head0, int position) {
    cap = p.softcap;
    cap_log2 = p.softcap * kLog2e;
    inv_cap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
    slopes = p.alibi_slopes ? p.alibi_slopes + head0 : nullptr;
    pos = position;
  }
  // s: the G heads' scores of key t. kFastTanh (the fast loop's 16-bit queries): common.cuh tanh_fast
  // (ex2.approx and a division, a series near 0) rather than tanhf's polynomial and branches. (The
  // exponential form alone, common.cuh SoftCapByExp, is five instructions, but its absolute error of a
  // few 1e-7 of the cap swamps every score at a cap of 2^126, which the contract allows:
  // tests/test_cuda_contract_edges.py test_softcap_at_its_bounds. The pipelined prefill takes it for caps
  // up to plan.h kMaxSoftcapByExp and leaves larger ones to another kernel; here a score's owner caps
  // one or two scores a step, so one loop keeps every cap.)
  // One score, of head g (< gcount) and key t: apply's arithmetic for one head.
  template <bool kFastTanh>
  __device__ __forceinline__ float apply_one(float s, int g, int t) const {
    if (cap > 0.f) s = cap_log2 * (kFastTanh ? tanh_fast(s * inv_cap) : tanhf(s / cap));
    if (slopes) s += slopes[g] * (float(t - pos) * kLog2e);
    return s;
  }
  template <bool kFastTanh = false>
  __device__ __forceinline__ void apply(float (&s)[G], int t, int gcount) const {
    if (cap > 0.f) {
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g < gcount) s[g] = cap_log2 * (kFastTanh ? tanh_fast(s[g] * inv_cap) : tanhf(s[g] / cap));
    }
    if (slopes) {
      const float distance = float(t - pos) * kLog2e;  // (j - p) log2(e); j - p exact below 2^24
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g < gcount) s[g] += slopes[g] * distance;
    }
  }
};

// The block's copy of its query heads' ALiBi slopes (at most kMaxHeadsPerBlock), for the KV loops
// with score modifiers (decode_block): shared-memory reads in its KV loop rather than global loads.
__device__ __forceinline__ float* block_alibi_slopes() {
  __shared__ float slopes[kMaxHeadsPerBlock];
  return slopes;
}

// Lane chunks: lane `sub` of a token group owns NC 8-element chunks of a row, chunk c at dims
// d0 + c * 8 * TPT (d0 = sub * 8), so the group's lanes read 8 x TPT contiguous elements per chunk
// (conflict-free 16-byte shared-memory reads). NC = 1 up to 8 x TPT = 256 dims; the wide kernels
// (TPT 32) take KC = 3 chunks of q / K (Dk <= 768, the contract stops at 576) and VC = 2 or 3 of V
// and the accumulators (Dv <= 512 or <= 768). A chunk past the head size is idle (q and k 0, no
// value read).
template <int TPT>
__device__ __forceinline__ int chunk_dim(int d0, int c) {
  return d0 + c * 8 * TPT;
}

// This lane's KC chunks of `gcount` query heads from `head0` (head size Dk), pre-scaled
// (query_multiplier); zeros for the heads past gcount and for idle chunks. q[g] is head g ^ head_xor
// (the fast loop's scores in its own order: reduce_scatter_scores).
template <typename T, int G, int TPT, int KC>
__device__ __forceinline__ void load_q(float (&q)[G][KC * 8], const AttentionParams& p, int64_t row, int head0,
                                       int gcount, int d0, int Dk, float kscale = 1.f, int head_xor = 0) {
  const float qmul = query_multiplier(p) * kscale;  // kscale: K's fp8 scale moved onto q (the fast path)
  const T* qrow = static_cast<const T*>(p.query) + row * p.q_stride_token + d0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const int h = g ^ head_xor;
      const bool on = h < gcount && chunk_dim<TPT>(d0, c) < Dk;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        q[g][c * 8 + i] = on ? to_float(qrow[(head0 + h) * p.q_stride_head + c * 8 * TPT + i]) * qmul : 0.f;
    }
  }
}

// Scores of one token for the G heads: this lane's partial dots summed over the token group's TPT
// lanes. All G heads always (a head past the tile's count has q = 0, so score 0, never used): the
// shuffles are then warp-uniform even where two head tiles share a warp.
template <int G, int TPT>
__device__ __forceinline__ void compute_qk(const float (&q)[G][8], const float (&k)[8], float (&s)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) d += q[g][i] * k[i];
#pragma unroll
    for (int o = TPT / 2; o > 0; o >>= 1) d += __shfl_xor_sync(kFullMask, d, o);
    s[g] = d;
  }
}

// The fast loop's scores of a step, N = rows x G of them (n = row x G + head): the lane's partial
// dots v summed over the token group's TPT lanes by recursive halving, so that the sums arrive
// spread over the lanes rather than copied to every lane (compute_qk's butterfly): each xor round
// sends the half of v the partner keeps and adds the half it receives. N - 1 shuffles where the
// butterfly takes N log2(TPT), and what follows a sum (the soft-cap's tanh, ALiBi) is computed once
// per score, by its owner, rather than by all TPT lanes. After it, lane `sub` holds kOwn whole sums in
// v[0, kOwn): scores [first_owned_score(sub), + kOwn); with N < TPT, TPT / N lanes hold each one.
// kInOwnOrder: the lane computed score n into v[n ^ first_owned_score(sub)], so every round keeps the
// lower half and sends the upper (the partner's upper half is this lane's lower: their orders differ
// in the round's bit) and no select picks the halves (two a shuffle otherwise).
template <int TPT, int N>
constexpr int kOwnedScores = N >= TPT ? N / TPT : 1;
template <int TPT, int N>
__device__ __forceinline__ int first_owned_score(int sub) {
  return N >= TPT ? sub * (N / TPT) : sub / (TPT / N);
}
// The lane of the token group that holds score n (the first of its holders where TPT / N hold each).
template <int TPT, int N>
constexpr int score_owner(int n) {
  return N >= TPT ? n / kOwnedScores<TPT, N> : n * (TPT / N);
}
template <int TPT, int N, bool kInOwnOrder, int kOffset = TPT / 2, int kLeft = N>
__device__ __forceinline__ void reduce_scatter_scores(float (&v)[N], int sub) {
  if constexpr (kOffset > 0) {
    constexpr int h = kLeft > 1 ? kLeft / 2 : 1;
    if constexpr (kLeft > 1) {
      const bool upper = !kInOwnOrder && (sub & kOffset) != 0;
#pragma unroll
      for (int j = 0; j < h; ++j) {
        const float send = upper ? v[j] : v[j + h];
        const float keep = upper ? v[j + h] : v[j];
        v[j] = keep + __shfl_xor_sync(kFullMask, send, kOffset);
      }
    } else {
      v[0] += __shfl_xor_sync(kFullMask, v[0], kOffset);
    }
    reduce_scatter_scores<TPT, N, kInOwnOrder, kOffset / 2, h>(v, sub);
  }
}
// Every lane gets every score (or probability) back from its owner: N indexed shuffles within the
// token group.
template <int TPT, int N>
__device__ __forceinline__ void gather_scores(const float (&v)[N], float (&s)[N]) {
  constexpr int kOwn = kOwnedScores<TPT, N>;
#pragma unroll
  for (int n = 0; n < N; ++n)
    s[n] = __shfl_sync(kFullMask, v[n % kOwn], score_owner<TPT, N>(n), TPT);
}

// The max a fast-path softmax step subtracts (OnlineSoftmax::update_softmax<kFast>, OwnedSoftmax): 0
// while the head has seen nothing finite, so ex2.approx's ex2(-inf) = +0 makes its -inf scores and its
// first rescale 0 with one test a head rather than one a score.
__device__ __forceinline__ float fast_softmax_base(float mn) { return mn == -INFINITY ? 0.f : mn; }

// The fast loop's online softmax by the scores' owners (after reduce_scatter_scores; update_softmax's
// rules). Per owned score: its head's max over the step's rows (the owners of one head's rows differ in
// the lane bits from kRowLanes = G x TPT / N up: two shuffles at G = 4 over 16 lanes), the running max m
// and sum l of the score's head (the same m on every owner of that head; l over the lane's own rows),
// and the score turned into its probability: one exponential a score rather than one a score on every
// lane of the token group. rescale[g], on every lane, is head g's factor for the accumulators, from the
// owner of score g (row 0). finish gives every lane each head's m and l (l summed over its owners).
template <int TPT, int N, int G>
struct OwnedSoftmax {
  static constexpr int kOwn = kOwnedScores<TPT, N>, kRowLanes = G * TPT / N;
  static_assert(kOwn <= G, "a lane's scores are of one row");
  float m[kOwn], l[kOwn];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int j = 0; j < kOwn; ++j) m[j] = -INFINITY, l[j] = 0.f;
  }
  __device__ __forceinline__ void update(float (&v)[N], float (&rescale)[G]) {
    float a[kOwn];
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
      float mx = v[j];
#pragma unroll
      for (int o = kRowLanes; o < TPT; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      const float mn = fmaxf(m[j], mx);
      const float base = fast_softmax_base(mn);
      a[j] = exp2_approx(m[j] - base);
      v[j] = exp2_approx(v[j] - base);
      l[j] = l[j] * a[j] + v[j];
      m[j] = mn;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) rescale[g] = __shfl_sync(kFullMask, a[g % kOwn], score_owner<TPT, N>(g), TPT);
  }
  __device__ __forceinline__ void finish(float (&head_m)[G], float (&head_l)[G]) {
#pragma unroll
    for (int j = 0; j < kOwn; ++j) {
#pragma unroll
      for (int o = kRowLanes; o < TPT; o *= 2) l[j] += __shfl_xor_sync(kFullMask, l[j], o);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      head_m[g] = __shfl_sync(kFullMask, m[g % kOwn], score_owner<TPT, N>(g), TPT);
      head_l[g] = __shfl_sync(kFullMask, l[g % kOwn], score_owner<TPT, N>(g), TPT);
    }
  }
};

// The same over KC chunks (the wide kernels): the staged key row `krow`'s chunks one by one (only one
// chunk of k is live), the partial dots summed over the chunks, then over the TPT lanes. An invalid
// row (or idle chunk) reads nothing and counts as k = 0.
template <typename KV, int G, int TPT, int KC>
__device__ __forceinline__ void compute_qk_chunks(const float (&q)[G][KC * 8], const unsigned char* krow, int d0,
                                                  int Dk, bool valid, float kscale, float (&s)[G]) {
  float d[G];
#pragma unroll
  for (int g = 0; g < G; ++g) d[g] = 0.f;
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    float k[8];
    if (valid && chunk_dim<TPT>(d0, c) < Dk) {
      load8(reinterpret_cast<const KV*>(krow) + chunk_dim<TPT>(d0, c), k, true, kscale);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) k[e] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) d[g] += q[g][c * 8 + i] * k[i];
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int o = TPT / 2; o > 0; o >>= 1) d[g] += __shfl_xor_sync(kFullMask, d[g], o);
    s[g] = d[g];
  }
}

// Per-lane online softmax state of G heads over this lane's VC chunks of the value dims: running
// max m and sum l (log2 domain) and the unnormalised output accumulators.
template <int G, int VC = 1>
struct OnlineSoftmax {
  float m[G], l[G], acc[G][VC * 8];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int i = 0; i < VC * 8; ++i) acc[g][i] = 0.f;
    }
  }
  // Folds one step's scores (R tokens of this token group; -inf for rows it does not have) into the
  // running max and sum, rescales the accumulators once to the new max, and turns s into the
  // tokens' probabilities. A NaN score gives NaN probabilities (and so a NaN row), as in the
  // reference; a -inf score (an infinite query or key, or no row) has probability 0, not
  // exp2(-inf - -inf) = NaN while the row has seen nothing finite yet.
  // kFast (decode_kernel's fast path): the same by exp2_approx, the -inf cases by fast_softmax_base
  // (the first rescale comes out 0: the accumulators are 0 then).
  template <bool kFast = false, int R>
  __device__ __forceinline__ void update_softmax(float (&s)[R][G]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int r = 0; r < R; ++r) mn = fmaxf(mn, s[r][g]);
      float a, sum = 0.f;
      if constexpr (kFast) {
        const float base = fast_softmax_base(mn);
        a = exp2_approx(m[g] - base);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s[r][g] = exp2_approx(s[r][g] - base);
          sum += s[r][g];
        }
      } else {
        // 0 at the first finite score (m = -inf); 1 while none (-inf - -inf would be NaN)
        a = mn == -INFINITY ? 1.f : exp2f(m[g] - mn);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s[r][g] = s[r][g] == -INFINITY ? 0.f : exp2f(s[r][g] - mn);
          sum += s[r][g];
        }
      }
      l[g] = l[g] * a + sum;
      scale_acc(g, a);
      m[g] = mn;
    }
  }
  // acc[g] *= a: a rescale to a new max, or the fp8 V scale the fast path applies at the end.
  __device__ __forceinline__ void scale_acc(int g, float a) {
#pragma unroll
    for (int i = 0; i < VC * 8; ++i) acc[g][i] *= a;
  }
  // acc += p * v for the token's probabilities p (update_softmax's output) and chunk c of its value
  // row, v.
  __device__ __forceinline__ void compute_pv(const float (&pr)[G], const float (&v)[8], int c = 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][c * 8 + i] += pr[g] * v[i];
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
  float* cluster_inbox;  // non-null: the split partial is pushed to the cluster's inboxes (push_partial)
};

// A row that sees no key (one pass: the block's heads head0 .. head0 + nheads - 1): out 0 (its Dv
// columns) and lse -inf, or the sink's (finish_softmax). Every thread of the block calls it, then
// the block exits.
template <typename T>
__device__ __forceinline__ void store_empty_row(const AttentionParams& p, int64_t row, int head0, int nheads) {
  const int D = int(p.value_head_size);
  for (int idx = threadIdx.x; idx < nheads * D; idx += blockDim.x) {
    const int head = head0 + idx / D, d = idx % D;
    const RowEnd<float> e = finish_softmax(p, -INFINITY, 0.f, head);
    static_cast<T*>(p.out)[row * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(0.f * e.mul);
    if (p.lse && d == 0) p.lse[row * int(p.num_heads) + head] = e.lse;
  }
}

// A block's partial of (head h, column d) in a thread-block cluster (plan.h plan_cluster_merge: the
// row's partitions are the cluster's blocks, partition = rank): pushed into the inbox of the block that
// merges that pair, block `rank` of n merging the pairs [rank x share, (rank + 1) x share) of the
// block's heads x Dv (plan.h cluster_share): `a` (the unnormalised output) at [part][pair - its first],
// and with d = 0 the head's (max, sum) at [part][h] after them, to every block merging a column of it.
// merge_and_store then merges its own pairs from its inbox.
__device__ __forceinline__ void push_partial(float* inbox, int part, int nheads, int D, int h, int d, float a,
                                             float m, float l) {
  const int n = int(gridDim.z), share = cluster_share(nheads, D, n), idx = h * D + d, owner = idx / share;
  cluster_shared_of(inbox, unsigned(owner))[part * share + idx - owner * share] = a;
  if (d == 0) {
    for (int r = owner; r <= (idx + D - 1) / share; ++r) {
      float* const to = cluster_shared_of(inbox, unsigned(r)) + size_t(n) * share + (part * nheads + h) * 2;
      to[0] = m;
      to[1] = l;
    }
  }
}

// Merges the token groups' states through shared memory `sm` (merge_floats(ntg, gstride, Dv)) and
// writes the block's `nheads` heads from `head0` (their Dv output columns). Token groups are
// numbered tile-major: the head tile t (block heads [t * gstride, (t + 1) * gstride)) is served by
// token groups [t * ntg_tile, (t + 1) * ntg_tile). Has a __syncthreads: every thread of the block
// calls it.
template <typename T, int G, int TPT, int VC>
__device__ __forceinline__ void merge_and_store(const AttentionParams& p, const OnlineSoftmax<G, VC>& st, float* sm,
                                                int ntg, int ntg_tile, int gstride, int tg, int gcount, bool lead,
                                                int d0, int head0, int nheads, const Dest& o) {
  const int D = int(p.value_head_size), num_heads = int(p.num_heads);
  float* sml = sm;
  float* sacc = sm + size_t(ntg) * gstride * 2;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < gcount) {
      if (lead) {
        sml[(tg * gstride + g) * 2] = st.m[g];
        sml[(tg * gstride + g) * 2 + 1] = st.l[g];
      }
#pragma unroll
      for (int c = 0; c < VC; ++c) {
        if (chunk_dim<TPT>(d0, c) < D) {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            sacc[size_t(tg * gstride + g) * D + chunk_dim<TPT>(d0, c) + i] = st.acc[g][c * 8 + i];
        }
      }
    }
  }
  __syncthreads();
  // Phase 0 merges the block's token groups; in a cluster (o.cluster_inbox), phase 1 merges the row's
  // partitions that the blocks pushed into this block's inbox (push_partial), after the cluster
  // barrier that makes the pushes visible: the same arithmetic over other sources (one loop body, so
  // the kernels hold it once), the partitions in order (blocks past the row's keys pushed a sum of 0,
  // which adds nothing). No barrier after phase 1: nothing reads another block's shared
  // memory then, so a block may exit while the others still merge (a pull of the partials would need
  // the remote loads and a second barrier before anybody exits).
  const int n = int(gridDim.z);  // in a cluster, the cluster: the row's partitions on grid z
  const int share = o.cluster_inbox ? cluster_share(nheads, D, n) : 0;
#pragma unroll 1
  for (int phase = 0; phase < (o.cluster_inbox ? 2 : 1); ++phase) {
    int first = 0, count = nheads * D;
    if (phase == 1) {
      cluster_barrier();  // every block's pushes have landed
      first = int(cluster_block_rank()) * share;
      count = min(share, nheads * D - first);
    }
    for (int k = threadIdx.x; k < count; k += blockDim.x) {
      const int idx = first + k, h = idx / D, d = idx % D;
      // The sources: (max, sum) at ml + j x ml_step, accumulators at acc + j x acc_step, j < sources.
      const float *ml, *acc;
      size_t ml_step, acc_step;
      int sources;
      if (phase == 0) {
        const int g = h % gstride, j0 = (h / gstride) * ntg_tile;
        ml = sml + size_t(j0 * gstride + g) * 2, ml_step = size_t(gstride) * 2;
        acc = sacc + size_t(j0 * gstride + g) * D + d, acc_step = size_t(gstride) * D;
        sources = ntg_tile;
      } else {
        ml = o.cluster_inbox + size_t(n) * share + size_t(h) * 2, ml_step = size_t(nheads) * 2;
        acc = o.cluster_inbox + k, acc_step = size_t(share);
        sources = n;
      }
      float M = -INFINITY;
      for (int j = 0; j < sources; ++j) M = fmaxf(M, ml[j * ml_step]);
      float L = 0.f, A = 0.f;
      for (int j = 0; j < sources; ++j) {
        const float lj = ml[j * ml_step + 1];
        if (lj == 0.f) continue;  // a token group or partition that saw no token (its max is -inf)
        const float w = exp2f(ml[j * ml_step] - M);
        L += w * lj;
        A += w * acc[j * acc_step];
      }
      const int head = head0 + h;
      if (!o.split || phase == 1) {
        const RowEnd<float> e = finish_softmax(p, M, L, head);  // L = 0: no finite score (out 0)
        static_cast<T*>(p.out)[o.row * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(A * e.mul);
        if (p.lse && d == 0) p.lse[o.row * num_heads + head] = e.lse;
      } else if (o.cluster_inbox) {
        push_partial(o.cluster_inbox, o.part, nheads, D, h, d, A, M, L);
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
}

// ---- the KV loop: a cp.async ring of staged tiles ------------------------------------------------
// What one block's threads do in the ring (constant over the KV loop, from the plan's shape).
struct TileCopy {
  int units;          // copies per row (K row bytes / copy_bytes; V rows, Dv <= Dk, take K's layout)
  int row0, row_step;  // this thread's first row of a tile and its stride (row_step rows per pass)
  int unit0, unit_step;
  bool idle;          // threads past rows_per_pass x units copy nothing
  __device__ __forceinline__ void init(int row_bytes, int copy_bytes) {
    units = row_bytes / copy_bytes;
    const int threads = blockDim.x, tid = threadIdx.x;
    if (units <= threads) {  // a pass copies threads / units whole rows, one unit per thread
      row_step = threads / units;
      row0 = tid / units;
      unit0 = tid - row0 * units;
      unit_step = units;
      idle = row0 >= row_step;
    } else {  // a row takes several units per thread
      row_step = 1;
      row0 = 0;
      unit0 = tid;
      unit_step = threads;
      idle = false;
    }
  }
};

// Copies rows [0, n) of a tile, row r from `src` + offsets[2 r + which] bytes, to `dst` + r x
// pitch, `units` copies a row (tc.units for K, fewer for a narrower V). Bytes is a constant where the view
// allows 16 (the fast path; copy_async folds to one cp.async.cg), else the plan's width.
template <int kBytes>
__device__ __forceinline__ void copy_tile_rows(unsigned char* dst, const char* src, const int64_t* offsets, int which,
                                               int n, int pitch, const TileCopy& tc, int bytes, int units) {
  if (tc.idle) return;
  const int cb = kBytes > 0 ? kBytes : bytes;
  for (int r = tc.row0; r < n; r += tc.row_step) {
    const char* s = src + offsets[2 * r + which];
    unsigned char* d = dst + size_t(r) * pitch;
    for (int u = tc.unit0; u < units; u += tc.unit_step) copy_async(d + u * cb, s + u * cb, cb);
  }
}

// The fast path's copy of rows [0, n) of a tile (plan.h decode_fast_path): rows staged kUnits 16-byte
// units apart (the lanes' width), of which the head's `units` <= kUnits are copied, one unit a thread
// (kUnits <= threads, so a pass covers threads / kUnits whole rows) and at most kPasses rows per
// thread, so the loop is unrolled (bench/sass.py then counts every copy of an iteration) and the
// layout is recomputed from threadIdx rather than held in registers.
template <int kPasses, int kUnits>
__device__ __forceinline__ void copy_tile_rows_fixed(unsigned char* dst, const char* src, const int64_t* offsets,
                                                     int which, int n, int units) {
  const int tid = int(threadIdx.x), rows_per_pass = int(blockDim.x) / kUnits;
  const int row0 = tid / kUnits, unit = tid % kUnits;
  if (row0 >= rows_per_pass || unit >= units) return;  // threads past the last whole row, or the row's end
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = row0 + i * rows_per_pass;
    if (r < n) copy_async(dst + size_t(r) * (kUnits * 16) + unit * 16, src + offsets[2 * r + which] + unit * 16, 16);
  }
}

// The fast loop's staged K rows are its lanes' width (pitch bytes) and a head may be narrower (80, 96 or
// 112 on 16 lanes): the copies leave each row's tail [row_bytes, pitch) unwritten, and the lanes past
// the head multiply their q of 0 into it, so it is zeroed once, in every stage, before the ring starts
// (no copy writes it). V's tails are not read (compute_pv skips lanes past Dv).
__device__ __forceinline__ void zero_row_tails(unsigned char* ring, int stage_bytes, int C, int pitch, int row_bytes) {
  if (row_bytes == pitch) return;
  for (int i = threadIdx.x; i < kDecodeStages * C; i += blockDim.x) {
    const int stage = i / C;
    unsigned char* row = ring + size_t(stage) * stage_bytes + size_t(i - stage * C) * pitch;
    for (int b = row_bytes; b < pitch; b += 16) *reinterpret_cast<uint4*>(row + b) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// K and V byte offsets of tokens [t0, t0 + n) (n <= C) into `offsets` ([C][2]): one thread per
// token, one block-table lookup and one FastDivmod (a multiply and a shift, any block size) each.
template <typename KV>
__device__ __forceinline__ void locate_tile(int64_t* offsets, const PagedKV<KV>& K, const PagedKV<KV>& V, int t0,
                                            int n, const FastDivmod& by_block) {
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const int t = t0 + r;
    const int blk_idx = by_block.div(t), off = by_block.mod(t);
    const int64_t blk = K.block_table[blk_idx];
    offsets[2 * r] = (blk * K.stride_block + int64_t(off) * K.stride_token) * int64_t(sizeof(KV));
    offsets[2 * r + 1] = (blk * V.stride_block + int64_t(off) * V.stride_token) * int64_t(sizeof(KV));
  }
}

// Token rows a token group takes per step of decode_kernel<T, KV, TPT, G> (one rescale a step).
// sm_80 / 86 / 89 allocate G = 4 tighter: the scores of even two rows a step spill 8-16 B there at
// the 128-register cap (cuobjdump -res-usage), one row a step does not.
template <int G, typename KV>
PAGED_HOST_DEVICE constexpr int decode_kernel_rows_per_step() {
  return PAGED_TARGET_ARCH < 900 && G == kMaxHeadsPerThread ? 1 : decode_rows_per_step(int(sizeof(KV)));
}
// The same for decode_wide_kernel<T, KV, G, KC, VC> (plan.h decode_wide_rows_per_step).
template <typename KV>
PAGED_HOST_DEVICE constexpr int decode_wide_kernel_rows_per_step() {
  return decode_wide_rows_per_step(int(sizeof(KV)));
}

// One block of the decode kernels (decode_kernel, decode_wide_kernel below): TPT lanes per token,
// G heads per token group, KC chunks of q / K and VC chunks of V per lane (chunk_dim), kRows token
// rows per step. sh: the launch shape (plan_decode, kernels/plan.h). kFast: the plan's fast_path
// (plan.h decode_fast_path: 16-byte copies, one head size for K and V), so the KV loop is compiled without
// the code of the other cases; kScoreMods: the soft-cap and ALiBi are compiled in (always in the
// general loop; in the fast one where the plan's score_mods says so).
template <typename T, typename KV, int TPT, int G, int KC, int VC, int kRows, bool kFast, bool kScoreMods>
__device__ __forceinline__ void decode_block(const AttentionParams& p, const DecodeShape& sh, bool split,
                                             int partition_size, int num_partitions, float* tmp_out, float* tmp_ml) {
  static_assert(kFast || kScoreMods, "the general loop keeps every case");
  // AttentionParams' sizes are int64 (the cpu backend's); the binding checks they fit int, and the
  // kernel narrows them once: 64-bit division and products cost registers and instructions.
  const int group = int(p.num_heads) / int(p.num_kv_heads);
  // (row, head chunk) on x (up to 2^31 - 1; y/z stop at 65535), KV heads on y, partitions on z.
  const int64_t row = sh.n_hchunks == 1 ? int64_t(blockIdx.x) : int64_t(blockIdx.x / sh.n_hchunks);
  const int hchunk = int(blockIdx.x - row * sh.n_hchunks);
  const int kvh = blockIdx.y;
  const int part = blockIdx.z;
  const int hb = hchunk * sh.heads_per_block;  // first group-relative head of the block
  const int nheads = min(sh.heads_per_block, group - hb);
  const int head0 = kvh * group + hb;
  const RowSpan rs = row_span(p, row);
  int start, end;
  partition_keys(rs, split, partition_size, part, start, end);
  const int ntg = blockDim.x / TPT;
  PAGED_DYNAMIC_SMEM(unsigned char, smem, size_t(sh.smem_bytes));
  // A cluster block's inbox, after the ring and the merge scratch (plan.h decode_smem): computed where
  // it is used (a pointer held through the KV loop is a register the group-4 kernels do not have).
  auto cluster_inbox = [&]() -> float* {
    return sh.cluster_blocks > 1 ? reinterpret_cast<float*>(
                                       smem + decode_inbox_offset(sh, int(blockDim.x), TPT, G, int(p.value_head_size)))
                                 : nullptr;
  };
  // A split row's empty partitions write nothing (the reduce reads only the row's partitions); in a
  // cluster they go on, with no tile, to the merge: they push a partial with a sum of 0 and merge
  // their share of the others' (a merge of their own here cost the group-4 fp8 kernels a spill).
  if (start >= end && !(split && sh.cluster_blocks > 1)) {  // the whole block leaves together
    if (!split) store_empty_row<T>(p, row, head0, nheads);
    return;
  }
  const int64_t seq = rs.seq;
  const int D = int(p.head_size), Dv = int(p.value_head_size);

  // Thread layout: token group tg (TPT lanes) serves head tile `tile` (block heads [tile x G,
  // tile x G + gcount)); token groups are numbered tile-major, as merge_and_store expects. Groups
  // past the last tile (ntg not a multiple of the tile count) hold no head (gcount 0).
  constexpr int kGroupsPerWarp = 32 / TPT;
  const int lane = threadIdx.x % 32;
  const int sub = lane % TPT;
  const int tg = (threadIdx.x / 32) * kGroupsPerWarp + lane / TPT;
  const int gpt = sh.groups_per_tile;
  const int tile = tg / gpt;
  const int tg_in_tile = tg - tile * gpt;
  const int gcount = max(0, min(G, nheads - tile * G));
  const int d0 = sub * 8;  // chunk c of this lane: dims chunk_dim<TPT>(d0, c); past D (Dv): idle

  // The fast path moves the fp8 scales out of the loop: K's onto q (q . (s k) = (s q) . k), V's onto
  // the accumulators at the end; the general path multiplies every element (load8).
  const float cache_kscale = cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh);
  const float cache_vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const float kscale = kFast ? 1.f : cache_kscale, vscale = kFast ? 1.f : cache_vscale;
  float q[G][KC * 8];
  // The fast loop's scores by recursive halving (reduce_scatter_scores), computed in the lane's own
  // order at G = 4: score n = (row i, head g) of a step into v[n ^ score_xor], so q[g] holds head
  // g ^ (score_xor % G) and row slot i reads row i ^ (score_xor / G) (G and the step's rows are powers of
  // two). Not at G = 1, whose rows' permuted addresses cost more than the selects they save, nor at
  // G = 2, where they save 1% of the loop and take fp8 caches past 96 registers (occupancy 31.25% ->
  // 25%).
  constexpr bool kHalving = kFast && (G > 1 || kScoreMods), kInOwnOrder = kHalving && G > 2;
  const int first_owned = first_owned_score<TPT, kRows * G>(sub), score_xor = kInOwnOrder ? first_owned : 0;
  load_q<T, G, TPT, KC>(q, p, row, head0 + tile * G, gcount, d0, D, kFast ? cache_kscale : 1.f, score_xor % G);
  ScoreMod<G> mod;
  if constexpr (kScoreMods) mod.init(p, head0 + tile * G, rs.pos);
  if constexpr (kScoreMods) {
    if (p.alibi_slopes) {  // visible after the barrier before the KV loop
      float* const slopes = block_alibi_slopes();
      for (int h = threadIdx.x; h < nheads; h += blockDim.x) slopes[h] = p.alibi_slopes[head0 + h];
      mod.slopes = slopes + tile * G;
    }
  }
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);

  // Shared memory: [kDecodeStages][C][2] int64 offsets, then per stage (sh.stage_bytes) C K rows
  // and, sh.v_rows bytes after them, C V rows; sh.v_rows = 0: V is the first Dv columns of K's rows
  // (one latent, absorbed MLA), read from the staged K rows and never copied itself.
  // The fast path stages rows at its lanes' 8 x TPT elements (plan.h decode_fast_path): a constant pitch.
  const int C = sh.tile_tokens, pitch = kFast ? 8 * TPT * int(sizeof(KV)) : sh.pitch;
  int64_t* const offsets = reinterpret_cast<int64_t*>(smem);
  unsigned char* const ring = smem + decode_offsets_bytes(C);
  const char* const kbase = reinterpret_cast<const char*>(K.base);
  const char* const vbase = reinterpret_cast<const char*>(V.base);
  // The copy layout: held in registers through the KV loop, or (wide kernels, whose q and
  // accumulators leave no room for it at the register cap) recomputed per tile.
  TileCopy tc_held;
  if constexpr (KC == 1 && !kFast) tc_held.init(D * int(sizeof(KV)), sh.copy_bytes);
  const bool wide = kFast || sh.copy_bytes == 16;
  const bool copy_v = sh.v_rows != 0;

  const int ntiles = ceil_div(end - start, C);  // block-uniform: every thread meets every barrier
  auto tile_rows = [&](int j) { return j < ntiles ? min(C, end - (start + j * C)) : 0; };
  auto locate = [&](int j) {
    if (j < ntiles)
      locate_tile<KV>(offsets + size_t(j % kDecodeStages) * 2 * C, K, V, start + j * C, tile_rows(j), sh.by_block);
  };
  // Tile j's K rows, then its V rows, into stage j % kDecodeStages: two commit groups always (empty
  // past the last tile, and the V one when V is read from K's rows), so the wait counts below hold
  // to the end. Nothing at or past `end` is read.
  auto issue = [&](int j) {
    const int stage = j % kDecodeStages, n = tile_rows(j);
    const int64_t* off = offsets + size_t(stage) * 2 * C;
    TileCopy tc = tc_held;
    if constexpr (KC > 1 && !kFast) tc.init(D * int(sizeof(KV)), sh.copy_bytes);
    unsigned char* kdst = ring + size_t(stage) * sh.stage_bytes;
    unsigned char* vdst = kdst + sh.v_rows;
    constexpr int kFastUnits = TPT * int(sizeof(KV)) / 2;  // 8 x TPT elements a row, 16 bytes a unit
    if constexpr (kFast)
      copy_tile_rows_fixed<kFastCopyPasses, kFastUnits>(kdst, kbase, off, 0, n, D * int(sizeof(KV)) / 16);
    else if (wide) copy_tile_rows<16>(kdst, kbase, off, 0, n, pitch, tc, 16, tc.units);
    else copy_tile_rows<0>(kdst, kbase, off, 0, n, pitch, tc, sh.copy_bytes, tc.units);
    cp_async_commit();
    // V rows of Dv elements (their copy count recomputed here rather than held in a register). The
    // narrow kernels always copy them (the plan reads V from K's rows in the wide ones only): a
    // run-time branch here lengthens their loop's dependent-load chain (bench/sass.py: 20 rather than 18
    // rounds on sm_90 at G = 4).
    if (KC == 1 || copy_v) {
      const int vrow_bytes = Dv * int(sizeof(KV));
      if constexpr (kFast) copy_tile_rows_fixed<kFastCopyPasses, kFastUnits>(vdst, vbase, off, 1, n, vrow_bytes / 16);
      else if (wide) copy_tile_rows<16>(vdst, vbase, off, 1, n, pitch, tc, 16, vrow_bytes / 16);
      else copy_tile_rows<0>(vdst, vbase, off, 1, n, pitch, tc, sh.copy_bytes, vrow_bytes / sh.copy_bytes);
    }
    cp_async_commit();
  };

  OnlineSoftmax<G, VC> st;  // its m and l: OwnedSoftmax's in the fast loop's halving, until the merge
  st.init();
  OwnedSoftmax<TPT, kRows * G, G> owned;
  owned.init();
  // Token rows of a tile per token group, in steps of kRows (one rescale a step).
  const int rows_per_group = ceil_div(C, gpt);
  for (int j = 0; j < kDecodeStages; ++j) locate(j);
  if constexpr (kFast) zero_row_tails(ring, sh.stage_bytes, C, pitch, D * int(sizeof(KV)));
  __syncthreads();  // the first tiles' offsets, for every thread's copies
  for (int j = 0; j < kDecodeStages - 1; ++j) issue(j);
  // In a cluster: every block has started, so its inbox may be written (push_partial); here, while
  // the first tiles are in flight, the barrier's latency hides behind theirs.
  if (sh.cluster_blocks > 1) cluster_barrier();
  for (int c = 0; c < ntiles; ++c) {
    // Groups in flight after K(c): V(c) and the 2 x (kDecodeStages - 2) of the tiles after it.
    cp_async_wait<2 * kDecodeStages - 3>();
    // K(c) is in shared memory for everybody; every thread is done with tile c - 1 (its stage is
    // free for tile c + kDecodeStages - 1) and with the offsets of tile c (rewritten below).
    __syncthreads();
    issue(c + kDecodeStages - 1);  // its offsets were written before the last barrier
    locate(c + kDecodeStages);     // into tile c's offset slot, read when tile c was issued
    const unsigned char* kt = ring + size_t(c % kDecodeStages) * sh.stage_bytes;
    const unsigned char* vt = kt + sh.v_rows;
    const int t0 = start + c * C, n = tile_rows(c);
    for (int i0 = 0; i0 < rows_per_group; i0 += kRows) {  // block-uniform bound
      float s[kRows][G];
      if constexpr (kHalving) {
        // Partial dots of every row, their sums spread over the token group, the score modifiers, the
        // mask and the softmax on the lane's own sums (OwnedSoftmax), every probability back to every
        // lane (reduce_scatter_scores, gather_scores). Not at G = 1
        // without modifiers: a handful of shuffles saved there, and every row's partial dots live at
        // once cost 20-odd registers (an fp8 cache's occupancy 43.8% -> 31.2% on sm_90).
        constexpr int N = kRows * G;
        float v[N];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          // Every row is read, a row past the tile's (r >= n: a stale or never-written row of the stage,
          // no copy in flight to it) too: its sums stay in its own scores, which become -inf below, so
          // no branch and no zeroed k; clamped to the stage's last row, which no step passes by more
          // than kRows x groups_per_tile rows.
          const int r = min(tg_in_tile + (i0 + (i ^ score_xor / G)) * gpt, C - 1);
          float k[8];
          load8(reinterpret_cast<const KV*>(kt + size_t(r) * pitch) + d0, k, true, kscale);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) d += q[g][e] * k[e];
            v[i * G + g] = d;
          }
        }
        reduce_scatter_scores<TPT, N, kInOwnOrder>(v, sub);
        // The owner's scores: the modifiers, then -inf where the row is past the tile or the head past
        // gcount (once a score here, not once a score on every lane after the gather).
#pragma unroll
        for (int j = 0; j < kOwnedScores<TPT, N>; ++j) {
          const int i = (first_owned + j) / G, g = (first_owned + j) % G, r = tg_in_tile + (i0 + i) * gpt;
          if constexpr (kScoreMods) {
            if (g < gcount) v[j] = mod.template apply_one<sizeof(T) == 2>(v[j], g, t0 + r);
          }
          v[j] = g < gcount && i0 + i < rows_per_group && r < n ? v[j] : -INFINITY;
        }
        // The owners' softmax, then every probability back to every lane for P V.
        float rescale[G];
        owned.update(v, rescale);
#pragma unroll
        for (int g = 0; g < G; ++g) st.scale_acc(g, rescale[g]);
        float all[N];
        gather_scores<TPT, N>(v, all);
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
          for (int g = 0; g < G; ++g) s[i][g] = all[i * G + g];
      } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = tg_in_tile + (i0 + i) * gpt;
        const bool valid = gcount > 0 && i0 + i < rows_per_group && r < n;
        // every lane computes: the shuffles need the whole warp
        if constexpr (KC == 1) {
          float k[8];
          if (valid && d0 < D) {
            load8(reinterpret_cast<const KV*>(kt + size_t(r) * pitch) + d0, k, true, kscale);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) k[e] = 0.f;
          }
          compute_qk<G, TPT>(q, k, s[i]);
        } else {
          compute_qk_chunks<KV, G, TPT, KC>(q, kt + size_t(r) * pitch, d0, D, valid, kscale, s[i]);
        }
        if (valid) {
          if constexpr (kScoreMods) mod.template apply<kFast && sizeof(T) == 2>(s[i], t0 + r, gcount);
        } else {
#pragma unroll
          for (int g = 0; g < G; ++g) s[i][g] = -INFINITY;
        }
      }
      }
      if constexpr (!kHalving) st.template update_softmax<kFast>(s);
      if (i0 == 0) {
        cp_async_wait<2 * kDecodeStages - 2>();  // V(c) landed (tile c + kDecodeStages - 1 may fly)
        __syncthreads();                         // ... for everybody
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = tg_in_tile + (i0 + i) * gpt;
        if (gcount > 0 && i0 + i < rows_per_group && r < n) {
#pragma unroll
          for (int vc = 0; vc < VC; ++vc) {
            if (chunk_dim<TPT>(d0, vc) < Dv) {
              float v[8];
              load8(reinterpret_cast<const KV*>(vt + size_t(r) * pitch) + chunk_dim<TPT>(d0, vc), v, true, vscale);
              st.compute_pv(s[i], v, vc);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups are left; none may be in flight at exit
  __syncthreads();     // the ring is idle: the merge scratch reuses it
  if constexpr (kHalving) owned.finish(st.m, st.l);
  if constexpr (kFast && sizeof(KV) == 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) st.scale_acc(g, cache_vscale);
  }

  merge_and_store<T, G, TPT, VC>(p, st, reinterpret_cast<float*>(smem), ntg, gpt, G, tg, gcount, sub == 0, d0, head0,
                                 nheads, Dest{row, part, num_partitions, split, tmp_out, tmp_ml, cluster_inbox()});
}

// Head sizes up to 256 (Dk and Dv): one chunk per lane. G heads per token group (1, 2, 4), TPT
// lanes per token; kFast, kScoreMods: the plan's fast_path and score_mods (decode_block; the general
// loop is <..., false, true>). __launch_bounds__(256, 2): at most 128 registers a thread, so four
// 128-thread blocks (16 warps, 25% occupancy) are resident per SM.
template <typename T, typename KV, int TPT, int G, bool kFast, bool kScoreMods>
__global__ void __launch_bounds__(256, 2) decode_kernel(AttentionParams p, DecodeShape sh, bool split,
                                                         int partition_size, int num_partitions, float* tmp_out,
                                                         float* tmp_ml) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  decode_block<T, KV, TPT, G, 1, 1, decode_kernel_rows_per_step<G, KV>(), kFast, kScoreMods>(
      p, sh, split, partition_size, num_partitions, tmp_out, tmp_ml);
}

// Key heads over 256 (MLA's 576-wide latent): 32 lanes a token, KC chunks of q / K and VC of V per
// lane (plan.h decode_wide_chunks: one instantiation, G = 1, KC = VC = 3, per dtype pair). The same
// block, register cap and ring as decode_kernel.
template <typename T, typename KV, int G, int KC, int VC>
__global__ void __launch_bounds__(256, 2) decode_wide_kernel(AttentionParams p, DecodeShape sh, bool split,
                                                              int partition_size, int num_partitions, float* tmp_out,
                                                              float* tmp_ml) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  decode_block<T, KV, 32, G, KC, VC, decode_wide_kernel_rows_per_step<KV>(), false, true>(
      p, sh, split, partition_size, num_partitions, tmp_out, tmp_ml);
}

// Log-sum-exp merge of the split-KV partials of one (row, query head), in one fixed order (partition
// 0, 1, ...), adding the head's sink once (finish_softmax); writes the output and the lse. Every
// thread computes the partitions' weights itself (no shared memory, so no bound on the partition
// count) in the same order, so all of them see the same L. Only the row's own partitions were
// written (none for a row that sees no key: out 0, lse -inf or the sink's). Rows of Dv floats.
template <typename T>
__global__ void __launch_bounds__(128) decode_reduce_kernel(AttentionParams p, int partition_size, int num_partitions,
                                                            const float* tmp_out, const float* tmp_ml) {
  PAGED_LAUNCH_BOUNDS_CHECK(128);
  const int64_t row = blockIdx.x;
  const int head = blockIdx.y;
  const int D = int(p.value_head_size), num_heads = int(p.num_heads);
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
  float* tmp_ml =
      workspace ? workspace + size_t(pl.num_rows) * p.num_heads * pl.num_partitions * p.value_head_size : nullptr;
  const dim3 grid(unsigned(pl.grid_x), pl.grid_y, pl.grid_z);
  dispatch_float(DType(p.dtype), [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(DType(p.dtype), DType(p.cache_dtype), [&](auto kt) {
      using KV = typename decltype(kt)::type;
      auto run = [&](auto kernel) {
        PAGED_ALLOW_SMEM(kernel, pl.smem);
        if (pl.sh.cluster_blocks > 1)  // a row's partitions, one cluster on z (plan.h plan_cluster_merge)
          PAGED_LAUNCH_CLUSTER(kernel, grid, dim3(pl.threads), pl.smem, stream, dim3(1, 1, unsigned(pl.sh.cluster_blocks)),
                               p, pl.sh, pl.split, pl.partition_size, pl.num_partitions, tmp_out, tmp_ml);
        else
          PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.sh, pl.split, pl.partition_size,
                       pl.num_partitions, tmp_out, tmp_ml);
        PAGED_CHECK_LAUNCH("decode_kernel");
      };
      auto by_path = [&](auto tpt, auto g) {
        constexpr int TPT = decltype(tpt)::value, G = decltype(g)::value;
        if (!pl.fast_path) run(decode_kernel<T, KV, TPT, G, false, true>);
        else if (pl.score_mods) run(decode_kernel<T, KV, TPT, G, true, true>);
        else run(decode_kernel<T, KV, TPT, G, true, false>);
      };
      auto by_heads = [&](auto tpt) {
        switch (pl.heads_per_thread) {
          case 1: return by_path(tpt, std::integral_constant<int, 1>{});
          case 2: return by_path(tpt, std::integral_constant<int, 2>{});
          default: return by_path(tpt, std::integral_constant<int, kMaxHeadsPerThread>{});
        }
      };
      if (pl.k_chunks > 1) {  // key heads over 256: plan.h decode_wide_chunks' one shape
        if (pl.heads_per_thread == 1 && pl.k_chunks == 3 && pl.v_chunks == 3) run(decode_wide_kernel<T, KV, 1, 3, 3>);
        else throw std::runtime_error("paged_cuda: no decode_wide_kernel for this plan");
      } else if (pl.tpt == 8) by_heads(std::integral_constant<int, 8>{});
      else if (pl.tpt == 16) by_heads(std::integral_constant<int, 16>{});
      else by_heads(std::integral_constant<int, 32>{});
    });
    if (pl.split && pl.sh.cluster_blocks <= 1) {  // a cluster merged its partials itself
      auto kernel = decode_reduce_kernel<T>;
      PAGED_LAUNCH(kernel, dim3(unsigned(pl.num_rows), p.num_heads), dim3(128), 0, stream, p, pl.partition_size,
                   pl.num_partitions, static_cast<const float*>(tmp_out), static_cast<const float*>(tmp_ml));
      PAGED_CHECK_LAUNCH("decode_reduce_kernel");
    }
  });
}

}  // namespace decode
}  // namespace PAGED_KERNEL_NS

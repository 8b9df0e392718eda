// Varlen paged prefill attention: three kernels over the same row tiling. The CUDA-core kernel
// (prefill_kernel: any dtype, fp32 queries always); the tensor-core kernels for fp16/bf16 queries:
// prefill_tc_pipelined_kernel (a cache of the query's dtype or fp8 heads of multiples of 16, aligned
// cache, query and out rows: cp.async, swizzled shared memory, ldmatrix, FlashAttention-2's
// structure; see its comment, also for sm_90) and prefill_tc_kernel (the general one: other fp8
// heads, odd views; synchronous staging through float).
// Keys and values may differ in head size (MLA): Q and K rows have Dk = head_size, V rows and out
// Dv = value_head_size <= Dk, and value_cache may view key_cache's own storage (only read). The
// tensor-core kernels take Dk <= 256 (plan.h kTcMaxHeadSize); the CUDA-core kernel up to 576.
//
// Rows are "packed GQA": a block for (sequence, KV head) owns tiles of consecutive rows of the
// sequence's q_len x group (query position, query head) matrix, so each K/V tile loaded into shared
// memory serves every query head of the group. Bottom-right causal masking: query i of a sequence
// with q_len queries and seq_len cached tokens sees KV 0 .. seq_len - q_len + i.
//
// Grid: x = sequence x row-tile slot (plan.row_tiles slots per sequence), y = KV head. A block
// walks its sequence's row tiles slot, slot + row_tiles, ... until the sequence's rows run out, so
// every row is computed whatever max_seqlen_q said (it only sizes the grid: kernels/plan.h).
//
// Stages of one row tile, named as in FlashInfer: load_q (Q rows into shared memory, pre-scaled),
// then per KV tile stage_kv (K or V rows through the paged addressing of kernels/paged_kv.h; never a
// slot at or past the last visible token: those may hold NaN), compute_qk (S = Q K^T, the mask
// applied as -inf), update_softmax (online softmax: running max m and sum l per row, log2 domain),
// compute_pv (O = O * alpha + P V), and at the end store (O / l).
//
// A row whose scores hold a NaN is NaN, as in the reference: max() drops NaN, so l, not m, carries
// it. l = 0 at the end means nothing to weigh: a row that sees no key at all (q_len > seq_len
// under causal alignment, or windows that exclude everything) or whose visible scores are all -inf
// is out 0 and lse -inf, or its sink's (finish_softmax: attention_rules.h's end_row).
//
// Masked keys are never read into a row: the mask selects (a hidden key's score is -inf, never
// its q . k), and a hidden key's V never meets the row's probability 0, since 0 * inf = NaN. The
// CUDA-core kernel's P V runs over each row's visible keys only; the tensor-core kernel's mma takes
// a whole tile, so on a tile holding keys hidden from some of its rows (the causal diagonal, a
// window's edges) non-finite V elements of those keys are staged as 0 and added back, p * v in
// IEEE arithmetic, to exactly the rows that see them (rare: only when such a value exists).
//
// The variants (paged_ops/reference.py attention) are runtime arguments of both kernels: a row at
// position pos = seq_len - q_len + i sees keys visible_keys(pos) (attention_rules.h: the windows
// left and right, causal); compute_qk applies the soft-cap and the ALiBi bias to the visible
// scores (ScoreMod), and store folds the sink into the row's denominator and writes ln Z to lse
// (finish_row). A row tile's KV loop runs from the window start of its first (earliest) row to the
// end of its last row's keys, so the tiles outside every row's window are never staged: a windowed
// prefill reads O(window) keys per row tile, not O(seq_len).
#pragma once
#include "kernels/common.cuh"
#include "kernels/mma.cuh"
#include "kernels/params.h"
#include "kernels/plan.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace PAGED_KERNEL_NS {
namespace prefill {

// Soft-cap and ALiBi on one visible score, in the kernels' log2 domain. The kernels multiply q.k by
// qk_mul (the scale, times log2 e unless capped, since the cap applies to the natural-log score);
// then s = softcap * tanh(s / softcap) becomes cap_log2 * tanh(s * inv_cap), and the bias
// slope * (j - pos) is added as slope_log2 * (j - pos) (slope_log2 = 0 without alibi_slopes). The
// pipelined tensor-core kernel applies the same per tile, the cap by common.cuh SoftCapByExp (its own
// code, below).
struct ScoreMod {
  float qk_mul, cap_log2, inv_cap;

  __device__ __forceinline__ float operator()(float s, float slope_log2, int distance) const {
    if (cap_log2 > 0.f) s = cap_log2 * tanhf(s * inv_cap);
    return s + slope_log2 * float(distance);
  }
};

// `scale` is the call's scale times any factor the kernel folds in (the tensor-core kernel's k_scale).
__device__ __forceinline__ ScoreMod score_mod(const AttentionParams& p, float scale) {
  const bool capped = p.softcap > 0.f;
  return ScoreMod{capped ? scale : scale * kLog2e, capped ? p.softcap * kLog2e : 0.f, capped ? 1.f / p.softcap : 0.f};
}

__device__ __forceinline__ float alibi_log2(const AttentionParams& p, int head) {
  return p.alibi_slopes ? p.alibi_slopes[head] * kLog2e : 0.f;
}

// End of a row with running max m (log2 domain, -inf if no finite score) and sum l: the sink, if
// any, joins the denominator (finish_softmax), lse = ln Z is written when write_lse. Returns the
// multiplier of the row's unnormalised accumulator.
__device__ __forceinline__ float finish_row(const AttentionParams& p, float m, float l, int64_t token, int head,
                                            bool write_lse) {
  const RowEnd<float> e = finish_softmax(p, m, l, head);
  if (p.lse && write_lse) p.lse[token * int(p.num_heads) + head] = e.lse;
  return e.mul;
}

// ---- CUDA-core kernel (any query dtype; fp32 queries always take it) ---------------------------
// Per KV tile of BN tokens: K -> smem as float (fp8 dequantised), S = Q K^T, one thread per row
// for the softmax bookkeeping, V -> smem (same buffer, its first Dv columns), each thread owning
// Dv / 8 output elements of one row. K/V tile rows are padded by one float so threads reading
// different tokens at the same dimension hit different banks.
// MaxChunks: the accumulators per thread, Dv / 8 at most: kernels prefill_kernel (plan.h
// kPrefillChunks: Dk <= 256, 32 registers of them) and prefill_wide_kernel (kPrefillWideChunks:
// Dk <= 576, MLA's latent and the other heads tensor cores do not take) over this one body.
template <typename T, typename KV, int MaxChunks>
__device__ __forceinline__ void prefill_rows(const AttentionParams& p, int64_t row_tiles, int BN, bool k_aligned,
                                             bool v_aligned) {
  constexpr int kMaxChunksPerThread = MaxChunks;
  const int nt = blockDim.x;
  const int BM = nt / 8;
  const int64_t seq = blockIdx.x / row_tiles;
  const int64_t slot = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int q0 = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q0;
  // AttentionParams' sizes are int64 (the cpu backend's); the binding checks they fit int, and the
  // kernels narrow them once: 64-bit division and products cost registers and instructions.
  const int group = int(p.num_heads) / int(p.num_kv_heads);
  const int64_t total_rows = int64_t(q_len) * group;
  const int seq_len = p.seq_lens[seq];
  // D: the key head size (Q, K rows); V rows and out have Dv <= D columns, nchunks_v chunks of 8.
  const int D = int(p.head_size), ld = D + 1, nchunks = D / 8, nchunks_v = int(p.value_head_size) / 8;

  PAGED_DYNAMIC_SMEM(float, sm, size_t(BM) * D + size_t(BN) * ld + size_t(BM) * BN + 3 * BM);
  float* Qs = sm;
  float* KVs = Qs + BM * D;
  float* S = KVs + BN * ld;
  float* rm = S + BM * BN;
  float* rl = rm + BM;
  float* ra = rl + BM;

  const ScoreMod mod = score_mod(p, p.scale);
  const float qmul = mod.qk_mul;  // Q is staged pre-multiplied
  const float kscale = cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh);
  const float vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);
  const int myr = threadIdx.x / 8, myc = threadIdx.x % 8;

  // Block-uniform bound: every thread meets every barrier of every tile.
  for (int64_t row0 = slot * BM; row0 < total_rows; row0 += row_tiles * BM) {
    const int nrows = int(min(int64_t(BM), total_rows - row0));
    auto position = [&](int r) { return seq_len - q_len + int((row0 + r) / group); };
    // The keys of row r of the tile (none for padding rows).
    auto row_keys = [&](int r) { return r < nrows ? visible_keys(p, position(r), seq_len) : KeyRange{0, 0}; };
    // The first row has the earliest keys, the last row the latest: no row of the tile sees a key
    // before the first's window or after the last's end.
    const int kv_begin = visible_keys(p, position(0), seq_len).lo;
    const int kv_end = visible_keys(p, position(nrows - 1), seq_len).hi;
    __syncthreads();  // the previous tile's store has read rl; Qs is rewritten below

    // load_q
    for (int e = threadIdx.x; e < BM * D; e += nt) {
      const int r = e / D, d = e % D;
      float x = 0.f;
      if (r < nrows) {
        const int qi = int((row0 + r) / group), g = int((row0 + r) % group);
        x = to_float(static_cast<const T*>(p.query)[(q0 + qi) * p.q_stride_token + (kvh * group + g) * p.q_stride_head +
                                                    d]) *
            qmul;
      }
      Qs[e] = x;
    }
    if (threadIdx.x < BM) {
      rm[threadIdx.x] = -INFINITY;
      rl[threadIdx.x] = 0.f;
    }
    float acc[kMaxChunksPerThread];
#pragma unroll
    for (int k = 0; k < kMaxChunksPerThread; ++k) acc[k] = 0.f;

    // stage_kv: one K or V tile of BN tokens (chunks 8-element chunks of each) into KVs as float;
    // rows past kv_end are zeros.
    auto stage_kv = [&](const PagedKV<KV>& cache, bool aligned, float mul, int kv0, int chunks) {
      for (int e = threadIdx.x; e < BN * chunks; e += nt) {
        const int j = e / chunks, c = (e % chunks) * 8, t = kv0 + j;
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = 0.f;
        if (t < kv_end) load8(cache.row(t) + c, x, aligned, mul);
#pragma unroll
        for (int i = 0; i < 8; ++i) KVs[j * ld + c + i] = x[i];
      }
    };
    __syncthreads();

    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {
      stage_kv(K, k_aligned, kscale, kv0, nchunks);
      __syncthreads();
      // compute_qk; padding rows (r >= nrows) see no key
      for (int e = threadIdx.x; e < BM * BN; e += nt) {
        const int r = e / BN, j = e % BN, t = kv0 + j;
        float s = -INFINITY;
        const int pos = position(r);
        if (row_keys(r).contains(t)) {
          s = 0.f;
          const float* qr = Qs + r * D;
          const float* kr = KVs + j * ld;
          for (int d = 0; d < D; ++d) s += qr[d] * kr[d];
          s = mod(s, alibi_log2(p, kvh * group + int((row0 + r) % group)), t - pos);
        }
        S[e] = s;
      }
      __syncthreads();
      // V tile into the same buffer, while the first BM threads run update_softmax.
      stage_kv(V, v_aligned, vscale, kv0, nchunks_v);
      if (threadIdx.x < BM) {
        const int r = threadIdx.x;
        float* sr = S + r * BN;
        float mx = rm[r];
        for (int j = 0; j < BN; ++j) mx = fmaxf(mx, sr[j]);
        if (mx == -INFINITY) {  // no finite score yet in this row (or a padding row)
          float sum = 0.f;
          for (int j = 0; j < BN; ++j) {
            sum += sr[j] == sr[j] ? 0.f : sr[j];  // NaN scores (fmaxf dropped them) make l NaN
            sr[j] = 0.f;
          }
          rl[r] += sum;
          ra[r] = 1.f;
        } else {
          const float a = exp2f(rm[r] - mx);
          float sum = 0.f;
          for (int j = 0; j < BN; ++j) {
            const float pr = sr[j] == -INFINITY ? 0.f : exp2f(sr[j] - mx);  // NaN stays NaN
            sr[j] = pr;
            sum += pr;
          }
          rl[r] = rl[r] * a + sum;
          rm[r] = mx;
          ra[r] = a;
        }
      }
      __syncthreads();
      // compute_pv over the row's visible keys of the tile only: a hidden key's probability is 0,
      // but its V (staged for the rows that see it) may be inf or NaN, and 0 * inf is NaN.
      {
        const float a = ra[myr];
        const float* pr = S + myr * BN;
        const KeyRange keys = row_keys(myr);
        const int j0 = max(keys.lo - kv0, 0), j1 = min(keys.hi - kv0, BN);
#pragma unroll
        for (int k = 0; k < kMaxChunksPerThread; ++k) {
          if (k < nchunks_v) {
            const int d = myc + 8 * k;
            float sum = 0.f;
            for (int j = j0; j < j1; ++j) sum += pr[j] * KVs[j * ld + d];
            acc[k] = acc[k] * a + sum;
          }
        }
      }
      __syncthreads();
    }

    // store
    if (myr < nrows) {
      const int qi = int((row0 + myr) / group), g = int((row0 + myr) % group);
      // The row's 8 threads each finish it (the sink folds into local copies of m and l); one writes lse.
      const float inv = finish_row(p, rm[myr], rl[myr], q0 + qi, kvh * group + g, myc == 0);
      T* o = static_cast<T*>(p.out) + (q0 + qi) * p.o_stride_token + (kvh * group + g) * p.o_stride_head;
#pragma unroll
      for (int k = 0; k < kMaxChunksPerThread; ++k)
        if (k < nchunks_v) o[myc + 8 * k] = from_float<T>(acc[k] * inv);
    }
  }
}

template <typename T, typename KV>
__global__ void __launch_bounds__(256) prefill_kernel(AttentionParams p, int64_t row_tiles, int BN, bool k_aligned,
                                                       bool v_aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  prefill_rows<T, KV, kPrefillChunks>(p, row_tiles, BN, k_aligned, v_aligned);
}

// The wide instance's 72 accumulators: at most one block of 256 threads per SM is promised
// (minBlocks 1), so ptxas may take the ~145 registers it needs instead of spilling at 128.
template <typename T, typename KV>
__global__ void __launch_bounds__(256, 1) prefill_wide_kernel(AttentionParams p, int64_t row_tiles, int BN,
                                                               bool k_aligned, bool v_aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
  prefill_rows<T, KV, kPrefillWideChunks>(p, row_tiles, BN, k_aligned, v_aligned);
}

// The add-back of the tensor-core kernels' edge tiles: for every key of the tile hidden from some
// row whose V has a non-finite element (staged as 0), o += p * v for exactly the rows that see it.
// The probability of (row, key) is in the S fragment of the row's quad lane that holds the key's
// column: a shuffle brings it to the quad's 4 lanes, each owning 2 of the row's output columns
// per n-tile. V is read again from the cache (rare: only a tile that held a value back).
// One key per iteration, not unrolled, so the rare path stays small in the kernel's code: the
// key's probabilities are read from a copy of s indexed at run time (local memory, here only);
// s itself is indexed by constants everywhere, so it stays in registers.
// Warp-uniform loop bounds: the shuffles see the full warp.
template <int NT_S, int NT_O, typename KV>
__device__ __forceinline__ void add_back_nonfinite_v(float (&o)[NT_O][4], const float (&s)[NT_S][4],
                                                     const PagedKV<KV>& V, int kv0, int n, int D,
                                                     const KeyRange (&keys)[2], KeyRange seen_by_all) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  float ps[NT_S * 4];
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) ps[nt * 4 + i] = s[nt][i];
#pragma unroll 1
  for (int c = 0; c < n; ++c) {
    const int tok = kv0 + c;
    if (seen_by_all.contains(tok)) continue;  // its values were staged as they are (warp-uniform)
    // Key c is column 2 t' + e of n-tile c / 8 in quad lane t' = (c % 8) / 2, element e = c % 2;
    // s[nt][e] is row g's, s[nt][2 + e] row g + 8's.
    const int src = (lane & ~3) | ((c % 8) / 2), at = (c / 8) * 4 + c % 2;
    const float pr[2] = {__shfl_sync(kFullMask, ps[at], src), __shfl_sync(kFullMask, ps[at + 2], src)};
    const KV* vrow = V.row(tok);
#pragma unroll
    for (int ot = 0; ot < NT_O; ++ot) {
      if (ot * 8 < D) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float v = to_float(vrow[ot * 8 + 2 * t + k]);
          if (fabsf(v) < INFINITY) continue;  // finite: the mma has it
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (keys[h].contains(tok)) o[ot][2 * h + k] += pr[h] * v;
        }
      }
    }
  }
}

// ---- stages shared by the two tensor-core kernels (one lane: packed rows r0 and r0 + 8 of its
// warp's 16, columns 2t, 2t + 1 of each 8-wide n-tile: mma.cuh's C layout) --------------------------

// This lane's two rows: position, visible keys (none for padding rows), ALiBi slope. query_of /
// head_of: packed row -> query index in the sequence / head in the KV head's group; head0: the KV
// head's first query head.
template <typename QueryOf, typename HeadOf>
__device__ __forceinline__ void lane_rows(const AttentionParams& p, int r0, int nrows, int seq_len, int q_len,
                                          int head0, const QueryOf& query_of, const HeadOf& head_of, int (&pos)[2],
                                          KeyRange (&keys)[2], float (&slope)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    pos[h] = seq_len - q_len + query_of(r);
    keys[h] = r < nrows ? visible_keys(p, pos[h], seq_len) : KeyRange{0, 0};
    slope[h] = r < nrows ? alibi_log2(p, head0 + head_of(r)) : 0.f;
  }
}

// update_softmax's second half: the quad's row maxima mx of this tile's (modified, log2-domain)
// scores join the running max m, s becomes P = exp2(s - m), the running sums l take the tile's row
// sums; alpha: the factor the accumulators are rescaled by. By ex2.approx (exp2_approx): ex2(-inf)
// = +0 makes a hidden -inf score 0 with no test, once the base of a row without a finite score is
// 0 rather than -inf (-inf - -inf would be NaN); NaN stays NaN.
// kQuadSums: l holds the rows' sums (each lane of the quad the same); else each lane's own share of
// them, summed across the quad once, at the end (FlashAttention-2's deferred row sum: two shuffles
// per row and tile fewer). mul: a scale still to apply to s (> 0: the pipelined kernel's exp_mul,
// s its raw q . k), in the exponent, exp2(s mul - m) by one fma; m and alpha are in the scaled domain.
template <int NT_S, bool kQuadSums = true>
__device__ __forceinline__ void update_row_states(float (&s)[NT_S][4], float (&mx)[2], float (&m)[2],
                                                  float (&l)[2], float (&alpha)[2], float mul = 1.f) {
  float rs[2] = {0.f, 0.f}, base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
    mx[h] = mx[h] * mul;
    const float mn = fmaxf(m[h], mx[h]);
    base[h] = mn == -INFINITY ? 0.f : mn;
    alpha[h] = exp2_approx(m[h] - base[h]);  // 0 while m = -inf: o and l are 0 then (or NaN, which stays)
    m[h] = mn;
  }
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float pr = exp2_approx(fmaf(s[nt][i], mul, -base[i / 2]));
      s[nt][i] = pr;
      rs[i / 2] += pr;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (kQuadSums) {
      rs[h] += __shfl_xor_sync(kFullMask, rs[h], 1);
      rs[h] += __shfl_xor_sync(kFullMask, rs[h], 2);
    }
    l[h] = l[h] * alpha[h] + rs[h];
  }
}

// compute_pv's first step: the accumulators of each row rescaled to the new running max.
template <int NT_O>
__device__ __forceinline__ void rescale_o(float (&o)[NT_O][4], const float (&alpha)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT_O; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}

// P's A fragment for keys [16 kk, 16 kk + 16): the C layout of two score n-tiles is the A layout of
// one 16 x 16 k-step, so P never leaves registers.
template <typename T, int NT_S>
__device__ __forceinline__ void p_frag(uint32_t (&a)[4], const float (&s)[NT_S][4], int kk) {
  a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// store: the lane's two rows normalised (finish_row: sink, lse) and written.
template <typename T, int NT_O, typename QueryOf, typename HeadOf>
__device__ __forceinline__ void store_rows(const AttentionParams& p, const float (&o)[NT_O][4], const float (&m)[2],
                                           const float (&l)[2], int r0, int nrows, int q0, int head0, int D,
                                           float vscale, const QueryOf& query_of, const HeadOf& head_of) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r < nrows) {
      const int qi = query_of(r), gg = head_of(r);
      // The quad's 4 lanes hold the same m and l; lane t = 0 writes lse.
      const float inv = finish_row(p, m[h], l[h], q0 + qi, head0 + gg, t == 0) * vscale;
      T* out = static_cast<T*>(p.out) + (q0 + qi) * p.o_stride_token + (head0 + gg) * p.o_stride_head;
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

template <typename T, typename KV, int DMAX>
__global__ void __launch_bounds__(128) prefill_tc_kernel(AttentionParams p, int64_t row_tiles, bool k_aligned,
                                                          bool v_aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(128);
  constexpr int BM = kTcRows, BN = kTcKv;
  constexpr int NT_O = DMAX / 8, KS_MAX = DMAX / 16, NT_S = BN / 8;
  const int64_t seq = blockIdx.x / row_tiles;
  const int64_t slot = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int q0 = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q0;
  const int group = int(p.num_heads) / int(p.num_kv_heads);  // int: see prefill_kernel
  const int64_t total_rows = int64_t(q_len) * group;
  const int seq_len = p.seq_lens[seq];
  // D: the key head size (Q, K rows, padded to Dp); V rows and out have Dv <= D columns, staged in
  // rows of the same ld (the accumulators cover DMAX >= Dv columns; those past Dv are never used).
  const int D = int(p.head_size), Dp = (D + 15) / 16 * 16, ld = Dp + 8, Dv = int(p.value_head_size);

  PAGED_DYNAMIC_SMEM(T, sm, size_t(BM + 2 * BN) * ld);
  T* Qs = sm;
  T* Ks = Qs + BM * ld;
  T* Vs = Ks + BN * ld;
  const T zero = from_float<T>(0.f);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // k_scale folds into the scores' multiplier, v_scale into the final normalisation.
  const ScoreMod mod =
      score_mod(p, p.scale * cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh));
  const float vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);
  const int cpr = Dp / 8;  // 8-element chunks per padded row

  for (int64_t row0 = slot * BM; row0 < total_rows; row0 += row_tiles * BM) {  // block-uniform
    const int nrows = int(min(int64_t(BM), total_rows - row0));
    const int pos_first = seq_len - q_len + int(row0 / group);
    const int pos_last = seq_len - q_len + int((row0 + nrows - 1) / group);
    // The first row has the earliest keys, the last row the latest: no row of the tile sees a key
    // before the first's window or after the last's end.
    const KeyRange first = visible_keys(p, pos_first, seq_len), last = visible_keys(p, pos_last, seq_len);
    const int kv_begin = first.lo, kv_end = last.hi;
    // The keys every row of the tile sees; the others (the tile's edges) are hidden from some row,
    // which their V must not reach.
    const KeyRange seen_by_all{last.lo, first.hi};
    __syncthreads();  // every warp is done with the previous tile's Qs/Ks/Vs

    // load_q
    for (int e = threadIdx.x; e < BM * Dp; e += kTcThreads) {
      const int r = e / Dp, d = e % Dp;
      T x = zero;
      if (r < nrows && d < D) {
        const int qi = int((row0 + r) / group), gq = int((row0 + r) % group);
        x = static_cast<const T*>(p.query)[(q0 + qi) * p.q_stride_token + (kvh * group + gq) * p.q_stride_head + d];
      }
      Qs[r * ld + d] = x;
    }

    auto query_of = [&](int r) { return int((row0 + r) / group); };
    auto head_of = [&](int r) { return int((row0 + r) % group); };
    int pos[2];
    KeyRange keys[2];
    float slope[2];
    lane_rows(p, warp * 16 + g, nrows, seq_len, q_len, kvh * group, query_of, head_of, pos, keys, slope);
    float o[NT_O][4];
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {
      __syncthreads();  // the previous KV tile is no longer read
      // A tile holding keys hidden from some row: their non-finite V elements are staged as 0 (so
      // the mma's 0 * v stays 0 for the rows that do not see them) and added back after it.
      const bool edge = kv0 < seen_by_all.lo || kv0 + BN > seen_by_all.hi;  // block-uniform
      bool held_back = false;
      // stage_kv: raw cache values (exact in T), zeros past kv_end and in the padding columns
      // (K's past D, V's past Dv: a value_cache viewing key_cache's first Dv columns is never read
      // past them).
      for (int e = threadIdx.x; e < BN * cpr; e += kTcThreads) {
        const int j = e / cpr, c = (e % cpr) * 8, tok = kv0 + j;
        float x[8], y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = y[i] = 0.f;
        if (tok < kv_end && c < D) {
          load8(K.row(tok) + c, x, k_aligned);
          if (c < Dv) load8(V.row(tok) + c, y, v_aligned);
          if (edge && !seen_by_all.contains(tok)) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if (!(fabsf(y[i]) < INFINITY)) {  // inf or NaN
                y[i] = 0.f;
                held_back = true;
              }
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          Ks[j * ld + c + i] = from_float<T>(x[i]);
          Vs[j * ld + c + i] = from_float<T>(y[i]);
        }
      }
      // Block-uniform: some thread held back a non-finite V of a partly hidden key.
      bool add_back = false;
      if (edge) add_back = __syncthreads_or(held_back) != 0;
      else __syncthreads();

      // compute_qk
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

      // update_softmax (mask, running max/sum, P in place of S)
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = kv0 + nt * 8 + 2 * t + (i % 2), h = i / 2;
          const float v = keys[h].contains(tok) ? mod(s[nt][i] * mod.qk_mul, slope[h], tok - pos[h]) : -INFINITY;
          s[nt][i] = v;
          mx[i / 2] = fmaxf(mx[i / 2], v);
        }
      }
      float alpha[2];
      update_row_states(s, mx, m, l, alpha);

      // compute_pv
      rescale_o(o, alpha);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        p_frag<T>(a, s, kk);
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          if (nt * 8 < Dv) {
            uint32_t b[2];
            load_b_frag_kn(b, Vs, ld, kk * 16, nt * 8);
            mma_16816<T>(o[nt], a, b);
          }
        }
      }
      if (add_back)
        add_back_nonfinite_v<NT_S, NT_O>(o, s, V, kv0, min(BN, kv_end - kv0), Dv, keys, seen_by_all);
    }

    store_rows<T>(p, o, m, l, warp * 16 + g, nrows, q0, kvh * group, Dv, vscale, query_of, head_of);
  }
}

// The pipelined kernel's store: the lane's 2 MT rows (r0 + 16 mt + 8 h) normalised (finish_row:
// sink, lse; l the lane's shares of the row sums), their multipliers found in one rolled loop
// (finish_row's code once, not per row: the row's m and l picked by constant-index selects, so they
// stay in registers), then written as element pairs, one 32-bit store each (the plan takes out
// views whose rows hold aligned pairs).
template <typename T, int MT, int NT_O, typename QueryOf, typename HeadOf>
__device__ __forceinline__ void store_rows_paired(const AttentionParams& p, const float (&o)[MT][NT_O][4],
                                                  const float (&m)[MT][2], const float (&l)[MT][2], int r0,
                                                  int nrows, int q0, int head0, int D, float vscale,
                                                  const QueryOf& query_of, const HeadOf& head_of) {
  const int t = threadIdx.x % 4;
  // l: each lane's share of its rows' sums (update_row_states<..., false>), summed across the quad.
  float lq[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lq[mt][h] = l[mt][h] + __shfl_xor_sync(kFullMask, l[mt][h], 1);
      lq[mt][h] += __shfl_xor_sync(kFullMask, lq[mt][h], 2);
    }
  float mul[MT][2];
#pragma unroll 1
  for (int k = 0; k < 2 * MT; ++k) {
    float mk = m[0][0], lk = lq[0][0];
#pragma unroll
    for (int i = 1; i < 2 * MT; ++i)
      if (k == i) mk = m[i / 2][i % 2], lk = lq[i / 2][i % 2];
    const int r = r0 + 16 * (k / 2) + 8 * (k % 2);
    // The quad's 4 lanes hold the same m and l; lane t = 0 writes lse.
    const float mk_mul =
        r < nrows ? finish_row(p, mk, lk, q0 + query_of(r), head0 + head_of(r), t == 0) * vscale : 0.f;
#pragma unroll
    for (int i = 0; i < 2 * MT; ++i)
      if (k == i) mul[i / 2][i % 2] = mk_mul;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 16 * mt + 8 * h;
      if (r < nrows) {
        uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + (q0 + query_of(r)) * p.o_stride_token +
                                                    (head0 + head_of(r)) * p.o_stride_head + 2 * t);
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt)
          if (nt * 8 < D) out[nt * 4] = pack2<T>(o[mt][nt][2 * h] * mul[mt][h], o[mt][nt][2 * h + 1] * mul[mt][h]);
      }
    }
  }
}

// The 16-bit halves of w (two fp16 or bf16 values) whose exponent is all ones (inf or NaN): a mask
// of 0xffff per such half.
template <typename T>
__device__ __forceinline__ uint32_t nonfinite_halves(uint32_t w) {
  constexpr uint32_t kExp = std::is_same_v<T, __half> ? 0x7c00u : 0x7f80u;
  return ((w & kExp) == kExp ? 0xffffu : 0u) | ((w >> 16 & kExp) == kExp ? 0xffff0000u : 0u);
}

// A word's low or high fp8 pair as a 16-bit pair of T, exactly (fp8 is a subset of fp16 and of bf16):
// fp16 takes the pair conversion's bits, bf16 goes through float.
template <typename T, typename FP8>
__device__ __forceinline__ uint32_t fp8x2_to_pair(uint32_t word, bool high_pair) {
  const uint32_t h = fp8x2_to_half2<FP8>(word, high_pair);
  if constexpr (std::is_same_v<T, __half>) return h;
  else return pack2<T>(half_bits_to_float(uint16_t(h)), half_bits_to_float(uint16_t(h >> 16)));
}

// Element pair `pair` (elements 2 pair, 2 pair + 1) of a cache row as a 16-bit pair of T: the row's
// own bits for a 16-bit cache, an fp8 pair widened.
template <typename T, typename KV>
__device__ __forceinline__ uint32_t value_pair(const KV* row, int pair) {
  if constexpr (std::is_same_v<KV, T>) return reinterpret_cast<const uint32_t*>(row)[pair];
  else return fp8x2_to_pair<T, KV>(reinterpret_cast<const uint16_t*>(row)[pair], false);
}

// Sixteen fp8 values (16 bytes, the first element lowest) as sixteen 16-bit values of T in two
// 16-byte chunks.
template <typename T, typename FP8>
__device__ __forceinline__ void widen_fp8x16(const uint4& in, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = fp8x2_to_pair<T, FP8>(w[i / 2], i % 2 == 1);
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// add_back_nonfinite_v of the pipelined kernel (16-byte aligned rows of a 16-bit or fp8 cache), from P
// as the mma took it (pa: the A fragments of P V's k-steps, 16-bit pairs; no float copy of the scores
// stays live across P V): each key's value pairs by one load (value_pair), tested on the raw bits
// (exponent all ones: inf or NaN), the key's visibility to the lane's rows decided once per key.
// (A probability that rounds to 0 in the 16-bit P makes 0 * inf = NaN, as the mma would.)
template <typename T, typename KV, int MT, int KK, int NT_O>
__device__ __forceinline__ void add_back_nonfinite_v_paired(float (&o)[MT][NT_O][4], const uint32_t (&pa)[MT][KK][4],
                                                            const PagedKV<KV>& V, int kv0, int n, int D,
                                                            const KeyRange (&keys)[MT][2], KeyRange seen_by_all) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll 1
  for (int c = 0; c < n; ++c) {
    const int tok = kv0 + c;
    if (seen_by_all.contains(tok)) continue;  // its values were staged as they are (warp-uniform)
    // Key c is element e = c % 2 of the pair of quad lane t' = (c % 8) / 2 in register
    // 2 ((c / 8) % 2) + h of k-step c / 16 (mma.cuh's A layout; h: row g or g + 8).
    const int src = (lane & ~3) | ((c % 8) / 2), kstep = c / 16, reg = 2 * ((c / 8) % 2);
    float pr[MT][2];
    bool sees[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Picked by compile-time indices: a run-time index would need pa in local memory, a stack
        // frame in every instance for a path that rarely runs. (add_back_nonfinite_v keeps its
        // indexed copy of s: written this way there, ptxas moved s itself to local memory in the
        // main loop.)
        uint32_t word = 0;
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
          for (int r = 0; r < 4; r += 2)
            if (kk == kstep && r == reg) word = pa[mt][kk][r + h];
        pr[mt][h] = unpack_half<T>(__shfl_sync(kFullMask, word, src), c % 2);
        sees[mt][h] = keys[mt][h].contains(tok);
      }
    const KV* vrow = V.row(tok);
#pragma unroll
    for (int ot = 0; ot < NT_O; ++ot) {
      if (ot * 8 < D) {
        const uint32_t w = value_pair<T>(vrow, ot * 4 + t);
        if (!nonfinite_halves<T>(w)) continue;  // both finite: the mma has them
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float v = unpack_half<T>(w, k);
          if (fabsf(v) < INFINITY) continue;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              if (sees[mt][h]) o[mt][ot][2 * h + k] += pr[mt][h] * v;
        }
      }
    }
  }
}

// ---- Tensor-core kernel, FlashAttention-2's structure (16-byte aligned views) -----------------
// For a cache of the query's dtype (or fp8: below) and query / out views whose rows are aligned
// (plan.pipelined: 16-byte K, V and Q rows, out rows of aligned element pairs), per row tile of plan.h
// tc_pipelined_rows packed rows (4 warps x MT fragments of 16: 128 rows at value tiles <= 128, 64 at
// 256) and KV tiles of 64 keys (32 at value tile 256: plan.h tc_pipelined_kv_tile):
//  * Q, K and V tiles go by 16-byte cp.async straight from the query and the paged cache into shared
//    memory, FlashAttention-2's schedule with one buffer each: V of tile i loads while Q K^T of tile
//    i runs, K of tile i + 1 while P V of tile i (two commit groups per tile), by copy_row: each
//    thread one row of the tile (one block-table entry a tile, not one a chunk), its chunks by
//    unrolled cp.async at constant offsets, padding by src-size 0;
//  * shared-memory rows of DK (Q, K) or DV (V) elements, 16-byte chunk c of row r stored at chunk
//    c ^ (r % 8) (swizzled_offset; DK, DV multiples of 64, so a row's chunks stay in it and every
//    row starts on bank group 0): the 8 rows of every 8x8 matrix ldmatrix reads are 8 consecutive
//    rows of one logical chunk, so they fall in 8 distinct bank groups (conflict-free by
//    construction, counted by the emulator: tests/test_emu_ldmatrix.py), and so do the 16-byte
//    cp.async writes of 8 lanes; each lane's ldmatrix rows are four pointers (LdmatrixRows) plus
//    compile-time offsets;
//  * fragments by ldmatrix: Q's (A) once per row tile, kept in registers for the whole KV loop where
//    they are few (MT x DK <= 128), else re-read per k-step; K's non-transposed (Q K^T's B), V's by
//    .trans (P V's B), each fragment feeding the warp's MT row fragments; P stays in registers (the
//    scores' C layout is P V's A layout), 16-bit once the softmax is done;
//  * the tile's compute compiled twice (tile_step): edge tiles (a key hidden from some row of the
//    tile: the causal diagonal, window edges, the sequence's end) with the mask and the non-finite
//    V hold-back, interior tiles with neither; softmax by ex2.approx, the scale in its exponent
//    (exp_mul), row sums summed across the quad once at the end; the soft-cap and ALiBi only in the
//    kScoreMods instances.
// An fp8 cache (heads multiples of 16) is copied the same way into fp8 staging tiles, K and V of tile
// i + 1 both during tile i; at the top of tile i + 1 each thread widens the chunks it copied into the
// 16-bit tiles (exact), and the rest is the 16-bit kernel's (the scales: k_scale on the scores,
// v_scale at the store).
// A non-finite V of a key hidden from some row cannot be kept from the copy as the general kernel
// does; on edge tiles only, it is zeroed in shared memory after the copy lands and added back to the
// rows that see it (add_back_nonfinite_v_paired).
// sm_90: this is the Ampere (mma.sync) structure. A wgmma / TMA path is not written: on Hopper the
// Triton prefill (wgmma) is the choice, and the tuner times cuda against triton per shape (issue #23
// item 6).
template <int DMAX>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * DMAX + ((chunk ^ (row & 7)) << 3);
}

// A lane's ldmatrix row pointers into a swizzled tile of DIM-element rows, computed once: chunk
// 8a + b (b < 8) of row r lies at chunk 8a + (b ^ r % 8), so for rows r + 8k (the same r % 8) the
// chunks 2 i + c (i = 0..3, c the lane's matrix column) of the four pointers serve every chunk pair:
// pair i + 4a is pointer i shifted by 8a chunks, and rows 8k down by 8k rows, both compile-time
// offsets of the ldmatrix address.
template <typename T, int DIM>
struct LdmatrixRows {
  const T* at[4];
  __device__ __forceinline__ LdmatrixRows(const T* tile, int row, int c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) at[i] = tile + row * DIM + (((2 * i + c) ^ (row & 7)) << 3);
  }
  // The lane's row of the 8x8 matrices of chunk pair `pair` (chunks 2 pair, 2 pair + 1), `down` rows
  // (a multiple of 8) below the pointers' row.
  __device__ __forceinline__ const T* operator()(int down, int pair) const {
    return at[pair % 4] + down * DIM + (pair / 4) * 64;
  }
};

// The pipelined kernel's fp8 staging rows (rows of kChunks 16-byte chunks as copied): chunk c of row j
// lies at c ^ (j % 8), or c ^ (j % 4) in rows of 4 or 12 chunks, where a 4-aligned group of chunks
// stays whole and in its row (copy_row's comment).
template <int kChunks>
__device__ __forceinline__ int staged_chunk(int j, int c) {
  return c ^ (j & (kChunks % 8 == 0 ? 7 : 3));
}

// The (row, chunk) a thread copies in pass `pass` over a tile of rows of kChunks 16-byte chunks:
// where the block's threads cover whole rows (kChunks divides kTcThreads: heads 64, 128, 256) a
// fixed chunk of rows kRowsPerPass apart; else (192: 24 chunks) the tile's chunks in row-major order,
// thread by thread.
template <int kChunks>
struct CopyGrid {
  static constexpr bool kWholeRows = kTcThreads % kChunks == 0;
  static constexpr int kRowsPerPass = kWholeRows ? kTcThreads / kChunks : 1;
  template <int kRows>
  static constexpr int passes() {
    static_assert(kRows * kChunks % kTcThreads == 0 && (!kWholeRows || kRows % kRowsPerPass == 0), "copy passes");
    return kRows * kChunks / kTcThreads;
  }
  int my_chunk, my_row;
  __device__ __forceinline__ CopyGrid() : my_chunk(int(threadIdx.x) % kChunks), my_row(int(threadIdx.x) / kChunks) {}
  __device__ __forceinline__ int row(int pass) const {
    return kWholeRows ? my_row + pass * kRowsPerPass : (int(threadIdx.x) + pass * kTcThreads) / kChunks;
  }
  __device__ __forceinline__ int chunk(int pass) const {
    return kWholeRows ? my_chunk : (int(threadIdx.x) + pass * kTcThreads) % kChunks;
  }
};

// DK: the Q / K tile width (the key head size rounded up), DV: V's and the accumulators' (>= the
// value head size): (64, 64), (128, 128), (256, 256), and (192, 128) for DeepSeek's non-absorbed
// prefill (keys 128 + 64 RoPE, values 128), whose value side costs what 128's does.
// kScoreMods: the soft-cap or ALiBi is on (a compile-time variant: without it the scores take one
// multiply, no tanh and no bias in the kernel's code). Each warp owns MT = plan.h
// tc_pipelined_row_frags(DV) fragments of 16 packed rows (two where the accumulators fit, so every
// K / V fragment read from shared memory feeds MT mma and the tile's copies and masks serve twice
// the rows).
template <typename T, typename KV, int DK, int DV, bool kScoreMods>
__global__ void __launch_bounds__(128) prefill_tc_pipelined_kernel(AttentionParams p, int64_t row_tiles) {
  PAGED_LAUNCH_BOUNDS_CHECK(128);
  static_assert(DV <= DK && DK % 64 == 0 && DV % 64 == 0, "swizzled rows: chunk ^ (row % 8) stays in the row");
  // An fp8 cache (KV != T): K and V tiles are copied into fp8 staging tiles, and each thread widens
  // the chunks it copied into the 16-bit tiles the mma reads (widen_fp8x16: exact).
  constexpr bool kStaged = !std::is_same_v<KV, T>;
  static_assert(!kStaged || sizeof(KV) == 1, "the pipelined kernel's caches: the query's dtype or fp8");
  constexpr int kCacheBytes = int(sizeof(KV));
  constexpr int MT = tc_pipelined_row_frags(DV), BM = tc_pipelined_rows(DV),
                BN = tc_pipelined_kv_tile(DK, DV, kCacheBytes);
  constexpr int NT_O = DV / 8, KS_MAX = DK / 16, NT_S = BN / 8;
  using QGrid = CopyGrid<DK / 8>;                 // 16-byte chunks per Q (and 16-bit K) shared-memory row
  using VTileGrid = CopyGrid<DV / 8>;             // ... per 16-bit V tile row (the hold-back's scan)
  // Q's fragments stay in registers for the whole KV loop where they are few (MT x DK / 4 per
  // lane <= 32); else they are re-read per k-step: beside the accumulators they would spill.
  constexpr bool kQInRegisters = MT * DK <= 128;
  const int64_t seq = blockIdx.x / row_tiles;
  const int64_t slot = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int q0 = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q0;
  const int group = int(p.num_heads) / int(p.num_kv_heads);  // int: see prefill_kernel
  const int64_t total_rows = int64_t(q_len) * group;
  const int seq_len = p.seq_lens[seq];
  // D: the key head size (Q, K rows), Dv the value's (V rows, out; <= D). A value_cache that views
  // key_cache's first Dv columns is copied from its own rows like any other: cp.async only reads.
  // Every chunk of a Q, K or V tile row past the head's data is zero, so the mma's k-steps and
  // n-tiles run over the whole tile with no per-step test: zeros add nothing to Q K^T, and the
  // columns of o past Dv are never stored.
  const int D = int(p.head_size), data_chunks = D / 8;
  const int Dv = int(p.value_head_size), v_data_chunks = Dv / 8;
  // The same in 16-byte chunks of the cache's rows (plan.h: fp8 heads are multiples of 16).
  const int k_copy_chunks = D * kCacheBytes / 16, v_copy_chunks = Dv * kCacheBytes / 16;

  // [BM] Q rows, then a K tile of BN rows of DK 16-bit elements, then a V tile of BN rows of DV,
  // swizzled; an fp8 cache's staging tiles after them, rows of DK then DV bytes as copied
  // (plan.h tc_pipelined_smem).
  PAGED_DYNAMIC_SMEM(T, sm, (tc_pipelined_smem(DK, DV, BN, kCacheBytes) + 1) / 2);
  T* const Kt = sm + BM * DK;
  T* const Vt = sm + (BM + BN) * DK;
  unsigned char* const k_staged = reinterpret_cast<unsigned char*>(sm + (BM + BN) * DK + BN * DV);
  unsigned char* const v_staged = k_staged + BN * DK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * 16 * MT;  // the warp's first packed row in the tile
  // This thread's chunks of the rows it copies.
  const QGrid qgrid;
  const VTileGrid vtile_grid;
  // ldmatrix: lane l gives a row of matrix l / 8 (mma.cuh's ldmatrix).
  const int ld_mat = lane / 8, ld_row = lane % 8;
  // copy_row's thread: row copy_row_j of a K / V tile, chunks copy_row_first + kCopyThreadsPerRow k;
  // chunk c lies at (c ^ j % 8) * 8 elements, which takes kCopySwz values over the first 8 chunks
  // and repeats them 8 chunks (64 elements) further on. Held (swizzled_offset per chunk instead: +26
  // instructions an interior tile and 80 -> 104 B of stack at <bf16, 128, 128> on sm_90).
  constexpr int kCopyThreadsPerRow = kTcThreads / BN, kCopySwz = 8 / kCopyThreadsPerRow;
  static_assert(kTcThreads % BN == 0 && (DV / 8) % kCopyThreadsPerRow == 0 && kCopyThreadsPerRow <= 8, "copy rows");
  const int copy_row_j = int(threadIdx.x) / kCopyThreadsPerRow, copy_row_first = int(threadIdx.x) % kCopyThreadsPerRow;
  int copy_row_swz[kCopySwz];
#pragma unroll
  for (int k = 0; k < kCopySwz; ++k) copy_row_swz[k] = ((copy_row_first + kCopyThreadsPerRow * k) ^ (copy_row_j & 7)) << 3;
  const LdmatrixRows<T, DK> k_rows(Kt, ld_row + 8 * (ld_mat / 2), ld_mat % 2);
  const LdmatrixRows<T, DV> v_rows(Vt, ld_row + 8 * (ld_mat % 2), ld_mat / 2);
  const ScoreMod mod =
      score_mod(p, p.scale * cache_scale(p.k_scale, p.k_scale_seq_stride, p.k_scale_head_stride, seq, kvh));
  const float vscale = cache_scale(p.v_scale, p.v_scale_seq_stride, p.v_scale_head_stride, seq, kvh);
  const PagedKV<KV> K = paged_k<KV>(p, seq, kvh), V = paged_v<KV>(p, seq, kvh);
  const uint4 zeros = make_uint4(0u, 0u, 0u, 0u);
  const FastDivmod by_block(K.block_size), by_group(group);  // kernels/paged_kv.h
  // A kScoreMods kernel's soft-cap: cap_log2 tanh(q . k qk_mul inv_cap) by common.cuh SoftCapByExp (the
  // plan takes this kernel for caps up to kMaxSoftcapByExp only).
  const bool capped = mod.cap_log2 > 0.f;
  const SoftCapByExp soft_cap{mod.cap_log2, 2.f * kLog2e * mod.qk_mul * mod.inv_cap};
  // The plain kernel takes the scores' max on q . k and applies the scale c in the exponent,
  // exp2(s c - m c) by one fma (FlashAttention-2's), which is right for c > 0 only (the max of c s
  // is c max s): any other c is moved into Q once per row tile (q_mul), exactly: c < 0 negates Q
  // and the exponent takes -c; c = 0 or NaN multiplies Q by c and the exponent takes 1.
  const float c = mod.qk_mul;
  const float q_mul = kScoreMods || c > 0.f ? 1.f : (c < 0.f ? -1.f : c);
  const float exp_mul = kScoreMods ? 1.f : (c > 0.f ? c : (c < 0.f ? -c : 1.f));

  for (int64_t row0 = slot * BM; row0 < total_rows; row0 += row_tiles * BM) {  // block-uniform
    const int nrows = int(min(int64_t(BM), total_rows - row0));
    const int pos_first = seq_len - q_len + int(row0 / group);
    const int pos_last = seq_len - q_len + int((row0 + nrows - 1) / group);
    // As in prefill_tc_kernel: the first row sees the earliest keys, the last the latest.
    const KeyRange first = visible_keys(p, pos_first, seq_len), last = visible_keys(p, pos_last, seq_len);
    const int kv_begin = first.lo, kv_end = last.hi;
    const KeyRange seen_by_all{last.lo, first.hi};

    // stage_k / stage_v: one tile's K or V rows by cp.async, one commit group; rows at or past
    // kv_end (never read from the cache: they may hold NaN or lie past the table) and the chunks
    // past the head's data are zeros, so the mma's 0 * v stays 0. FlashAttention-2's schedule, one
    // buffer each: V of tile i loads while Q K^T of tile i runs, K of tile i + 1 while P V of tile i.
    // copy_row: thread t copies row copy_row_j = t / kCopyThreadsPerRow of the tile, its chunks
    // t % kCopyThreadsPerRow + kCopyThreadsPerRow k: one block-table entry per thread and tile (one
    // dependent load, not one a chunk), and a warp's pass reads whole 32-byte sectors of its rows.
    // Unrolled: the chunks' addresses are the row's plus constants; padding (rows at or past kv_end,
    // chunks past the head) by src-size 0, from an aligned address that is not read. Into the 16-bit
    // tile (a cache of the query's dtype) at its swizzled chunks; an fp8 cache's into the staging tile,
    // rows of DIM bytes as copied, chunk c of row j at c ^ (j % 8) (j % 4 where a row has 4 or 12
    // chunks: staged_chunk): the staging tile is read only by the thread that wrote it (widen_rows),
    // and the swizzle spreads a pass's writes over all 8 bank groups, 4 chunks each (the fewest
    // wavefronts 512 bytes take), as the 16-bit tile's does.
    auto copy_row = [&](const PagedKV<KV>& cache, auto dim, T* tile, unsigned char* staged, int data, int kv0) {
      constexpr int DIM = decltype(dim)::value, kChunks = DIM * kCacheBytes / 16;
      static_assert(kChunks % kCopyThreadsPerRow == 0, "whole rows per thread group");
      const int tok = kv0 + copy_row_j;
      const bool in_range = tok < kv_end;
      const KV* src = cache.base + copy_row_first * (16 / kCacheBytes);
      if (in_range) {
        const int in_table = by_block.div(tok), off = tok - in_table * by_block.d;
        src += cache.block_table[in_table] * cache.stride_block + off * cache.stride_token;
      }
#pragma unroll
      for (int k = 0; k < kChunks / kCopyThreadsPerRow; ++k) {
        const int c = copy_row_first + kCopyThreadsPerRow * k;
        void* const dst = kStaged ? static_cast<void*>(staged + copy_row_j * DIM + 16 * staged_chunk<kChunks>(copy_row_j, c))
                                  : static_cast<void*>(tile + copy_row_j * DIM + copy_row_swz[k % kCopySwz] +
                                                       (k / kCopySwz) * 64);
        copy_async_16(dst, src + (16 / kCacheBytes) * kCopyThreadsPerRow * k, in_range && c < data ? 16 : 0);
      }
      cp_async_commit();
    };
    auto stage_k = [&](int kv0) { copy_row(K, std::integral_constant<int, DK>{}, Kt, k_staged, k_copy_chunks, kv0); };
    auto stage_v = [&](int kv0) { copy_row(V, std::integral_constant<int, DV>{}, Vt, v_staged, v_copy_chunks, kv0); };
    // widen_rows (fp8 caches): the staged chunks this thread copied (its own cp.async data: visible
    // to it after its wait, no barrier needed) into the 16-bit tile, 16 values into two swizzled chunks.
    // Rolled: a chunk's widening is 8-40 instructions (sm_89+ cvt, sm_80 prmt / mul.f16x2), which
    // unrolled at two sites would outweigh the loop's few a pass in code size (sm_80's head-128 kernel:
    // 5713 instructions, HMMA 8.96% of them, against 5158 and 9.9% rolled).
    auto widen_rows = [&](auto dim, const unsigned char* staged, T* tile) {
      constexpr int DIM = decltype(dim)::value, kChunks = DIM / 16;
#pragma unroll 1
      for (int k = 0; k < kChunks / kCopyThreadsPerRow; ++k) {
        const int c = copy_row_first + kCopyThreadsPerRow * k;
        uint4 lo, hi;
        widen_fp8x16<T, KV>(*reinterpret_cast<const uint4*>(staged + copy_row_j * DIM + 16 * staged_chunk<kChunks>(copy_row_j, c)),
                            lo, hi);
        *reinterpret_cast<uint4*>(tile + swizzled_offset<DIM>(copy_row_j, 2 * c)) = lo;
        *reinterpret_cast<uint4*>(tile + swizzled_offset<DIM>(copy_row_j, 2 * c + 1)) = hi;
      }
    };

    __syncthreads();  // every warp is done with the previous row tile's Q and K/V tiles
    // The first K tile (and an fp8 cache's first V tile) loads while Q is staged.
    if (kv_begin < kv_end) {
      stage_k(kv_begin);
      if constexpr (kStaged) stage_v(kv_begin);
    }

    // Packed row r of the tile is (query qi, head gq of the group): one 64-bit division per row tile,
    // 32-bit ones per row (r < BM: row_q0 * group + row_g0 + r stays in int range of a row).
    const int64_t row_q0 = row0 / group;
    const int row_g0 = int(row0 - row_q0 * group);
    auto query_of = [&](int r) { return int(row_q0) + by_group.div(row_g0 + r); };
    auto head_of = [&](int r) { return by_group.mod(row_g0 + r); };

    // load_q: raw query values (the scale multiplies the scores) by 16-byte cp.async (the plan
    // takes 16-byte aligned query rows only), zeros in padding rows and columns; one commit group
    // after the first tile's two, awaited with them (rolled, as the K / V copies).
    constexpr int kQPasses = QGrid::template passes<BM>();
#pragma unroll 1
    for (int pass = 0; pass < kQPasses; ++pass) {
      const int r = qgrid.row(pass), c = qgrid.chunk(pass);
      T* dst = sm + swizzled_offset<DK>(r, c);
      if (r < nrows && c < data_chunks)
        copy_async(dst,
                   static_cast<const T*>(p.query) + (q0 + query_of(r)) * p.q_stride_token +
                       (kvh * group + head_of(r)) * p.q_stride_head + 8 * c,
                   16);
      else
        *reinterpret_cast<uint4*>(dst) = zeros;
    }
    cp_async_commit();
    cp_async_wait<0>();
    if constexpr (!kScoreMods) {
      // A scale that is not positive moves into Q (exp_mul's comment), each thread over the chunks
      // it copied (its own cp.async data, visible to it after the wait): c < 0 negates Q, c = 0 or
      // NaN multiplies it by c (0, or NaN where q is not finite, as (q . k) c would be).
      if (q_mul != 1.f) {  // block-uniform
#pragma unroll 1
        for (int pass = 0; pass < kQPasses; ++pass) {
          T* at = sm + swizzled_offset<DK>(qgrid.row(pass), qgrid.chunk(pass));
#pragma unroll
          for (int i = 0; i < 8; ++i) at[i] = T(float(at[i]) * q_mul);
        }
      }
    }
    __syncthreads();  // Q visible to every warp

    // Q's A fragments: matrix l / 8 of a 16x16 step = (rows 0-7 | 8-15) x (columns 0-7 | 8-15).
    const LdmatrixRows<T, DK> q_rows(sm, warp_row0 + ld_row + 8 * (ld_mat % 2), ld_mat / 2);
    auto load_q_frag = [&](uint32_t (&a)[4], int mt, int ks) {
      ldmatrix<4, false>(a, q_rows(mt * 16, ks));
    };
    uint32_t qf[kQInRegisters ? MT : 1][kQInRegisters ? KS_MAX : 1][4];
    if constexpr (kQInRegisters) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS_MAX; ++ks)
          load_q_frag(qf[mt][ks], mt, ks);
    }

    // The lane's rows: warp_row0 + 16 mt + 8 h + g. Their visible keys are found where a tile needs
    // them (edge tiles only), not held across the loop: registers go to the accumulators. A
    // kScoreMods kernel holds each row's position and ALiBi slope.
    auto lane_row_keys = [&](KeyRange (&keys)[MT][2]) {
      int pos_unused[MT][2];
      float slope_unused[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        lane_rows(p, warp_row0 + mt * 16 + g, nrows, seq_len, q_len, kvh * group, query_of, head_of, pos_unused[mt],
                  keys[mt], slope_unused[mt]);
    };
    int pos[kScoreMods ? MT : 1][2];
    float slope[kScoreMods ? MT : 1][2];
    if constexpr (kScoreMods) {
      KeyRange keys_unused[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        lane_rows(p, warp_row0 + mt * 16 + g, nrows, seq_len, q_len, kvh * group, query_of, head_of, pos[mt],
                  keys_unused[mt], slope[mt]);
    }
    float o[MT][NT_O][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += BN) {  // block-uniform
      const bool has_next = kv0 + BN < kv_end;
      if constexpr (kStaged) {
        // In flight: this tile's K and V groups (issued during the previous tile, or above).
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the previous tile's K and V
        widen_rows(std::integral_constant<int, DK>{}, k_staged, Kt);
        widen_rows(std::integral_constant<int, DV>{}, v_staged, Vt);
        if (has_next) {  // this thread's staging chunks are widened: the next tile may land there
          stage_k(kv0 + BN);
          stage_v(kv0 + BN);
        }
        __syncthreads();  // K and V visible
      } else {
        // In flight: this tile's K group (issued during the previous tile's P V, or above).
        cp_async_wait<0>();
        __syncthreads();  // K visible; every warp is done with the previous tile's V
        stage_v(kv0);
      }

      // The tile's compute, compiled twice: for an edge tile (a key hidden from some row of the
      // tile: the causal diagonal, a window's edges, the sequence's end) with the mask and the
      // non-finite-V hold-back, and for the interior tiles without either (FlashAttention-2's
      // masking and plain steps).
      auto tile_step = [&](auto edge_tag) {
        constexpr bool kEdge = decltype(edge_tag)::value;
        KeyRange keys[MT][2];
        if constexpr (kEdge) lane_row_keys(keys);
        // compute_qk: B fragments of two n-tiles per ldmatrix x4: matrix l / 8 = (keys 0-7 | 8-15) x
        // (dims 0-7 | 8-15) of the pair, in the order b[nt][0], b[nt][1], b[nt + 1][0], b[nt + 1][1];
        // each feeds the MT row fragments.
        float s[MT][NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS_MAX; ++ks) {
          uint32_t a_reread[kQInRegisters ? 1 : MT][4];
          if constexpr (!kQInRegisters) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) load_q_frag(a_reread[mt], mt, ks);
          }
#pragma unroll
          for (int np = 0; np < NT_S / 2; ++np) {
            uint32_t b[4];
            ldmatrix<4, false>(b, k_rows(np * 16, ks));
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              const uint32_t(&a)[4] = kQInRegisters ? qf[kQInRegisters ? mt : 0][kQInRegisters ? ks : 0]
                                                    : a_reread[kQInRegisters ? 0 : mt];
              mma_16816<T>(s[mt][2 * np], a, b0);
              mma_16816<T>(s[mt][2 * np + 1], a, b1);
            }
          }
        }

        // update_softmax: the score modifiers of a kScoreMods kernel (the plain kernel's scale goes
        // into the exponent: update_row_states' mul), then the mask, only on a tile holding a key
        // hidden from some row of the tile: a score whose key the row does not see becomes -inf,
        // whatever its q . k (a hidden key's K may hold NaN).
        const int lane_key0 = kv0 + 2 * t;  // the lane's key of column 0 of n-tile 0
        float mx[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mx[mt][0] = mx[mt][1] = -INFINITY;
          if constexpr (kScoreMods) {
            // The soft-cap (block-uniform: one branch a tile), then the ALiBi bias slope (key - pos)
            // as the bias of the lane's key 0 plus slope times the key's compile-time column. (Skipping
            // the bias by a block-uniform branch where the call has no slopes moved ptxas' spills: stack
            // 120 -> 184 B at <T, T, 192, 128>, 0 -> 8 at fp8 256 on sm_90.)
            if (capped) {
#pragma unroll
              for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][nt][i] = soft_cap(s[mt][nt][i]);
            } else {
#pragma unroll
              for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][nt][i] *= mod.qk_mul;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float sl = slope[kScoreMods ? mt : 0][h];
              const float bias0 = sl * float(lane_key0 - pos[kScoreMods ? mt : 0][h]);
#pragma unroll
              for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) s[mt][nt][2 * h + e] += fmaf(sl, float(nt * 8 + e), bias0);
            }
          }
          if constexpr (kEdge) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              // key = lane_key0 + c is visible iff (unsigned)(c - first) < width: one compare per score.
              const int first = keys[mt][h].lo - lane_key0;
              const unsigned width = unsigned(max(keys[mt][h].hi - keys[mt][h].lo, 0));
#pragma unroll
              for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                  if (unsigned(nt * 8 + e - first) >= width) s[mt][nt][2 * h + e] = -INFINITY;
            }
          }
#pragma unroll
          for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) mx[mt][i / 2] = fmaxf(mx[mt][i / 2], s[mt][nt][i]);
        }
        float alpha[MT][2];
        // P as P V's A fragments (mma.cuh: two score n-tiles' C layout is one k-step's A layout), 16-bit
        // from here on: half the registers of the float scores while P V runs.
        uint32_t pa[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          update_row_states<NT_S, false>(s[mt], mx[mt], m[mt], l[mt], alpha[mt], exp_mul);
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) p_frag<T>(pa[mt][kk], s[mt], kk);
        }

        if constexpr (!kStaged) {
          // This tile's V group, the only one in flight.
          cp_async_wait<0>();
          __syncthreads();  // V visible; every warp is done with this tile's K
          if (has_next) stage_k(kv0 + BN);
        }
        bool add_back = false;
        if constexpr (kEdge) {
          // Non-finite V elements (exponent all ones) of keys hidden from some row: zero in the
          // tile, added back below; word by word on the raw bits.
          bool held_back = false;
#pragma unroll 1
          for (int pass = 0; pass < VTileGrid::template passes<BN>(); ++pass) {
            const int j = vtile_grid.row(pass), c = vtile_grid.chunk(pass), tok = kv0 + j;
            if (c < v_data_chunks && tok < kv_end && !seen_by_all.contains(tok)) {
              uint4* at = reinterpret_cast<uint4*>(Vt + swizzled_offset<DV>(j, c));
              uint32_t w[4];
              memcpy(w, at, 16);
              uint32_t dropped = 0;
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const uint32_t drop = nonfinite_halves<T>(w[i]);
                w[i] &= ~drop;
                dropped |= drop;
              }
              if (dropped) {
                memcpy(at, w, 16);
                held_back = true;
              }
            }
          }
          add_back = __syncthreads_or(held_back) != 0;  // block-uniform
        }

        // compute_pv: B fragments of two n-tiles per ldmatrix x4 .trans: matrix l / 8 = (keys 0-7 |
        // 8-15) x (dims 0-7 | 8-15), in the order b[nt][0], b[nt][1], b[nt + 1][0], b[nt + 1][1].
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) rescale_o(o[mt], alpha[mt]);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
          for (int np = 0; np < NT_O / 2; ++np) {
            uint32_t b[4];
            ldmatrix<4, true>(b, v_rows(kk * 16, np));
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              mma_16816<T>(o[mt][2 * np], pa[mt][kk], b0);
              mma_16816<T>(o[mt][2 * np + 1], pa[mt][kk], b1);
            }
          }
        }
        if (kEdge && add_back) add_back_nonfinite_v_paired<T>(o, pa, V, kv0, min(BN, kv_end - kv0), Dv, keys, seen_by_all);
      };
      if (kv0 < seen_by_all.lo || kv0 + BN > seen_by_all.hi) tile_step(std::true_type{});  // block-uniform
      else tile_step(std::false_type{});
    }

    store_rows_paired<T>(p, o, m, l, warp_row0 + g, nrows, q0, kvh * group, Dv, vscale, query_of, head_of);
  }
}

// `pl`: plan_prefill(p, cfg) (kernels/plan.h), computed once by the binding.
inline void launch(const AttentionParams& p, const PrefillPlan& pl, Stream stream) {
  const dim3 grid(unsigned(pl.grid_x), unsigned(pl.grid_y));
  dispatch_float(p.dtype, [&](auto tt) {
    using T = typename decltype(tt)::type;
    dispatch_cache<T>(p.dtype, p.cache_dtype, [&](auto kt) {
      using KV = typename decltype(kt)::type;
      if constexpr (std::is_same_v<T, float>) {
        // fp32 queries have no tensor-core path (plan_prefill never picks it for them).
      } else {
        if (pl.tensor_cores && pl.pipelined) {
          auto run = [&](auto kernel) {
            PAGED_ALLOW_SMEM(kernel, pl.smem);
            PAGED_LAUNCH(kernel, grid, dim3(kTcThreads), pl.smem, stream, p, pl.row_tiles);
            PAGED_CHECK_LAUNCH("prefill_tc_pipelined_kernel");
          };
          auto run_heads = [&](auto mods) {
            constexpr bool kMods = decltype(mods)::value;
            if (pl.head_tile == 64) run(prefill_tc_pipelined_kernel<T, KV, 64, 64, kMods>);
            else if (pl.head_tile == 128) run(prefill_tc_pipelined_kernel<T, KV, 128, 128, kMods>);
            else if (pl.head_tile == 192) run(prefill_tc_pipelined_kernel<T, KV, 192, 128, kMods>);
            else run(prefill_tc_pipelined_kernel<T, KV, 256, 256, kMods>);
          };
          if (pl.score_mods) run_heads(std::true_type{});
          else run_heads(std::false_type{});
          return;
        }
        if (pl.tensor_cores) {
          auto run = [&](auto kernel) {
            PAGED_ALLOW_SMEM(kernel, pl.smem);
            PAGED_LAUNCH(kernel, grid, dim3(kTcThreads), pl.smem, stream, p, pl.row_tiles, pl.k_aligned,
                         pl.v_aligned);
            PAGED_CHECK_LAUNCH("prefill_tc_kernel");
          };
          if (pl.head_tile == 64) run(prefill_tc_kernel<T, KV, 64>);
          else if (pl.head_tile == 128) run(prefill_tc_kernel<T, KV, 128>);
          else run(prefill_tc_kernel<T, KV, 256>);
          return;
        }
      }
      auto run = [&](auto kernel) {
        PAGED_ALLOW_SMEM(kernel, pl.smem);
        PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.row_tiles, pl.kv_tile, pl.k_aligned,
                     pl.v_aligned);
        PAGED_CHECK_LAUNCH("prefill_kernel");
      };
      if (pl.max_chunks == kPrefillChunks) run(prefill_kernel<T, KV>);
      else run(prefill_wide_kernel<T, KV>);
    });
  });
}

}  // namespace prefill
}  // namespace PAGED_KERNEL_NS

// Varlen paged prefill attention: two kernels over the same tiling.
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
// slope * (j - pos) is added as slope_log2 * (j - pos) (slope_log2 = 0 without alibi_slopes).
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
// for the softmax bookkeeping, V -> smem (same buffer), each thread owning head_size / 8 output
// elements of one row. K/V tile rows are padded by one float so threads reading different tokens
// at the same dimension hit different banks.
constexpr int kMaxChunksPerThread = 32;  // head_size 256 / 8 threads per row

template <typename T, typename KV>
__global__ void __launch_bounds__(256) prefill_kernel(AttentionParams p, int64_t row_tiles, int BN, bool k_aligned,
                                                       bool v_aligned) {
  PAGED_LAUNCH_BOUNDS_CHECK(256);
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
  const int D = int(p.head_size), ld = D + 1, nchunks = D / 8;

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

    // stage_kv: one K or V tile of BN tokens into KVs as float; rows past kv_end are zeros.
    auto stage_kv = [&](const PagedKV<KV>& cache, bool aligned, float mul, int kv0) {
      for (int e = threadIdx.x; e < BN * nchunks; e += nt) {
        const int j = e / nchunks, c = (e % nchunks) * 8, t = kv0 + j;
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
      stage_kv(K, k_aligned, kscale, kv0);
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
      stage_kv(V, v_aligned, vscale, kv0);
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
          if (k < nchunks) {
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
        if (k < nchunks) o[myc + 8 * k] = from_float<T>(acc[k] * inv);
    }
  }
}

// The add-back of the tensor-core kernel's edge tiles: for every key of the tile hidden from some
// row whose V has a non-finite element (staged as 0), o += p * v for exactly the rows that see it.
// The probability of (row, key) is in the S fragment of the row's quad lane that holds the key's
// column: a shuffle brings it to the quad's 4 lanes, each owning 2 of the row's output columns
// per n-tile. V is read again from the cache (rare: only a tile that held a value back).
// Warp-uniform loop bounds: the shuffles see the full warp.
template <int NT_S, int NT_O, typename KV>
__device__ __forceinline__ void add_back_nonfinite_v(float (&o)[NT_O][4], const float (&s)[NT_S][4],
                                                     const PagedKV<KV>& V, int kv0, int n, int D,
                                                     const KeyRange (&keys)[2], KeyRange seen_by_all) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  // Key c = nt * 8 + cc of the tile: nt unrolled, so the fragment registers are indexed by
  // constants only (a runtime index would move s to local memory).
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt) {
    for (int cc = 0; cc < 8 && nt * 8 + cc < n; ++cc) {
      const int tok = kv0 + nt * 8 + cc;
      if (seen_by_all.contains(tok)) continue;  // its values were staged as they are
      const int src = (lane & ~3) | (cc / 2);
      const float pr[2] = {__shfl_sync(kFullMask, cc % 2 ? s[nt][1] : s[nt][0], src),
                           __shfl_sync(kFullMask, cc % 2 ? s[nt][3] : s[nt][2], src)};
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
  const int D = int(p.head_size), Dp = (D + 15) / 16 * 16, ld = Dp + 8;

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

    // This lane's two rows: position, visible keys (none for padding rows), ALiBi slope.
    int pos[2];
    KeyRange keys[2];
    float slope[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      pos[h] = seq_len - q_len + int((row0 + r) / group);
      keys[h] = r < nrows ? visible_keys(p, pos[h], seq_len) : KeyRange{0, 0};
      slope[h] = r < nrows ? alibi_log2(p, kvh * group + int((row0 + r) % group)) : 0.f;
    }
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
      // stage_kv: raw cache values (exact in T), zeros past kv_end and in the padding columns.
      for (int e = threadIdx.x; e < BN * cpr; e += kTcThreads) {
        const int j = e / cpr, c = (e % cpr) * 8, tok = kv0 + j;
        float x[8], y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = y[i] = 0.f;
        if (tok < kv_end && c < D) {
          load8(K.row(tok) + c, x, k_aligned);
          load8(V.row(tok) + c, y, v_aligned);
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
          const float pr = s[nt][i] == -INFINITY ? 0.f : exp2f(s[nt][i] - m[i / 2]);  // NaN stays NaN
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

      // compute_pv
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
      if (add_back)
        add_back_nonfinite_v<NT_S, NT_O>(o, s, V, kv0, min(BN, kv_end - kv0), D, keys, seen_by_all);
    }

    // store
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      if (r < nrows) {
        const int qi = int((row0 + r) / group), gg = int((row0 + r) % group);
        // The quad's 4 lanes hold the same m and l; lane t = 0 writes lse.
        const float inv = finish_row(p, m[h], l[h], q0 + qi, kvh * group + gg, t == 0) * vscale;
        T* out = static_cast<T*>(p.out) + (q0 + qi) * p.o_stride_token + (kvh * group + gg) * p.o_stride_head;
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
      auto kernel = prefill_kernel<T, KV>;
      PAGED_ALLOW_SMEM(kernel, pl.smem);
      PAGED_LAUNCH(kernel, grid, dim3(pl.threads), pl.smem, stream, p, pl.row_tiles, pl.kv_tile, pl.k_aligned,
                   pl.v_aligned);
      PAGED_CHECK_LAUNCH("prefill_kernel");
    });
  });
}

}  // namespace prefill
}  // namespace PAGED_KERNEL_NS

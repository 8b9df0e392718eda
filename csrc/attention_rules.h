// The attention contract's shared rules (paged_ops/reference.py attention), written once for every
// C++ backend: which keys a query row sees (visible_keys) and how a row ends (end_row: the sink
// joined once, the empty row, the log-sum-exp). Each backend keeps its own arithmetic: end_row is
// templated on a Base policy, so the CUDA kernels run it in fp32 with base-2 logs (Base2F32: their
// scores are kept times log2 e, since exp2 is one instruction) and the cpu backend in fp64 with
// natural logs (BaseEF64).
//
// No torch, no CUDA types: the cpu backend compiles this with g++, the emulator with the host
// compiler, the CUDA kernels with nvcc (PAGED_HOST_DEVICE makes every function callable on both
// sides there).
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define PAGED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PAGED_HOST_DEVICE inline
#endif

namespace paged {

// float: the constants multiply fp32 values (scale, slopes, sinks) in the kernels' own type.
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): a natural-log score times it is a base-2 one
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): back from base 2 to natural logs

// ---- which keys a row sees ---------------------------------------------------------------------
// Keys [lo, hi) -- half-open; empty when lo >= hi -- of the query row at position pos of a
// sequence of kv_len keys (pos = kv_len - q_len + i for row i: negative for the first rows when
// q_len > kv_len). Key j is visible iff (not causal or j <= pos) and (window_left < 0 or
// j >= pos - window_left) and (window_right < 0 or j <= pos + window_right); 0 <= lo and hi <=
// kv_len always. Both ends grow with pos, so the rows pos0 <= pos <= pos1 of a tile see nothing
// outside [visible_keys(pos0).lo, visible_keys(pos1).hi).
// I is the positions' type: int64_t on the cpu, int in the CUDA kernels (whose sequences fit int:
// the binding checks); the windows are int64, and nothing here overflows: they go up to INT64_MAX.
template <typename I = int64_t>
struct KeyRange {
  I lo, hi;
  PAGED_HOST_DEVICE bool empty() const { return lo >= hi; }
  PAGED_HOST_DEVICE bool contains(I j) const { return j >= lo && j < hi; }
};

template <typename I>
PAGED_HOST_DEVICE KeyRange<I> visible_keys(I pos, I kv_len, bool causal, int64_t window_left, int64_t window_right) {
  // pos > window_left >= 0: pos - window_left is in (0, pos], no overflow, and fits I.
  const I lo = window_left >= 0 && pos > window_left ? I(pos - window_left) : I(0);
  I hi = kv_len;
  if (causal) {
    if (pos < kv_len) hi = pos + 1;  // under causal, window_right changes nothing
  } else if (window_right >= 0 && window_right < int64_t(kv_len) - pos) {
    hi = I(pos + window_right + 1);  // < kv_len + 1
  }
  return KeyRange<I>{lo, hi};
}

// ---- how a row ends ----------------------------------------------------------------------------
// A Base policy is a backend's arithmetic for end_row:
//   using F = ...;               the float type of the row's state
//   exp(x), log(x)               b^x and log_b(x) in the row's base b
//   from_ln(x), to_ln(x)         a natural log into base b and back
//   ratio(num, l)                num / l, 0 when l == 0 (the empty row's multiplier), NaN when l is
//                                NaN

// The CUDA kernels: fp32, base 2. One reciprocal per row, since each thread multiplies its many
// accumulators of the row by the result.
struct Base2F32 {
  using F = float;
  static PAGED_HOST_DEVICE float exp(float x) { return exp2f(x); }
  static PAGED_HOST_DEVICE float log(float x) { return log2f(x); }
  static PAGED_HOST_DEVICE float from_ln(float x) { return x * kLog2e; }
  static PAGED_HOST_DEVICE float to_ln(float x) { return x * kLn2; }
  static PAGED_HOST_DEVICE float ratio(float num, float l) {
    return num * (l > 0.f ? 1.f / l : l == 0.f ? 0.f : NAN);
  }
};

// The cpu backend: fp64, natural logs (its running sums are fp64 so that long contexts keep their
// precision).
struct BaseEF64 {
  using F = double;
  static PAGED_HOST_DEVICE double exp(double x) { return ::exp(x); }
  static PAGED_HOST_DEVICE double log(double x) { return ::log(x); }
  static PAGED_HOST_DEVICE double from_ln(double x) { return x; }
  static PAGED_HOST_DEVICE double to_ln(double x) { return x; }
  static PAGED_HOST_DEVICE double ratio(double num, double l) { return l == 0.0 ? 0.0 : num / l; }
};

// A finished row: out = acc * mul for its unnormalised accumulator acc, and its log-sum-exp lse
// (natural log, as the contract's lse output).
template <typename F>
struct RowEnd {
  F mul, lse;
};

// The head's sink logit (natural log) as end_row takes it: -inf, no sink, where there are none.
template <typename F>
PAGED_HOST_DEVICE F sink_logit(const float* sinks, int64_t head) {
  return sinks ? F(sinks[head]) : -F(INFINITY);
}

// The end of a row from its running max m and sum l in the policy's base (m = -inf and l = 0: no
// finite score was seen, because the row sees no key or only -inf scores; l NaN: a NaN score) and
// its head's sink (natural log, sink_logit), joined here and only here, once per row. num is a
// factor folded into the multiplier (a value scale; 1: none). As the reference computes it:
//  * no sink (-inf adds nothing to the denominator): mul = num / l, lse = ln l + m; a row with
//    nothing to weigh (l = 0) is out 0, lse -inf;
//  * a sink is one more logit with no value: a finite one on a row with nothing gives out 0 and
//    lse = sink exactly (bitwise, in either base); +inf makes a finite row out 0 and lse +inf;
//    NaN makes the row NaN;
//  * no exp(inf - inf): the larger of m and the sink is the reference point, and a +inf sink is
//    only ever subtracted from a finite m (or m is -inf: factor 0, not exp(-inf - -inf) = NaN).
// A sink above the row's max gives lse = sink + ln l' straight in natural logs: in fp32, sink *
// log2 e overflows past ~2.4e38, and its round trip through base 2 is inexact.
template <typename Base, typename F = typename Base::F>
PAGED_HOST_DEVICE RowEnd<F> end_row(F m, F l, F sink, F num = F(1)) {
  const F inf = F(INFINITY);
  if (sink == -inf) return RowEnd<F>{Base::ratio(num, l), Base::to_ln(m + Base::log(l))};
  const F s = Base::from_ln(sink);  // +-inf when it overflows: then the sink dominates or vanishes
  if (m != -inf && m >= s) {  // the row's max dominates (a NaN sink fails the test: below)
    l += Base::exp(s - m);
    return RowEnd<F>{Base::ratio(num, l), Base::to_ln(m + Base::log(l))};
  }
  // The sink dominates (or is NaN): the row's terms scale by b^(m - s), 0 when no score is finite.
  const F a = m == -inf ? F(0) : Base::exp(m - s);
  l = l * a + F(1);
  if (sink != sink) l = F(NAN);
  return RowEnd<F>{Base::ratio(num * a, l), sink + Base::to_ln(Base::log(l))};
}

}  // namespace paged

// merge_states for the cpu backend (semantics: paged_ops/reference.py): each row's N partial
// outputs (split-KV, context parallelism) weighted by their log-sum-exps,
//   out = sum_i e^{lse_i} states_i / sum_i e^{lse_i},  out_lse = ln sum_i e^{lse_i}.
// Memory-bound: the weights are computed once per row in fp64 (relative to the largest lse, so
// no exp overflows), the row itself summed in fp32; threads split the tokens.
// A state with lse -inf contributes nothing and its out is not read (an empty attention's);
// every state -inf, or none at all: out 0, out_lse -inf; any lse +inf or NaN: a NaN row.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/ops.h"

namespace paged::cpu {
namespace {

template <typename T>
void merge_state_rows(const MergeStatesParams& p) {
  // out: [num_tokens, num_heads, head_size]; states: [num_tokens, num_states, num_heads,
  // head_size], unit stride in the last dimension; states_lse: [num_tokens, num_states,
  // num_heads], any strides; out_lse: [num_tokens, num_heads], contiguous.
  const int64_t num_tokens = p.num_tokens, num_heads = p.num_heads, head_size = p.head_size;
  const int64_t num_states = p.num_states;
  T* o = static_cast<T*>(p.out);
  const T* x = static_cast<const T*>(p.states);
  const float* lse = p.states_lse;
  float* out_lse = p.out_lse;
  const int64_t o_token = p.o_stride_token, o_head = p.o_stride_head;
  const int64_t x_token = p.s_stride_token, x_state = p.s_stride_state, x_head = p.s_stride_head;
  const int64_t l_token = p.lse_stride_token, l_state = p.lse_stride_state, l_head = p.lse_stride_head;
  // ~16K elements read per chunk of tokens: a parallel region for less costs more than it saves.
  const int64_t per_token = std::max<int64_t>(1, num_heads * std::max<int64_t>(1, num_states) * head_size);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / per_token);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> acc(head_size);
    std::vector<double> weight(num_states);
    for (int64_t token = begin; token < end; ++token)
      for (int64_t head = 0; head < num_heads; ++head) {
        T* dst = o + token * o_token + head * o_head;
        float* dst_lse = out_lse != nullptr ? out_lse + token * num_heads + head : nullptr;
        const float* row_lse = lse + token * l_token + head * l_head;
        // The largest lse; NaN or +inf anywhere: the row is NaN (a weight of exp(inf - inf)).
        double m = kNegInf;
        bool nan_row = false;
        for (int64_t i = 0; i < num_states; ++i) {
          const double v = row_lse[i * l_state];
          nan_row |= std::isnan(v) || v == std::numeric_limits<double>::infinity();
          m = std::max(m, v);
        }
        if (nan_row || m == kNegInf) {  // NaN, or no state saw a key: an empty row
          std::fill(dst, dst + head_size, T(nan_row ? kNaN : 0.f));
          if (dst_lse != nullptr) *dst_lse = nan_row ? kNaN : float(kNegInf);
          continue;
        }
        double total = 0.0;
        for (int64_t i = 0; i < num_states; ++i) {
          const double v = row_lse[i * l_state];
          weight[i] = v == kNegInf ? -1.0 : std::exp(v - m);  // -1: not read; the largest: 1
          total += std::max(weight[i], 0.0);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = 0; i < num_states; ++i) {
          if (weight[i] < 0.0) continue;  // lse -inf: contributes nothing, even a NaN out
          const float wi = float(weight[i] / total);
          const T* xi = x + token * x_token + i * x_state + head * x_head;
          for (int64_t d = 0; d < head_size; ++d) acc[d] += wi * static_cast<float>(xi[d]);
        }
        for (int64_t d = 0; d < head_size; ++d) dst[d] = T(acc[d]);
        if (dst_lse != nullptr) *dst_lse = float(m + std::log(total));
      }
  });
}

}  // namespace

void merge_states(const MergeStatesParams& p, Stream) {
  with_float_type(p.dtype, [&](auto tag) { merge_state_rows<decltype(tag)>(p); });
}

}  // namespace paged::cpu

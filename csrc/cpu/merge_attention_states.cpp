// merge_attention_states for the cpu backend (semantics: paged_ops/reference.py): each row's
// two partial outputs weighted by their log-sum-exps. Memory-bound: the weights are computed
// once per row in fp64, the row itself in fp32 (the compiler vectorizes the loops).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/ops.h"

namespace paged::cpu {
namespace {

template <typename T>
void merge_rows(const MergeParams& p) {
  // out, prefix_out, suffix_out: [num_tokens, num_heads, head_size], unit stride in the last
  // dimension; the lses: [num_tokens, num_heads], contiguous.
  const int64_t num_heads = p.num_heads, head_size = p.head_size, num_rows = p.num_tokens * num_heads;
  T* o = static_cast<T*>(p.out);
  const T* a_out = static_cast<const T*>(p.prefix_out);
  const T* b_out = static_cast<const T*>(p.suffix_out);
  const float* prefix_lse = p.prefix_lse;
  const float* suffix_lse = p.suffix_lse;
  float* out_lse = p.out_lse;
  const int64_t o_token = p.o_stride_token, o_head = p.o_stride_head;
  const int64_t a_token = p.prefix_stride_token, a_head = p.prefix_stride_head;
  const int64_t b_token = p.suffix_stride_token, b_head = p.suffix_stride_head;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(head_size, 1));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    for (int64_t row = begin; row < end; ++row) {
      const int64_t token = row / num_heads, head = row % num_heads;
      T* dst = o + token * o_token + head * o_head;
      const T* pa = a_out + token * a_token + head * a_head;
      const T* pb = b_out + token * b_token + head * b_head;
      const double a = prefix_lse[row], b = suffix_lse[row];
      if (a == kNegInf && b == kNegInf) {  // neither side saw a key: an empty row, 0 and lse -inf
        std::fill(dst, dst + head_size, T(0.f));
        if (out_lse != nullptr) out_lse[row] = float(kNegInf);
        continue;
      }
      // NaN in either lse makes the row NaN; so does +inf (its weight is exp(inf - inf)).
      const double m = (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
      // A side with lse -inf contributes nothing: its values (NaN for an empty attention) are not read.
      const double wa = a == kNegInf ? 0.0 : std::exp(a - m), wb = b == kNegInf ? 0.0 : std::exp(b - m);
      const double total = wa + wb;
      const float fa = float(wa / total), fb = float(wb / total);
      if (b == kNegInf) {
        for (int64_t d = 0; d < head_size; ++d) dst[d] = T(fa * static_cast<float>(pa[d]));
      } else if (a == kNegInf) {
        for (int64_t d = 0; d < head_size; ++d) dst[d] = T(fb * static_cast<float>(pb[d]));
      } else {
        for (int64_t d = 0; d < head_size; ++d)
          dst[d] = T(fa * static_cast<float>(pa[d]) + fb * static_cast<float>(pb[d]));
      }
      if (out_lse != nullptr) out_lse[row] = float(m + std::log(total));
    }
  });
}

}  // namespace

void merge_attention_states(const MergeParams& p, Stream) {
  with_float_type(p.dtype, [&](auto tag) { merge_rows<decltype(tag)>(p); });
}

}  // namespace paged::cpu

// merge_attention_states for the cpu backend (semantics: paged_ops/reference.py): each row's
// two partial outputs weighted by their log-sum-exps. Memory-bound: the weights are computed
// once per row in fp64, the row itself in fp32 (the compiler vectorizes the loops).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops.h"

namespace paged::cpu {
namespace {

template <typename T>
void merge_rows(Tensor& out, float* out_lse, const Tensor& prefix_out, const float* prefix_lse,
                const Tensor& suffix_out, const float* suffix_lse) {
  // out, prefix_out, suffix_out: [num_tokens, num_heads, head_size], unit stride in the last
  // dimension; the lses: [num_tokens, num_heads], contiguous.
  const int64_t num_heads = out.size(1), head_size = out.size(2), num_rows = out.size(0) * num_heads;
  T* o = out.data_ptr<T>();
  const T* a_out = prefix_out.data_ptr<T>();
  const T* b_out = suffix_out.data_ptr<T>();
  const int64_t o_token = out.stride(0), o_head = out.stride(1);
  const int64_t a_token = prefix_out.stride(0), a_head = prefix_out.stride(1);
  const int64_t b_token = suffix_out.stride(0), b_head = suffix_out.stride(1);
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

void merge_attention_states(Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                            const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse) {
  float* lse = out_lse ? out_lse->data_ptr<float>() : nullptr;
  const float* a = prefix_lse.data_ptr<float>();
  const float* b = suffix_lse.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: return merge_rows<float>(out, lse, prefix_out, a, suffix_out, b);
    case at::kHalf: return merge_rows<c10::Half>(out, lse, prefix_out, a, suffix_out, b);
    case at::kBFloat16: return merge_rows<c10::BFloat16>(out, lse, prefix_out, a, suffix_out, b);
    default: TORCH_CHECK(false, "paged cpu merge_attention_states: unsupported dtype ", out.scalar_type());
  }
}

}  // namespace paged::cpu

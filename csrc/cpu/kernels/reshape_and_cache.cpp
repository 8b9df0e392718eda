// reshape_and_cache for the cpu backend: scatter each token's K/V rows into its cache slot,
// quantizing to fp8 on the way when the cache is fp8.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "cpu/convert.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {
namespace {

template <typename XT, typename CT>
void scatter(const Tensor& x, Tensor& cache, const int64_t* slots, const OptTensor& scale) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), D = x.size(2);
  const int64_t block_size = cache.size(1);
  const int64_t sb = cache.stride(0), st = cache.stride(1), sh = cache.stride(2);
  const int64_t xt = x.stride(0), xh = x.stride(1);
  const XT* src = x.data_ptr<XT>();
  CT* dst = cache.data_ptr<CT>();
  const float* scales = scale ? scale->data_ptr<float>() : nullptr;
  const bool per_head = scale && scale->numel() > 1;
  if (num_heads * D == 0) return;  // nothing to store (0 KV heads is validated away too)
  TORCH_CHECK(block_size >= 1, "reshape_and_cache: block_size must be >= 1");
  // Chunks of >= 64K elements: a parallel region for less costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (num_heads * D));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token
      CT* row = dst + (slot / block_size) * sb + (slot % block_size) * st;
      for (int64_t h = 0; h < num_heads; ++h) {
        const XT* in = src + t * xt + h * xh;
        CT* o = row + h * sh;
        if constexpr (is_fp8_v<CT>) {
          quantize_row(in, o, D, scales[per_head ? h : 0]);
        } else {
          std::memcpy(o, in, D * sizeof(CT));  // validated: same dtype
        }
      }
    }
  });
}

template <typename XT>
void scatter_to(const Tensor& x, Tensor& cache, const int64_t* slots, const OptTensor& scale) {
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return scatter<XT, c10::Float8_e4m3fn>(x, cache, slots, scale);
    case at::kFloat8_e5m2: return scatter<XT, c10::Float8_e5m2>(x, cache, slots, scale);
    default: return scatter<XT, XT>(x, cache, slots, scale);
  }
}

void scatter_any(const Tensor& x, Tensor& cache, const int64_t* slots, const OptTensor& scale) {
  switch (x.scalar_type()) {
    case at::kFloat: return scatter_to<float>(x, cache, slots, scale);
    case at::kHalf: return scatter_to<c10::Half>(x, cache, slots, scale);
    case at::kBFloat16: return scatter_to<c10::BFloat16>(x, cache, slots, scale);
    default: TORCH_CHECK(false, "reshape_and_cache: unsupported key dtype ", x.scalar_type());
  }
}

}  // namespace

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache,
                       Tensor& value_cache, const Tensor& slot_mapping, const OptTensor& k_scale,
                       const OptTensor& v_scale) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  scatter_any(key, key_cache, slots, k_scale);
  scatter_any(value, value_cache, slots, v_scale);
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

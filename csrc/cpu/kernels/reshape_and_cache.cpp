// reshape_and_cache for the cpu backend: scatter each token's K/V rows into its cache slot,
// quantizing to fp8 on the way when the cache is fp8.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu/convert.h"
#include "cpu/isa.h"

namespace paged::cpu::PAGED_CPU_ISA_NS {
namespace {

// One side (K or V): rows x [num_tokens, num_kv_heads, head_size] by strides into cache
// [num_blocks, block_size, num_kv_heads, head_size] by strides.
struct Side {
  int64_t head_size;  // K's and V's may differ (MLA: the latent and its RoPE part)
  const void* x;
  int64_t x_stride_token, x_stride_head;
  void* cache;
  int64_t stride_block, stride_token, stride_head;
  const float* scale;  // fp8: scale[h * scale_head_stride]
  int64_t scale_head_stride;
};

template <typename XT, typename CT>
void scatter(const ReshapeCacheParams& p, const Side& s) {
  const int64_t num_heads = p.num_kv_heads, D = s.head_size, block_size = p.block_size;
  if (num_heads * D == 0) return;  // nothing to store (0 KV heads is validated away too)
  TORCH_CHECK(block_size >= 1, "reshape_and_cache: block_size must be >= 1");
  const XT* src = static_cast<const XT*>(s.x);
  CT* dst = static_cast<CT*>(s.cache);
  // Chunks of >= 64K elements: a parallel region for less costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (num_heads * D));
  at::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;  // padding token
      CT* row = dst + (slot / block_size) * s.stride_block + (slot % block_size) * s.stride_token;
      for (int64_t h = 0; h < num_heads; ++h) {
        const XT* in = src + t * s.x_stride_token + h * s.x_stride_head;
        CT* o = row + h * s.stride_head;
        if constexpr (is_fp8_v<CT>) {
          quantize_row(in, o, D, s.scale[h * s.scale_head_stride]);
        } else {
          std::memcpy(o, in, D * sizeof(CT));  // validated: same dtype
        }
      }
    }
  });
}

void scatter_any(const ReshapeCacheParams& p, const Side& s) {
  with_float_type(p.dtype, [&](auto x_tag) {
    using XT = decltype(x_tag);
    if (p.cache_dtype == p.dtype) return scatter<XT, XT>(p, s);
    with_fp8_type(p.cache_dtype, [&](auto c_tag) { scatter<XT, decltype(c_tag)>(p, s); });
  });
}

}  // namespace

void reshape_and_cache(const ReshapeCacheParams& p, Stream) {
  scatter_any(p, Side{p.head_size, p.key, p.key_stride_token, p.key_stride_head, p.key_cache, p.k_stride_block, p.k_stride_token,
                      p.k_stride_head, p.k_scale, p.k_scale_head_stride});
  scatter_any(p, Side{p.value_head_size, p.value, p.value_stride_token, p.value_stride_head, p.value_cache, p.v_stride_block,
                      p.v_stride_token, p.v_stride_head, p.v_scale, p.v_scale_head_stride});
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS

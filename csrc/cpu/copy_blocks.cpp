// copy_blocks for the cpu backend: every (src, dst) pair applied to every layer's caches.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "ops.h"

namespace paged::cpu {

// Copies one block row by row through the cache's strides, so permuted layouts work too.
void copy_block(const Tensor& cache, int64_t src, int64_t dst) {
  const int64_t rows_t = cache.size(1), rows_h = cache.size(2);
  const int64_t row_bytes = cache.size(3) * cache.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t esize = cache.element_size();
  const int64_t sb = cache.stride(0) * esize, st = cache.stride(1) * esize, sh = cache.stride(2) * esize;
  for (int64_t t = 0; t < rows_t; ++t)
    for (int64_t h = 0; h < rows_h; ++h)
      std::memcpy(base + dst * sb + t * st + h * sh, base + src * sb + t * st + h * sh, row_bytes);
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const Tensor& block_mapping) {
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const int64_t num_pairs = block_mapping.size(0), num_layers = int64_t(key_caches.size());
  // Destinations are distinct and never sources (validated), so all copies are independent.
  // Chunks of >= 256 KiB: a parallel region for less costs more than it saves.
  const int64_t block_bytes = key_caches[0].numel() / key_caches[0].size(0) * key_caches[0].element_size();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, num_pairs * num_layers * 2, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t pair = i / (num_layers * 2), layer = (i / 2) % num_layers;
      const Tensor& cache = (i % 2 == 0) ? key_caches[layer] : value_caches[layer];
      copy_block(cache, pairs[2 * pair], pairs[2 * pair + 1]);
    }
  });
}

}  // namespace paged::cpu

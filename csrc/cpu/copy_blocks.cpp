// copy_blocks for the cpu backend: every (src, dst) pair applied to every layer's caches.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>

#include "block_copy.h"
#include "ops.h"

namespace paged::cpu {

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const Tensor& block_mapping) {
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const int64_t num_pairs = block_mapping.size(0), num_layers = int64_t(key_caches.size());
  if (num_pairs == 0 || num_layers == 0 || key_caches[0].size(0) == 0) return;  // nothing to copy
  // Destinations are distinct and never sources (validated), so all copies are independent.
  // Chunks of >= 256 KiB: a parallel region for less costs more than it saves.
  const int64_t block_bytes = key_caches[0].numel() / key_caches[0].size(0) * key_caches[0].element_size();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, num_pairs * num_layers * 2, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t pair = i / (num_layers * 2), layer = (i / 2) % num_layers;
      const Tensor& cache = (i % 2 == 0) ? key_caches[layer] : value_caches[layer];
      copy_block(cache, pairs[2 * pair], cache, pairs[2 * pair + 1]);
    }
  });
}

}  // namespace paged::cpu

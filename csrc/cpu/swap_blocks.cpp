// swap_blocks for the cpu backend: whole-block copies between two CPU caches. (Swaps that
// cross devices are handled by the backend that owns the device.)
#include <ATen/core/Tensor.h>

#include "block_copy.h"
#include "ops.h"

namespace paged::cpu {

void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) copy_block(src, pairs[2 * i], dst, pairs[2 * i + 1]);
}

}  // namespace paged::cpu

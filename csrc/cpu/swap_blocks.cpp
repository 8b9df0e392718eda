// swap_blocks for the cpu backend: whole-block copies between two CPU caches. (Swaps that
// cross devices are handled by the backend that owns the device.)
#include <ATen/core/Tensor.h>

#include <cstring>

#include "ops.h"

namespace paged::cpu {

void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const int64_t rows_t = src.size(1), rows_h = src.size(2);
  const int64_t row_bytes = src.size(3) * src.element_size(), esize = src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    const int64_t from = pairs[2 * i], to = pairs[2 * i + 1];
    for (int64_t t = 0; t < rows_t; ++t)
      for (int64_t h = 0; h < rows_h; ++h)
        std::memcpy(d + (to * dst.stride(0) + t * dst.stride(1) + h * dst.stride(2)) * esize,
                    s + (from * src.stride(0) + t * src.stride(1) + h * src.stride(2)) * esize, row_bytes);
  }
}

}  // namespace paged::cpu

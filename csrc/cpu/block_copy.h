// One whole-block copy through the caches' strides (so permuted HND layouts work): shared by
// copy_blocks (within a cache) and swap_blocks (between two caches).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstring>

namespace paged::cpu {

// dst is written through its data pointer: a const handle, like the TensorList copy_blocks gets.
inline void copy_block(const at::Tensor& src, int64_t from, const at::Tensor& dst, int64_t to) {
  const int64_t esize = src.element_size(), row_bytes = src.size(3) * esize;
  const char* s = static_cast<const char*>(src.data_ptr()) + from * src.stride(0) * esize;
  char* d = static_cast<char*>(dst.data_ptr()) + to * dst.stride(0) * esize;
  for (int64_t t = 0; t < src.size(1); ++t)
    for (int64_t h = 0; h < src.size(2); ++h)
      std::memcpy(d + (t * dst.stride(1) + h * dst.stride(2)) * esize,
                  s + (t * src.stride(1) + h * src.stride(2)) * esize, row_bytes);
}

}  // namespace paged::cpu

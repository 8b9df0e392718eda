// copy_blocks over all layers in one launch.
#pragma once
#include "kernels/common.cuh"
#include "kernels/params.h"

namespace PAGED_KERNEL_NS {
namespace cache {

// copy_blocks: grid (num_pairs, num_caches). Block (pair, cache) copies block src -> dst of one
// cache tensor (every layer's K and V caches are entries of `caches`, a device array), row by row:
// a row is one (token, head) = head_size contiguous elements, whatever the cache's layout.
// Rows are copied in 16-byte words when the row's byte length and addresses allow it.
__global__ void __launch_bounds__(256) copy_blocks_kernel(const CacheDesc* caches, const int64_t* mapping) {
  const CacheDesc c = caches[blockIdx.y];
  const int64_t src = mapping[2 * blockIdx.x], dst = mapping[2 * blockIdx.x + 1];
  char* base = reinterpret_cast<char*>(c.ptr);
  const int64_t eb = c.elem_bytes;
  const int row_bytes = c.head_size * c.elem_bytes;
  const int rows = c.block_size * c.num_heads;
  const bool vec = row_bytes % 16 == 0 && c.ptr % 16 == 0 && (c.stride_block * eb) % 16 == 0 &&
                   (c.stride_tok * eb) % 16 == 0 && (c.stride_head * eb) % 16 == 0;
  const int words = vec ? row_bytes / 16 : row_bytes;
  for (int64_t i = threadIdx.x; i < int64_t(rows) * words; i += blockDim.x) {
    const int r = int(i / words), w = int(i % words);
    const int tok = r / c.num_heads, h = r % c.num_heads;
    const int64_t row_off = (tok * c.stride_tok + h * c.stride_head) * eb;
    const char* s = base + src * c.stride_block * eb + row_off;
    char* d = base + dst * c.stride_block * eb + row_off;
    if (vec)
      reinterpret_cast<uint4*>(d)[w] = reinterpret_cast<const uint4*>(s)[w];
    else
      d[w] = s[w];
  }
}

inline void launch_copy_blocks(const CacheDesc* caches_dev, int num_caches, const int64_t* mapping_dev, int num_pairs,
                               cudaStream_t stream) {
  PAGED_LAUNCH(copy_blocks_kernel, dim3(num_pairs, num_caches), dim3(256), 0, stream, caches_dev, mapping_dev);
  PAGED_CHECK_LAUNCH("copy_blocks_kernel");
}

}  // namespace cache
}  // namespace PAGED_KERNEL_NS

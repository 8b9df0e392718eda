// copy_blocks for the cpu backend: every (src, dst) pair applied to every layer's caches, each
// cache described by its kernels/params.h CacheDesc (the binding's, as for the CUDA kernels).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu/ops.h"

namespace paged::cpu {
namespace {

// One whole-block copy through the cache's strides (permuted HND layouts too): one memcpy per
// (token, head) row, or one for the block when its rows are one dense run.
void copy_block(const CacheDesc& c, int64_t from, int64_t to) {
  char* base = reinterpret_cast<char*>(c.ptr);
  const int64_t esize = c.elem_bytes, row_bytes = int64_t(c.head_size) * esize;
  const char* s = base + from * c.stride_block * esize;
  char* d = base + to * c.stride_block * esize;
  if (c.stride_head == c.head_size && c.stride_token == int64_t(c.num_heads) * c.head_size) {
    std::memcpy(d, s, size_t(c.block_size) * c.num_heads * row_bytes);
    return;
  }
  for (int64_t t = 0; t < c.block_size; ++t)
    for (int64_t h = 0; h < c.num_heads; ++h)
      std::memcpy(d + (t * c.stride_token + h * c.stride_head) * esize, s + (t * c.stride_token + h * c.stride_head) * esize,
                  row_bytes);
}

}  // namespace

void copy_blocks(const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs, Stream) {
  if (num_pairs == 0 || num_caches == 0) return;
  // Destinations are distinct and never sources (validated), so all copies are independent.
  // Chunks of >= 256 KiB: a parallel region for less costs more than it saves.
  const CacheDesc& first = caches[0];
  const int64_t block_bytes = int64_t(first.block_size) * first.num_heads * first.head_size * first.elem_bytes;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, num_pairs * num_caches, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t pair = i / num_caches;
      copy_block(caches[i % num_caches], mapping[2 * pair], mapping[2 * pair + 1]);
    }
  });
}

}  // namespace paged::cpu

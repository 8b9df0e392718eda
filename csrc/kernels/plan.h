// Launch plans of the attention kernels: grid, block, shared memory and the kernel variant for one
// call, computed once by the binding (csrc/binding.h) from the parameters and the launch
// configuration, then passed down to the launcher and the kernels. Plain host code: no torch, no
// CUDA, so the binding, nvcc and the emulator all see the same plan.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "attention_rules.h"  // PAGED_HOST_DEVICE
#include "kernels/paged_kv.h"
#include "kernels/params.h"

namespace paged {

constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1; y and z stop at 65535
constexpr int64_t kMaxGridYZ = 65535;

// ---- decode ------------------------------------------------------------------------------------
// Query heads one lane holds in registers (q and accumulators: kMaxGroupTile x 8 floats each);
// larger groups take the shared-KV kernel.
constexpr int kMaxGroupTile = 8;
constexpr int kDecodeThreads = 128;
constexpr int kDecodePartition = 512;
constexpr int kMaxPartitions = 8192;  // bounds the split-KV workspace (outside the batch-invariant mode)
// Shared-KV staging: KV tokens per step, and the most bytes one step's K + V rows may take
// (two steps are resident: 64 KB, so two 128-thread blocks still fit an SM).
constexpr int kSharedKVChunk = 64;
constexpr int kMaxStageBytes = 32 * 1024;

// decode_kernel's head tile: the group rounded up to 1, 2, 4 or 8.
inline int group_tile(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }
// Lanes that share one token (each owns 8 dims): 8, 16 or 32.
inline int lanes_per_token(int head_size) { return head_size <= 64 ? 8 : head_size <= 128 ? 16 : 32; }

// Shape of a decode_shared_kv_kernel launch (plain data, passed to the kernel by value).
struct SharedKV {
  int tpt;              // lanes per token (8, 16, 32)
  int warps_per_tile;   // warps serving each tile of 8 heads; warp w serves tile w / warps_per_tile
  int heads_per_block;  // multiple of 8, at most 64: the head chunk of one block
  int n_hchunks;        // head chunks per KV head (1 unless group > 64), on grid x
  int chunk;            // KV tokens staged per step
  int pitch;            // bytes of one staged K or V row: head_size * cache bytes, rounded up to 16
  int copy_bytes;       // bytes per copy_async (16 when pointer and strides allow, down to 1)
};

// Floats of the token groups' merge scratch: [ntg][gstride] (max, sum) pairs, then
// [ntg][gstride][D] accumulators.
PAGED_HOST_DEVICE size_t merge_floats(int ntg, int gstride, int D) { return size_t(ntg) * gstride * (D + 2); }

// Staging (2 buffers x K and V rows), or the merge scratch that reuses it afterwards.
PAGED_HOST_DEVICE size_t shared_kv_smem(const SharedKV& sk, int threads, int D) {
  const size_t staging = size_t(2) * 2 * sk.chunk * sk.pitch;
  const size_t merge = merge_floats(threads / 32 * (32 / sk.tpt), kMaxGroupTile, D) * sizeof(float);
  return staging > merge ? staging : merge;
}

struct DecodePlan {
  bool shared_kv;  // group > 8: decode_shared_kv_kernel
  // Split-KV: partial results of partitions of partition_size tokens, merged by the reduce kernel.
  // Always on in the batch-invariant mode (even for one partition), so a row's bits never depend
  // on whether some other row made the batch split.
  bool split;
  int threads, tpt, partition_size, num_partitions;
  int gtile;       // decode_kernel's head tile (template parameter)
  SharedKV sk;     // decode_shared_kv_kernel's shape
  int64_t num_rows;  // query rows: num_seqs (decode), or num_tokens (prefill rows, batch-invariant mode)
  int64_t grid_x;
  int grid_y, grid_z;
  size_t smem;
  size_t workspace_floats;  // split-KV partials: tmp_out then tmp_ml (0 = one pass, no workspace)
  bool k_aligned, v_aligned;
};

// The batch-invariant mode's split size in tokens: a constant, never chosen from the batch, the
// device or a tuned configuration, so a row's partitions (and so its bits) are a function of the
// row alone.
constexpr int kBatchInvariantPartition = 256;

// Partitions one row needs at most: its keys lie in [begin, begin + span) and partitions are
// aligned to multiples of `part` (so the same key range always gets the same partitions), so a
// window whose start is not on a boundary costs one partition more.
inline int64_t partitions_for_span(int64_t span, int64_t part, bool windowed) {
  return (span + part - 1 + (windowed ? part - 1 : 0)) / part;
}

// p.cu_seqlens_q != nullptr: the rows are prefill_attention's query rows (one per token, each with
// its own position; the batch-invariant mode runs prefill through this kernel), else one decode row
// per sequence.
inline DecodePlan plan_decode(const AttentionParams& p, const LaunchConfig& tuned_or_given) {
  // The batch-invariant mode ignores any configuration: a tuned one differs by batch shape.
  const LaunchConfig cfg = p.batch_invariant ? LaunchConfig{} : tuned_or_given;
  DecodePlan pl{};
  const int threads = cfg.threads > 0 ? cfg.threads : kDecodeThreads;
  if (threads % 32 || threads > 256)
    throw std::invalid_argument("paged_cuda: decode threads per block must be 32, 64, ..., 256");
  pl.tpt = lanes_per_token(p.head_size);
  const int group = p.num_heads / p.num_kv_heads;
  pl.shared_kv = group > kMaxGroupTile;
  int hchunks = 1;
  if (!pl.shared_kv) {
    pl.threads = threads;
    pl.gtile = group_tile(group);
    pl.smem = merge_floats(pl.threads / 32 * (32 / pl.tpt), group, p.head_size) * sizeof(float);
  } else {
    // Tiles of 8 heads; at most 8 tiles (256 threads, one warp each at least) per block.
    const int tiles = (group + kMaxGroupTile - 1) / kMaxGroupTile;
    hchunks = (tiles + 7) / 8;
    const int tiles_per_block = (tiles + hchunks - 1) / hchunks;
    SharedKV& sk = pl.sk;
    sk.tpt = pl.tpt;
    sk.warps_per_tile = std::max(1, threads / 32 / tiles_per_block);
    sk.heads_per_block = tiles_per_block * kMaxGroupTile;
    sk.n_hchunks = hchunks;
    const int elem = dtype_bytes(p.cache_dtype);
    sk.pitch = (p.head_size * elem + 15) / 16 * 16;
    sk.copy_bytes = widest_row_copy(p);
    const int chunk = cfg.kv_tile > 0 ? cfg.kv_tile : kSharedKVChunk;
    sk.chunk = std::max(1, std::min(chunk, kMaxStageBytes / (2 * sk.pitch)));
    pl.threads = tiles_per_block * sk.warps_per_tile * 32;
    pl.smem = shared_kv_smem(sk, pl.threads, p.head_size);
  }
  pl.num_rows = p.cu_seqlens_q ? p.num_tokens : p.num_seqs;
  pl.grid_x = pl.num_rows * hchunks;
  pl.grid_y = p.num_kv_heads;
  if (pl.grid_x > kMaxGridX || pl.grid_y > kMaxGridYZ || int64_t(p.num_heads) > kMaxGridYZ)
    throw std::invalid_argument("paged_cuda: decode batch too large for one launch (" + std::to_string(pl.num_rows) +
                                " rows, " + std::to_string(p.num_heads) + " heads)");
  // Upper bound of any context: the block table's width (the real max would need a device sync).
  const int64_t max_ctx = p.max_blocks_per_seq * p.block_size;
  // The most keys one row sees: a row with a window on both sides (window_left, and causal or
  // window_right) sees at most window_left + 1 (+ window_right) keys however long its sequence, so
  // the plan (partitions, workspace) is sized by the window.
  const int64_t right = p.causal ? 0 : p.window_right;  // keys after the row's own: -1 = unbounded
  const bool windowed = p.window_left >= 0 && right >= 0 && p.window_left < max_ctx && right < max_ctx &&
                        p.window_left + right < max_ctx - 1;  // (no int64 wrap)
  const int64_t span = windowed ? p.window_left + right + 1 : max_ctx;
  int64_t part;
  if (p.batch_invariant) {
    part = kBatchInvariantPartition;
    pl.split = true;
  } else {
    part = cfg.partition_size > 0 ? cfg.partition_size : kDecodePartition;
    part = std::max<int64_t>(part, (span + kMaxPartitions - 1) / kMaxPartitions);
    const int64_t blocks = pl.grid_x * pl.grid_y;
    const int64_t sms = std::max(p.num_sms, 1);
    pl.split = cfg.partition_size >= 0 && span > part && (cfg.force_split || blocks < 2 * sms);
    if (pl.split && !cfg.force_split) {
      // Enough partitions to give every SM ~4 blocks, no more: longer contexts get longer partitions
      // instead, which bounds the float32 workspace (rows x heads x partitions x head_size).
      const int64_t max_parts = std::max<int64_t>(2, (4 * sms + blocks - 1) / blocks);
      part = std::max<int64_t>(part, (span + max_parts - 1) / max_parts);
    }
    if (part > (int64_t(1) << 30)) part = int64_t(1) << 30;  // a context this long is one partition of many
  }
  pl.partition_size = int(part);
  const int64_t parts = pl.split ? std::min((max_ctx + part - 1) / part, partitions_for_span(span, part, windowed)) : 1;
  if (parts > kMaxGridYZ)
    throw std::invalid_argument("paged_cuda: decode context too long for one launch (" + std::to_string(parts) +
                                " partitions of " + std::to_string(part) + " tokens)");
  pl.num_partitions = int(std::max<int64_t>(parts, 1));
  pl.grid_z = pl.num_partitions;
  pl.workspace_floats = pl.split ? size_t(pl.num_rows) * p.num_heads * pl.num_partitions * (p.head_size + 2) : 0;
  pl.k_aligned = key_cache_aligned(p);
  pl.v_aligned = value_cache_aligned(p);
  return pl;
}

// ---- prefill -----------------------------------------------------------------------------------
constexpr int kPrefillThreads = 128;
constexpr int kPrefillKvTile = 32;
// Tensor-core kernel: 4 warps x 16 packed rows, KV tiles of 32 tokens.
constexpr int kTcRows = 64, kTcKv = 32, kTcThreads = 128;

struct PrefillPlan {
  bool tensor_cores;  // prefill_tc_kernel (fp16/bf16 queries) or the CUDA-core prefill_kernel
  int threads;
  int rows;           // packed (query, head) rows per tile (BM)
  int kv_tile;        // KV tokens per shared-memory tile (BN)
  int head_tile;      // tensor cores: head_size rounded up to 64, 128 or 256 (template parameter)
  // Row tiles per sequence on the grid. A block walks its sequence's tiles rt, rt + row_tiles, ...
  // so every row is computed however long the sequence is (max_seqlen_q only sizes the grid).
  int64_t row_tiles;
  int64_t grid_x;     // num_seqs * row_tiles
  int grid_y;
  size_t smem;
  bool k_aligned, v_aligned;
};

inline PrefillPlan plan_prefill(const AttentionParams& p, const LaunchConfig& cfg) {
  PrefillPlan pl{};
  const bool sixteen_bit = p.dtype == DType::F16 || p.dtype == DType::BF16;
  pl.tensor_cores = cfg.tensor_cores >= 0 && sixteen_bit;
  const int group = p.num_heads / p.num_kv_heads;
  if (pl.tensor_cores) {
    pl.threads = kTcThreads;
    pl.rows = kTcRows;
    pl.kv_tile = kTcKv;
    pl.head_tile = p.head_size <= 64 ? 64 : p.head_size <= 128 ? 128 : 256;
    const int Dp = (p.head_size + 15) / 16 * 16;
    pl.smem = size_t(kTcRows + 2 * kTcKv) * (Dp + 8) * 2;  // Q, K, V tiles of 16-bit elements
  } else {
    pl.threads = cfg.threads > 0 ? cfg.threads : kPrefillThreads;
    if (pl.threads % 32 || pl.threads < 64 || pl.threads > 256)
      throw std::invalid_argument("paged_cuda: prefill threads must be 64, 96, ..., 256");
    pl.rows = pl.threads / 8;
    pl.kv_tile = cfg.kv_tile > 0 ? cfg.kv_tile : kPrefillKvTile;
    pl.smem = (size_t(pl.rows) * p.head_size + size_t(pl.kv_tile) * (p.head_size + 1) + size_t(pl.rows) * pl.kv_tile +
               3 * pl.rows) *
              sizeof(float);
  }
  // No query is longer than the batch: the hint is clamped, so a wrong one costs idle blocks at
  // worst, never a wrapped grid.
  const int64_t q_max = std::max<int64_t>(1, std::min(p.max_seqlen_q, p.num_tokens));
  const int64_t num_seqs = std::max<int64_t>(p.num_seqs, 1);
  if (num_seqs > kMaxGridX || p.num_kv_heads > kMaxGridYZ)
    throw std::invalid_argument("paged_cuda: prefill batch too large for one launch");
  pl.row_tiles = std::min((q_max * group + pl.rows - 1) / pl.rows, kMaxGridX / num_seqs);
  pl.grid_x = pl.row_tiles * num_seqs;
  pl.grid_y = p.num_kv_heads;
  pl.k_aligned = key_cache_aligned(p);
  pl.v_aligned = value_cache_aligned(p);
  return pl;
}

}  // namespace paged

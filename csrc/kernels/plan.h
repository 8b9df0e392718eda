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
// One kernel for every group size (kernels/decode.cuh): a block stages the K and V rows of a tile
// of tokens in shared memory by cp.async (a ring of kDecodeStages tiles), and its threads split the
// block's query heads: each token group (TPT lanes x 8 dims) serves a head tile of G heads
// (kMaxHeadsPerThread at most, so q and the accumulators stay in <= 128 registers), and the
// block's token groups are divided among its head tiles.
constexpr int kMaxHeadsPerThread = 4;
constexpr int kDecodeThreads = 128;
constexpr int kDecodeStages = 3;        // tiles in the cp.async ring: two in flight while one is read
// Tokens per token group between softmax rescales: 4, or 2 for float32 caches, whose scores and
// 32-byte rows would otherwise push decode_kernel past its 128 registers (8 B of spills).
PAGED_HOST_DEVICE constexpr int decode_rows_per_step(int cache_bytes) { return cache_bytes == 4 ? 2 : 4; }
constexpr int kDecodeStageBytes = 16 * 1024;  // default K + V bytes of one tile (3 x 16 KB + the
                                              // offsets: four 128-thread blocks fit an SM)
constexpr int kMaxDecodeStageBytes = 32 * 1024;  // an explicit kv_tile is capped here
constexpr int kMaxHeadsPerBlock = 64;   // larger groups are cut into head chunks on grid x
constexpr int kDecodeFillBlocksPerSM = 2;  // the split-KV plan's target grid: 2 blocks per SM
constexpr int kMaxClusterBlocks = 16;  // the largest thread-block cluster (sm_90's non-portable size)
constexpr int kMaxPartitions = 8192;    // bounds the split-KV workspace (outside the batch-invariant mode)
// The per-SM resources the fill heuristic assumes (H100 / H200: sm_90; A100 has 164 KB).
constexpr int kSmemPerSM = 228 * 1024, kSmemReservedPerBlock = 1024, kRegistersPerSM = 65536;
constexpr int kMaxRegistersPerThread = 128;  // decode_kernel's __launch_bounds__(256, 2)

// Heads per token group: the group rounded up to 1, 2 or 4 (a template parameter of the kernel).
inline int heads_per_thread(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : kMaxHeadsPerThread; }
// Lanes that share one token (each owns 8 dims per chunk): 8, 16 or 32 (32 for every wide head).
inline int lanes_per_token(int head_size) { return head_size <= 64 ? 8 : head_size <= 128 ? 16 : 32; }

// Wide heads: a key head over kMaxNarrowHeadSize = 8 x 32 lanes (MLA's 576 = 512 latent + 64 RoPE
// columns) takes decode_wide_kernel, whose 32 lanes a token own KC = 3 chunks of q / K and VC = 3 of
// V and the accumulators each (decode.cuh chunk_dim: Dk, Dv <= 768), one head per token group
// (G = 1). One shape, so nvcc compiles 9 more kernels per arch, not the chunk counts' product.
// Two heads per token group (the narrow kernels' way to share a staged row among more heads) do
// not fit: q (48) and the accumulators (32 or 48) of two heads beside the scores and addresses spill
// at the 128-register cap on sm_80 or sm_90 whatever the step length (ptxas -v). A narrower head
// inside the shape leaves the chunks past it idle (zeros, nothing read).
constexpr int kMaxNarrowHeadSize = 256;
struct WideChunks {
  int G, KC, VC;
};
inline WideChunks decode_wide_chunks() { return WideChunks{1, 3, 3}; }
// Token rows per step of decode_wide_kernel (one rescale a step): 4, 2 for float32 caches (112-118
// registers on sm_80 / sm_90, no spills).
PAGED_HOST_DEVICE constexpr int decode_wide_rows_per_step(int cache_bytes) { return cache_bytes == 4 ? 2 : 4; }

// V read from the staged K rows where values_in_key_rows(p) (kernels/params.h): each latent row is
// copied to shared memory once for both products and the block reads it from memory once.

// Shape of a decode_kernel launch (plain data, passed to the kernel by value).
struct DecodeShape {
  int heads_per_block;  // multiple of G: the head chunk of one block (of its KV head's group)
  int n_hchunks;        // head chunks per KV head (on grid x, next to each other)
  int groups_per_tile;  // token groups serving each head tile (block heads [t * G, (t + 1) * G))
  int tile_tokens;      // KV tokens per staged tile (C)
  int pitch;            // bytes of one staged K or V row: head_size (Dk) * cache bytes, rounded up to 16
  int stage_bytes;      // bytes of one ring stage: C K rows, then (v_rows != 0) C V rows
  int v_rows;           // bytes from a stage's K rows to its V rows (C x pitch); 0: V is read from the
                        // K rows (values_in_key_rows) and never copied
  int copy_bytes;       // bytes per copy_async (16 when pointer and strides allow, down to 1)
  FastDivmod by_block;  // token position -> (page, offset) by a multiply and a shift (kernels/paged_kv.h)
  int smem_bytes;       // dynamic shared memory (decode_smem)
  int cluster_blocks;   // > 1: a row's partitions are one thread-block cluster of this many blocks on grid
                        // z, which merges their partials itself (plan_cluster_merge); 0: no cluster
};

// Floats of the token groups' merge scratch: [ntg][gstride] (max, sum) pairs, then
// [ntg][gstride][D] accumulators (D: the value head size).
PAGED_HOST_DEVICE size_t merge_floats(int ntg, int gstride, int D) { return size_t(ntg) * gstride * (D + 2); }

// Shared memory of decode_kernel: per ring stage, the tile's K and V byte offsets (int64, from the
// block table once per token) and its K then V rows; the merge scratch reuses it at the end; in a
// cluster, the block's inbox after them.
PAGED_HOST_DEVICE size_t decode_offsets_bytes(int tile_tokens) {
  return size_t(kDecodeStages) * tile_tokens * 2 * sizeof(int64_t);
}
// A thread-block cluster's merge of a row's partials (decode.cuh push_partial, merge_and_store): block `rank` of
// n merges the (head, column) pairs [rank x share, (rank + 1) x share) of the block's heads x Dv.
PAGED_HOST_DEVICE int cluster_share(int heads, int Dv, int n) { return (heads * Dv + n - 1) / n; }
// Floats of a cluster block's inbox, which the others write from their first cluster barrier on (so
// apart from the ring and the merge scratch): [n][share] normalised outputs, then [n][heads] (max, sum).
PAGED_HOST_DEVICE size_t cluster_inbox_floats(int heads, int Dv, int n) {
  return size_t(n) * (size_t(cluster_share(heads, Dv, n)) + 2 * size_t(heads));
}
// Bytes of decode_kernel's ring, or of the merge scratch that reuses it where that is larger.
PAGED_HOST_DEVICE size_t decode_ring_bytes(const DecodeShape& sh, int threads, int tpt, int G, int Dv) {
  const size_t ring = decode_offsets_bytes(sh.tile_tokens) + size_t(kDecodeStages) * sh.stage_bytes;
  const size_t merge = merge_floats(threads / tpt, G, Dv) * sizeof(float);
  return ring > merge ? ring : merge;
}
// Where a cluster block's inbox starts: after the ring, 16-byte aligned.
PAGED_HOST_DEVICE size_t decode_inbox_offset(const DecodeShape& sh, int threads, int tpt, int G, int Dv) {
  return (decode_ring_bytes(sh, threads, tpt, G, Dv) + 15) / 16 * 16;
}
PAGED_HOST_DEVICE size_t decode_smem(const DecodeShape& sh, int threads, int tpt, int G, int Dv) {
  if (sh.cluster_blocks > 1)
    return decode_inbox_offset(sh, threads, tpt, G, Dv) +
           cluster_inbox_floats(sh.heads_per_block, Dv, sh.cluster_blocks) * sizeof(float);
  return decode_ring_bytes(sh, threads, tpt, G, Dv);
}

struct DecodePlan {
  // Split-KV: partial results of partitions of partition_size tokens, merged by the reduce kernel or,
  // sh.cluster_blocks > 1, by the blocks of a thread-block cluster (plan_cluster_merge).
  // Always on in the batch-invariant mode (even for one partition), so a row's bits never depend
  // on whether some other row made the batch split.
  bool split;
  int threads, tpt, partition_size, num_partitions;
  int heads_per_thread;  // G, the kernel's template parameter
  int k_chunks, v_chunks;  // 1, 1: decode_kernel; else decode_wide_kernel<T, KV, G, k_chunks, v_chunks>
  bool fast_path;          // decode_kernel<T, KV, TPT, G, true, *>: decode_fast_path(p, sh)
  bool score_mods;         // ... with the soft-cap / ALiBi compiled in: decode_kernel<T, KV, TPT, G, true, true>
  DecodeShape sh;
  int64_t num_rows;  // query rows: num_seqs (decode), or num_tokens (prefill rows, batch-invariant mode)
  int64_t grid_x;
  int grid_y, grid_z;
  size_t smem;
  size_t workspace_floats;  // split-KV partials: tmp_out then tmp_ml (0 = one pass, no workspace)
  int blocks_per_sm;        // resident blocks per SM the fill heuristic assumed
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

// decode_kernel's fast path (its template flag kFast): every K / V row copied by 16-byte cp.async, any
// block size (a token's page is found once per tile, by FastDivmod: locate_tile), over any cache; a
// soft-cap or ALiBi takes its kScoreMods instances (the plan's score_mods). Those are what the KV
// loop's instructions depend on; windows, sinks, lse, split-KV and fp8 scales act outside it and take
// either path. Everything the choice
// reads is known to the host, so it is made once per call, and the loop nvcc compiles for the common
// case holds none of the other cases' code (bench/sass.py reads it on its own).
// Keys and values of one head size whose rows are whole 16-byte copies, up to the lanes' 8 x TPT
// elements (decode_fast_rows): the rows are staged at the lanes' width, a constant pitch (plan_decode_shape
// sets it), so a narrower head (80, 96, 112 on 16 lanes; 40 or 48 on 8; 192 on 32) idles its lanes past
// the head and leaves each staged row a tail that decode.cuh zero_row_tails zeroes once. Each thread
// copies at most kFastCopyPasses rows of a tile (the default tiles: 4 at 128 threads), so the copies
// are unrolled.
constexpr int kFastCopyPasses = 4;
inline bool decode_fast_rows(const AttentionParams& p, int copy_bytes, int tpt) {
  return copy_bytes == 16 && p.value_head_size == p.head_size && p.head_size <= 8 * tpt;
}
inline bool decode_fast_path(const AttentionParams& p, const DecodeShape& sh, int threads, int tpt) {
  if (!decode_fast_rows(p, sh.copy_bytes, tpt)) return false;
  const int lane_bytes = 8 * tpt * dtype_bytes(p.cache_dtype);  // the lanes' row: the loop's constant pitch
  if (sh.pitch != lane_bytes) return false;
  const int units = lane_bytes / 16;  // >= 4: lanes of 64+ elements
  if (units > threads) return false;
  const int rows_per_pass = threads / units;
  return (sh.tile_tokens + rows_per_pass - 1) / rows_per_pass <= kFastCopyPasses;
}

// The block's shape for `threads` threads (0: the default, grown up to 256 so a group of up to
// kMaxHeadsPerBlock heads is served by one block).
inline void plan_decode_shape(const AttentionParams& p, const LaunchConfig& cfg, DecodePlan& pl) {
  const int group = p.num_heads / p.num_kv_heads;
  const bool wide = p.head_size > kMaxNarrowHeadSize;
  const WideChunks wc = decode_wide_chunks();
  const int G = wide ? wc.G : heads_per_thread(group);
  pl.tpt = lanes_per_token(p.head_size);
  pl.heads_per_thread = G;
  pl.k_chunks = wide ? wc.KC : 1;
  pl.v_chunks = wide ? wc.VC : 1;
  const int block_tiles = (std::min(group, kMaxHeadsPerBlock) + G - 1) / G;  // head tiles one block would like
  int threads = cfg.threads > 0 ? cfg.threads : std::min(256, std::max(kDecodeThreads, block_tiles * pl.tpt));
  threads = (threads + 31) / 32 * 32;
  if (threads > 256) threads = 256;
  pl.threads = threads;
  const int ntg = threads / pl.tpt;
  DecodeShape& sh = pl.sh;
  // Head chunks: at most kMaxHeadsPerBlock heads, and at most one head tile per token group.
  int chunks = std::max((group + kMaxHeadsPerBlock - 1) / kMaxHeadsPerBlock, ((group + G - 1) / G + ntg - 1) / ntg);
  sh.heads_per_block = ((group + chunks - 1) / chunks + G - 1) / G * G;
  sh.n_hchunks = (group + sh.heads_per_block - 1) / sh.heads_per_block;
  sh.groups_per_tile = ntg / (sh.heads_per_block / G);
  const int elem = dtype_bytes(p.cache_dtype);
  sh.pitch = (p.head_size * elem + 15) / 16 * 16;
  sh.copy_bytes = widest_kv_row_copy(p);
  if (!wide && decode_fast_rows(p, sh.copy_bytes, pl.tpt)) sh.pitch = 8 * pl.tpt * elem;  // the lanes' row
  const bool v_in_k = wide && values_in_key_rows(p);  // decode.cuh: the narrow kernels always copy V
  const int token_bytes = (v_in_k ? 1 : 2) * sh.pitch;  // of one token in a stage
  const int budget = cfg.kv_tile > 0 ? kMaxDecodeStageBytes : kDecodeStageBytes;
  // The default tile: one step of every token group, or for wide heads (whose steps are a couple of
  // rows) the whole stage budget, so the ring still keeps ~2 x 16 KB in flight.
  int tile = cfg.kv_tile > 0 ? cfg.kv_tile
             : wide          ? budget / token_bytes
                             : sh.groups_per_tile * decode_rows_per_step(elem);
  sh.tile_tokens = std::max(1, std::min(tile, budget / token_bytes));
  sh.v_rows = v_in_k ? 0 : sh.tile_tokens * sh.pitch;
  sh.stage_bytes = sh.tile_tokens * token_bytes;
  sh.by_block = FastDivmod(int(p.block_size));
  sh.smem_bytes = int(decode_smem(sh, threads, pl.tpt, G, int(p.value_head_size)));
  pl.smem = size_t(sh.smem_bytes);
  // Resident blocks per SM by shared memory and registers (the kernel's register cap).
  const int by_smem = kSmemPerSM / (sh.smem_bytes + kSmemReservedPerBlock);
  const int by_regs = kRegistersPerSM / (kMaxRegistersPerThread * threads);
  pl.blocks_per_sm = std::max(1, std::min({by_smem, by_regs, 32}));
  pl.fast_path = !wide && decode_fast_path(p, sh, threads, pl.tpt);
  pl.score_mods = pl.fast_path && (p.softcap != 0.f || p.alibi_slopes != nullptr);
}

// The smallest split-KV partition the plans cut: whole pages, two at least (or 32 tokens).
inline int64_t min_partition_tokens(int64_t block_size) {
  const int64_t page = std::max<int64_t>(block_size, 1);
  return std::max<int64_t>(page, (32 + page - 1) / page * page);
}

// A split row's partitions as one thread-block cluster (p.max_cluster_size > 1: sm_90 and later), which
// merges their partials through distributed shared memory (decode.cuh push_partial) instead of
// the reduce kernel's round trip through global memory: the tail of a call is one memory latency
// shorter, what a batch of one lacks (bench/README.md "decode calls"). Taken when the heuristic split
// an under-filled grid and the clustered grid still has a block for every other SM: a power of two
// of partitions (the largest the device allows, no more than the row's keys fill at two pages
// each), blocks of 256 threads (8 warps: the bytes in flight of a block per SM) with tiles of one
// step of every token group. A row with fewer partitions than the cluster leaves blocks empty; they
// still take part in the merge. Not for windowed spans, which may need one partition more than
// their length (partitions_for_span), nor where the bigger block would leave the fast loop.
inline void plan_cluster_merge(const AttentionParams& p, const LaunchConfig& cfg, int64_t span, bool windowed,
                               DecodePlan& pl) {
  if (p.max_cluster_size < 2 || pl.k_chunks != 1 || windowed) return;
  const int64_t page = std::max<int64_t>(p.block_size, 1);
  const int64_t most = span / min_partition_tokens(p.block_size);  // partitions of at least two pages
  int n = 1;
  while (2 * n <= std::min(p.max_cluster_size, kMaxClusterBlocks) && 2 * n <= most) n *= 2;
  if (n < 2) return;
  LaunchConfig c = cfg;
  if (c.threads == 0) c.threads = 256;
  DecodePlan q = pl;
  plan_decode_shape(p, c, q);
  if (c.kv_tile == 0) {  // one step of every token group a tile (the default budget would halve it)
    c.kv_tile = q.sh.groups_per_tile * decode_rows_per_step(dtype_bytes(p.cache_dtype));
    plan_decode_shape(p, c, q);
  }
  if (q.fast_path != pl.fast_path) return;
  const int64_t blocks = q.num_rows * q.sh.n_hchunks * q.grid_y;
  if (2 * blocks * n < std::max(p.num_sms, 1)) return;
  const int64_t part = (span + n - 1) / n;  // span = the table's width: no window here
  q.partition_size = int((part + page - 1) / page * page);
  q.sh.cluster_blocks = n;
  q.sh.smem_bytes = int(decode_smem(q.sh, q.threads, q.tpt, q.heads_per_thread, int(p.value_head_size)));
  q.smem = size_t(q.sh.smem_bytes);
  q.grid_x = q.num_rows * q.sh.n_hchunks;
  q.num_partitions = q.grid_z = n;
  q.workspace_floats = 0;
  pl = q;
}

// p.cu_seqlens_q != nullptr: the rows are prefill_attention's query rows (one per token, each with
// its own position; the batch-invariant mode runs prefill through this kernel), else one decode row
// per sequence.
inline DecodePlan plan_decode(const AttentionParams& p, const LaunchConfig& tuned_or_given) {
  // The batch-invariant mode ignores any configuration: a tuned one differs by batch shape.
  const LaunchConfig cfg = p.batch_invariant ? LaunchConfig{} : tuned_or_given;
  DecodePlan pl{};
  if (cfg.threads > 0 && (cfg.threads % 32 || cfg.threads > 256))
    throw std::invalid_argument("paged_cuda: decode threads per block must be 32, 64, ..., 256");
  plan_decode_shape(p, cfg, pl);
  pl.num_rows = p.cu_seqlens_q ? p.num_tokens : p.num_seqs;
  pl.grid_x = pl.num_rows * pl.sh.n_hchunks;
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
  const int64_t blocks = pl.grid_x * pl.grid_y;
  const int64_t sms = std::max(p.num_sms, 1);
  int64_t part;
  if (p.batch_invariant) {
    part = kBatchInvariantPartition;
    pl.split = true;
  } else if (cfg.partition_size > 0) {
    // A given (tuned or test) size: the floor, grown so the grid stays ~4 blocks per SM.
    part = std::max<int64_t>(cfg.partition_size, (span + kMaxPartitions - 1) / kMaxPartitions);
    pl.split = span > part && (cfg.force_split || blocks < 2 * sms);
    if (pl.split && !cfg.force_split) {
      const int64_t max_parts = std::max<int64_t>(2, (4 * sms + blocks - 1) / blocks);
      part = std::max<int64_t>(part, (span + max_parts - 1) / max_parts);
    }
  } else {
    // Fill the device: kDecodeFillBlocksPerSM resident blocks on every SM (what the bandwidth needs
    // by Little's law: each block keeps kDecodeStages - 1 tiles of 16 KB in flight). A grid short
    // of it cuts each row's keys into as many partitions as make it up, down to two pages (or 32
    // tokens) each, in whole pages (rounded down, so the grid reaches the target).
    const int64_t page = std::max<int64_t>(p.block_size, 1);
    const int64_t min_part = min_partition_tokens(p.block_size);
    const int64_t wave = sms * std::min(kDecodeFillBlocksPerSM, pl.blocks_per_sm);
    const int64_t parts_wanted = (wave + blocks - 1) / blocks;
    part = span / parts_wanted / page * page;
    part = std::max({part, min_part, (span + kMaxPartitions - 1) / kMaxPartitions});
    pl.split = cfg.partition_size == 0 && (cfg.force_split || blocks < wave) && span > part;
  }
  if (cfg.partition_size < 0) pl.split = false;
  if (part > (int64_t(1) << 30)) part = int64_t(1) << 30;  // a context this long is one partition of many
  pl.partition_size = int(part);
  const int64_t parts = pl.split ? std::min((max_ctx + part - 1) / part, partitions_for_span(span, part, windowed)) : 1;
  if (parts > kMaxGridYZ)
    throw std::invalid_argument("paged_cuda: decode context too long for one launch (" + std::to_string(parts) +
                                " partitions of " + std::to_string(part) + " tokens)");
  pl.num_partitions = int(std::max<int64_t>(parts, 1));
  pl.grid_z = pl.num_partitions;
  pl.workspace_floats =
      pl.split ? size_t(pl.num_rows) * p.num_heads * pl.num_partitions * (p.value_head_size + 2) : 0;
  if (pl.split && !p.batch_invariant && cfg.partition_size == 0) plan_cluster_merge(p, cfg, span, windowed, pl);
  return pl;
}

// ---- prefill -----------------------------------------------------------------------------------
constexpr int kPrefillThreads = 128;
constexpr int kPrefillKvTile = 32;
// The CUDA-core kernel's accumulators: 8 threads per row, each owning Dv / 8 of its output columns
// (prefill.cuh prefill_rows' MaxChunks): 32 up to head size 256 (prefill_kernel), 72 up to 576
// (prefill_wide_kernel: MLA's latent), a kernel of its own so the narrow one keeps its registers.
constexpr int kPrefillChunks = 32, kPrefillWideChunks = 72;
// The CUDA-core kernel's shared memory is capped here: 99 KB, the smallest per-block opt-in limit of
// the GPUs built for (sm_86 / sm_89; A100 has 163 KB, H100 227 KB). A kv_tile that would pass it
// (the default at heads above 256: 113 KB at 576; an explicit 256 threads x 64 keys at 256) is
// halved until it fits.
constexpr size_t kPrefillMaxSmem = 99 * 1024;
// Tensor-core kernels: 4 warps x 16 packed rows (kTcRows; the pipelined kernel up to twice that,
// tc_pipelined_rows); KV tiles of 32 tokens (the general kernel, any cache), the pipelined
// kernel's (cp.async tiles of a 16-bit cache) below.
constexpr int kTcRows = 64, kTcKv = 32, kTcThreads = 128;
// The widest key head the tensor-core kernels take. Above it (MLA's 576 / 512) the CUDA-core
// kernel runs: a warp's 16-row tile of a 512-wide output is 256 fp32 accumulators per lane, past
// the 255 registers a thread has, so a tensor-core kernel there would have to split the value
// columns across warps or blocks (P shared through shared memory, or Q K^T recomputed per slice).
constexpr int kTcMaxHeadSize = 256;
// The pipelined kernel's row fragments (16 packed rows each) per warp: two where the lane's
// accumulators (dv / 4 per fragment) leave room beside its scores (dv <= 128: 2 x 64 at dv 128
// beside 2 x 32 scores), one at dv 256; its rows per tile, 4 warps' worth.
constexpr int tc_pipelined_row_frags(int dv) { return dv <= 128 ? 2 : 1; }
constexpr int tc_pipelined_rows(int dv) { return kTcRows * tc_pipelined_row_frags(dv); }
// Its shared memory: Q [rows] and K [bn] rows of dk elements, V [bn] rows of dv, 16-bit (one
// buffer each: V loads during Q K^T, the next K during P V); with an fp8 cache (cache_bytes 1) also
// the fp8 K and V tiles the copies land in ([bn] rows of dk, then of dv bytes) before the block
// widens them into the 16-bit tiles.
constexpr size_t tc_pipelined_smem(int dk, int dv, int bn, int cache_bytes = 2) {
  return (size_t(tc_pipelined_rows(dv) + bn) * dk + size_t(bn) * dv) * 2 +
         (cache_bytes == 1 ? size_t(bn) * (dk + dv) : 0);
}
// Its KV tile for key / value tiles dk, dv: 64 keys where o's accumulators fit beside 64 keys'
// scores (at dv 256, 128 accumulators and 32 scores spill on sm_80) and the tiles fit the smallest
// per-block opt-in shared memory of the GPUs built for (kPrefillMaxSmem: 64 KB at (128, 128), two
// blocks on an A100 SM; 88 KB at DeepSeek's (192, 128)); else 32: (256, 256), and DeepSeek's
// (192, 128) over an fp8 cache (108 KB at 64 keys).
constexpr int tc_pipelined_kv_tile(int dk, int dv, int cache_bytes = 2) {
  return dv <= 128 && tc_pipelined_smem(dk, dv, 64, cache_bytes) <= kPrefillMaxSmem ? 64 : 32;
}

// The largest soft-cap the pipelined kernel takes: its cap (common.cuh SoftCapByExp) errs by up to
// softcap 2^-20.7 of a probability, under a tenth of fp16's unit roundoff (2^-11) up to 64, a cap past
// every model's (Gemma 2's 50, Grok's 30); a larger one takes the general tensor-core kernel (tanhf).
constexpr float kMaxSoftcapByExp = 64.f;

struct PrefillPlan {
  bool tensor_cores;  // prefill_tc_kernel (fp16/bf16 queries) or the CUDA-core prefill_kernel
  // Tensor cores on a cache of the query's dtype, or an fp8 one whose heads are multiples of 16,
  // whose rows all start 16-byte aligned, with query rows 16-byte aligned and out rows of aligned
  // element pairs, and a soft-cap up to kMaxSoftcapByExp: prefill_tc_pipelined_kernel (Q, K, V by
  // 16-byte cp.async; fp8 tiles widened to 16 bits in shared memory); other views, fp8 heads and caps
  // take prefill_tc_kernel.
  bool pipelined;
  // The soft-cap or ALiBi is on: the pipelined kernel's kScoreMods instance (without them its
  // scores take one multiply).
  bool score_mods;
  int threads;
  int rows;           // packed (query, head) rows per tile (BM)
  int kv_tile;        // KV tokens per shared-memory tile (BN)
  // Tensor cores: the key head size (Dk) rounded up to 64, 128 or 256 (template parameter; also
  // the value side's, except the pipelined kernel's (192, 128) instance for 128 < Dk <= 192 with
  // Dv <= 128: DeepSeek's non-absorbed prefill).
  int head_tile;
  int value_tile;     // the pipelined kernel's value tile (its DV): head_tile, or 128 at 192
  int max_chunks;     // CUDA cores: kPrefillChunks (prefill_kernel), kPrefillWideChunks (prefill_wide_kernel)
  // Row tiles per sequence on the grid. A block walks its sequence's tiles rt, rt + row_tiles, ...
  // so every row is computed however long the sequence is (max_seqlen_q only sizes the grid).
  int64_t row_tiles;
  int64_t grid_x;     // num_seqs * row_tiles
  int grid_y;
  size_t smem;
  bool k_aligned, v_aligned;
};

// The CUDA-core kernel's shared memory: Q [rows][Dk], one K-or-V tile [kv_tile][Dk + 1] (V rows use
// its first Dv columns), scores [rows][kv_tile], and three floats per row.
inline size_t prefill_cuda_core_smem(int rows, int kv_tile, int64_t dk) {
  return (size_t(rows) * dk + size_t(kv_tile) * (dk + 1) + size_t(rows) * kv_tile + 3 * size_t(rows)) * sizeof(float);
}

// Keys and values may differ in head size (MLA: Dk = p.head_size >= Dv = p.value_head_size): every
// size here that holds Q or K rows is Dk's, the value tiles Dv's (or Dk's, where a tile serves both).
inline PrefillPlan plan_prefill(const AttentionParams& p, const LaunchConfig& cfg) {
  PrefillPlan pl{};
  const bool sixteen_bit = p.dtype == DType::F16 || p.dtype == DType::BF16;
  const int64_t dk = p.head_size, dv = p.value_head_size;
  pl.tensor_cores = cfg.tensor_cores >= 0 && sixteen_bit && dk <= kTcMaxHeadSize;
  const int group = p.num_heads / p.num_kv_heads;
  if (pl.tensor_cores) {
    pl.threads = kTcThreads;
    pl.rows = kTcRows;
    pl.kv_tile = kTcKv;
    pl.head_tile = dk <= 64 ? 64 : dk <= 128 ? 128 : 256;
    pl.value_tile = pl.head_tile;
    // The pipelined kernel takes aligned views only: Q rows by 16-byte copies, out by element pairs.
    // An fp8 row is copied in 16-byte chunks of 16 elements: heads of whole chunks, 16-byte aligned rows.
    const bool fp8_cache = p.cache_dtype == DType::E4M3 || p.cache_dtype == DType::E5M2;
    const bool cache_fits =
        p.cache_dtype == p.dtype ? key_cache_aligned(p) && value_cache_aligned(p)
        : fp8_cache && dk % 16 == 0 && dv % 16 == 0 &&
              aligned_to(p.key_cache, 1, {p.k_stride_block, p.k_stride_token, p.k_stride_head}, 16) &&
              aligned_to(p.value_cache, 1, {p.v_stride_block, p.v_stride_token, p.v_stride_head}, 16);
    pl.pipelined = cache_fits && chunk_aligned(p.query, p.dtype, {p.q_stride_token, p.q_stride_head}) &&
                   aligned_to(p.out, 2, {p.o_stride_token, p.o_stride_head}, 4) && p.softcap <= kMaxSoftcapByExp;
    if (pl.pipelined) {
      if (dk > 128 && dk <= 192 && dv <= 128) pl.head_tile = 192, pl.value_tile = 128;
      pl.rows = tc_pipelined_rows(pl.value_tile);
      pl.score_mods = p.softcap > 0.f || p.alibi_slopes != nullptr;
      const int cache_bytes = dtype_bytes(p.cache_dtype);
      pl.kv_tile = tc_pipelined_kv_tile(pl.head_tile, pl.value_tile, cache_bytes);
      pl.smem = tc_pipelined_smem(pl.head_tile, pl.value_tile, pl.kv_tile, cache_bytes);
    } else {
      const int64_t Dp = (dk + 15) / 16 * 16;
      pl.smem = size_t(kTcRows + 2 * kTcKv) * (Dp + 8) * 2;  // Q, K, V tiles of 16-bit elements, rows of Dk
    }
  } else {
    pl.threads = cfg.threads > 0 ? cfg.threads : kPrefillThreads;
    if (pl.threads % 32 || pl.threads < 64 || pl.threads > 256)
      throw std::invalid_argument("paged_cuda: prefill threads must be 64, 96, ..., 256");
    pl.rows = pl.threads / 8;
    pl.max_chunks = dk <= 8 * kPrefillChunks ? kPrefillChunks : kPrefillWideChunks;
    pl.kv_tile = cfg.kv_tile > 0 ? cfg.kv_tile : kPrefillKvTile;
    while (pl.kv_tile > 1 && prefill_cuda_core_smem(pl.rows, pl.kv_tile, dk) > kPrefillMaxSmem) pl.kv_tile /= 2;
    pl.smem = prefill_cuda_core_smem(pl.rows, pl.kv_tile, dk);
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

// The launch configurations the tuner (paged_ops/tuning.py) times for one shape, next to the
// kernels they configure: a new kernel parameter, or a limit of kernels/plan.h, is changed here
// and in plan.h together. The tuner reads them through paged_cuda::tuning_candidates
// (csrc/cuda/tuning.h); every one must pass tuning::config_problem.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/params.h"

namespace paged_cuda {
namespace tuning {

inline paged::LaunchConfig launch_config(int threads, int partition_size, int kv_tile, int tensor_cores) {
  paged::LaunchConfig c;
  c.threads = threads;
  c.partition_size = partition_size;
  c.kv_tile = kv_tile;
  c.tensor_cores = tensor_cores;
  return c;
}

// Decode: threads per block x split-KV partition size in tokens (-1: the one-pass kernel only).
// The staging tile (kv_tile: KV tokens per cp.async ring stage, kernels/decode.cuh) trades shared
// memory, hence blocks per SM, against barriers per token; it is swept for query groups over 8
// heads (several head tiles read each staged token), the plan's default tile serves the others.
inline std::vector<paged::LaunchConfig> decode_candidates(int64_t group) {
  std::vector<int> tiles{0};
  if (group > 8) tiles = {32, 64};
  std::vector<paged::LaunchConfig> out;
  for (int threads : {64, 128, 256})
    for (int partition_size : {256, 512, 1024, -1})
      for (int kv_tile : tiles) out.push_back(launch_config(threads, partition_size, kv_tile, 0));
  return out;
}

// Prefill: the tensor-core kernel (its own fixed block; fp16/bf16 only, fp32 falls back to CUDA
// cores), then the CUDA-core kernel's threads per block x KV tokens per shared-memory tile.
inline std::vector<paged::LaunchConfig> prefill_candidates() {
  std::vector<paged::LaunchConfig> out{launch_config(0, 0, 0, 1)};
  for (int threads : {64, 128, 256})
    for (int kv_tile : {16, 32, 64}) out.push_back(launch_config(threads, 0, kv_tile, -1));
  return out;
}

}  // namespace tuning
}  // namespace paged_cuda

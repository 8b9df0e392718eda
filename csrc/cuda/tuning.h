// Launch tuning registry of the GPU backend. A shape key (op, dtypes, head size, group, block size,
// power-of-two buckets of batch and context) maps to the LaunchConfig the tuner measured fastest.
// The tuner itself is Python (paged_ops/tuning.py): it times candidates through the test
// namespace's explicit-config ops (paged_cuda_test::decode_attention_config /
// prefill_attention_config), records the winner here with paged_cuda::set_tuned_config and persists it in
// $PAGED_OPS_CACHE_DIR (default ~/.cache/paged_ops): tuning.json for people and cuda_tuning.tsv for
// this loader (one "key threads partition kv_tile tc" line per shape). The registry reads the .tsv
// on its first lookup, so a new process uses earlier tuning without importing the tuner.
// An unknown key resolves to the kernels' defaults (LaunchConfig{} = all zeros).
#pragma once
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/binding.h"
#include "kernels/params.h"

namespace paged_cuda {
namespace tuning {

inline int64_t pow2_bucket(int64_t n) {
  int64_t b = 1;
  while (b < n) b <<= 1;
  return b;
}

inline std::string shape_key(int dtype, int cache_dtype, int head_size, int group, int num_kv_heads, int block_size,
                             int64_t num_seqs, int64_t len, bool decode, int num_sms) {
  // len: decode = the block table's capacity in tokens, prefill = max_seqlen_q. num_sms: a choice
  // made on one GPU model is not reused on another.
  return std::string(decode ? "decode" : "prefill") + "|sm" + std::to_string(num_sms) + "|dt" + std::to_string(dtype) + "|kv" +
         std::to_string(cache_dtype) + "|d" + std::to_string(head_size) + "|g" + std::to_string(group) + "|h" +
         std::to_string(num_kv_heads) + "|bs" + std::to_string(block_size) + "|n" +
         std::to_string(pow2_bucket(num_seqs)) + "|l" + std::to_string(pow2_bucket(len));
}

inline std::string shape_key(const paged::AttentionParams& p, bool decode) {
  const int64_t len = decode ? p.max_blocks_per_seq * p.block_size : p.max_seqlen_q;
  return shape_key(int(p.dtype), int(p.cache_dtype), p.head_size, p.num_heads / p.num_kv_heads, p.num_kv_heads,
                   p.block_size, p.num_seqs, len, decode, p.num_sms);
}

struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, paged::LaunchConfig> configs;
};

inline std::string cache_file() {
  if (const char* d = std::getenv("PAGED_OPS_CACHE_DIR")) return std::string(d) + "/cuda_tuning.tsv";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/paged_ops/cuda_tuning.tsv";
}

inline Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: lookups may run during interpreter shutdown
    std::ifstream in(cache_file());
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string key;
      paged::LaunchConfig c;
      if (ls >> key >> c.threads >> c.partition_size >> c.kv_tile >> c.tensor_cores) reg->configs[key] = c;
    }
    return reg;
  }();
  return *r;
}

inline paged::LaunchConfig lookup(const std::string& key) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.configs.find(key);
  return it == r.configs.end() ? paged::LaunchConfig{} : it->second;
}

inline void set_config(const std::string& key, int64_t threads, int64_t partition_size, int64_t kv_tile,
                       int64_t tensor_cores) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  paged::LaunchConfig c;
  c.threads = int(threads);
  c.partition_size = int(partition_size);
  c.kv_tile = int(kv_tile);
  c.tensor_cores = int(tensor_cores);
  r.configs[key] = c;
}

// [threads, partition_size, kv_tile, tensor_cores, tuned (1) or default (0)]
inline std::vector<int64_t> get_config(const std::string& key) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.configs.find(key);
  if (it == r.configs.end()) return {0, 0, 0, 0, 0};
  const paged::LaunchConfig& c = it->second;
  return {c.threads, c.partition_size, c.kv_tile, c.tensor_cores, 1};
}


inline std::string key_for_tensors(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables,
                                   int64_t num_seqs_or_max_q, bool decode) {
  const auto code = [](at::ScalarType t) { return int(paged::binding::dtype_code(t)); };  // the kernels' codes
  const int group = int(query.size(1) / key_cache.size(2));
  const int64_t num_seqs = block_tables.size(0);
  const int64_t len = decode ? block_tables.size(1) * key_cache.size(1) : num_seqs_or_max_q;
  int sms = 0;
  if (query.is_cuda() && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, query.get_device()) != cudaSuccess)
    sms = 0;
  return shape_key(code(query.scalar_type()), code(key_cache.scalar_type()), int(query.size(2)), group,
                   int(key_cache.size(2)), int(key_cache.size(1)), num_seqs, len, decode, sms);
}

}  // namespace tuning
}  // namespace paged_cuda

// Launch tuning registry of the GPU backend. A shape key (op, dtypes, head size, group, block size,
// power-of-two buckets of batch and context) maps to the LaunchConfig the tuner measured fastest.
// The tuner itself is Python (paged_ops/tuning.py): it times candidates through the test
// namespace's explicit-config ops (paged_cuda_test::decode_attention_config /
// prefill_attention_config), records the winner here with paged_cuda::set_tuned_config and persists it in
// $PAGED_OPS_CACHE_DIR (default ~/.cache/paged_ops): tuning.json for people and cuda_tuning.tsv for
// this loader (one "key threads partition kv_tile tc" line per shape). The registry reads the .tsv
// on its first lookup, so a new process uses earlier tuning without importing the tuner.
// An unknown key resolves to the kernels' defaults (LaunchConfig{} = all zeros).
//
// The .tsv is input from disk and never trusted, like tuning.json on the Python side: only a
// regular file (a FIFO in its place must not block the first call) of sane size is read, and a
// line is used only when it is exactly one printable key and four integers that are a valid
// config (paged_ops/tuning.py _CUDA_SCHEMA); any other line is skipped, and that shape runs on
// the defaults until it is tuned again.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
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

// Whether the four numbers are a config the kernels accept (0 = the kernels' default for a field).
// Mirrors paged_ops/tuning.py _CUDA_SCHEMA.
inline const char* config_problem(int64_t threads, int64_t partition_size, int64_t kv_tile, int64_t tensor_cores) {
  if (!(threads == 0 || (threads >= 32 && threads <= 1024 && threads % 32 == 0)))
    return "threads must be 0 or a multiple of 32 in [32, 1024]";
  if (!(partition_size == 0 || partition_size == -1 ||
        (partition_size >= 16 && partition_size <= (int64_t(1) << 20) && partition_size % 16 == 0)))
    return "partition_size must be -1, 0 or a multiple of 16 in [16, 2^20]";
  if (!(kv_tile == 0 || (kv_tile >= 8 && kv_tile <= 256 && (kv_tile & (kv_tile - 1)) == 0)))
    return "kv_tile must be 0 or a power of two in [8, 256]";
  if (tensor_cores < -1 || tensor_cores > 1) return "tensor_cores must be -1, 0 or 1";
  return nullptr;
}

constexpr size_t kMaxKeyChars = 512;
constexpr off_t kMaxFileBytes = off_t(16) << 20;  // a few hundred bytes a shape; more is not ours

inline bool is_key(const std::string& key) {
  if (key.empty() || key.size() > kMaxKeyChars) return false;
  for (char ch : key)
    if (ch < '!' || ch > '~') return false;  // printable ASCII, no spaces
  return true;
}

inline bool parse_int(const std::string& token, int64_t& value) {
  if (token.empty() || token.size() > 12) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(token.c_str(), &end, 10);
  if (errno != 0 || end != token.c_str() + token.size()) return false;
  value = v;
  return true;
}

// One "key threads partition kv_tile tc" line; false (and `key`/`c` untouched) for anything else.
inline bool parse_line(const std::string& line, std::string& key, paged::LaunchConfig& c) {
  std::istringstream ls(line);
  std::string tokens[6];
  int n = 0;
  while (n < 6 && ls >> tokens[n]) ++n;
  if (n != 5 || !is_key(tokens[0])) return false;
  int64_t v[4];
  for (int i = 0; i < 4; ++i)
    if (!parse_int(tokens[i + 1], v[i])) return false;
  if (config_problem(v[0], v[1], v[2], v[3]) != nullptr) return false;
  key = tokens[0];
  c = paged::LaunchConfig{};
  c.threads = int(v[0]);
  c.partition_size = int(v[1]);
  c.kv_tile = int(v[2]);
  c.tensor_cores = int(v[3]);
  return true;
}

// The file's bytes, or "" when it is missing, not a regular file, too large or unreadable.
inline std::string read_cache_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO: opens, not read
  if (fd < 0) return {};
  std::string data;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= kMaxFileBytes) {
    char buf[1 << 16];
    for (;;) {
      const ssize_t got = ::read(fd, buf, sizeof buf);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      data.append(buf, size_t(got));
      if (data.size() > size_t(kMaxFileBytes)) {  // grew while read
        data.clear();
        break;
      }
    }
  }
  ::close(fd);
  return data;
}

inline Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: lookups may run during interpreter shutdown
    std::istringstream in(read_cache_file(cache_file()));
    std::string line, key;
    paged::LaunchConfig c;
    while (std::getline(in, line))
      if (parse_line(line, key, c)) reg->configs[key] = c;
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
  TORCH_CHECK_VALUE(is_key(key), "set_tuned_config: key must be one token of printable ASCII (no spaces), at most ",
                    kMaxKeyChars, " characters");
  const char* problem = config_problem(threads, partition_size, kv_tile, tensor_cores);
  TORCH_CHECK_VALUE(problem == nullptr, "set_tuned_config: ", problem ? problem : "", " (got threads=", threads,
                    ", partition_size=", partition_size, ", kv_tile=", kv_tile, ", tensor_cores=", tensor_cores, ")");
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

// The launch configuration of a call that names none (binding Target::tuned_config).
inline paged::LaunchConfig tuned_config(const paged::AttentionParams& p, bool decode) {
  return lookup(shape_key(p, decode));
}

// The ops paged_ops/tuning.py uses, in the paged_cuda namespace: the key a call of this shape looks
// up, recording a tuned config for a key, and reading back what a key resolves to.
inline void define_ops(torch::Library& m) {
  m.def("tuning_key(Tensor query, Tensor key_cache, Tensor block_tables, int max_seqlen_q, bool decode) -> str",
        &key_for_tensors);
  m.def("set_tuned_config(str key, int threads, int partition_size, int kv_tile, int tensor_cores=0) -> ()",
        &set_config);
  m.def("tuned_config(str key) -> int[]", &get_config);
}

}  // namespace tuning
}  // namespace paged_cuda

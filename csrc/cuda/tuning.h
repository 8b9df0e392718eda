// Tuned launch configurations of the GPU backend: the extension's half of the one tuning store.
//
// paged_ops/tuning.py owns the store: it times the candidates (tuning_candidates.h) through the
// test namespace's explicit-config ops, persists the fastest in $PAGED_OPS_CACHE_DIR/tuning.json
// and pushes the stored entries of this build into the table below (set_tuned_configs), once per
// process. This file reads no file: everything in the table came through those ops, validated.
//
// The key is the Key array below, the same for both halves: Python gets it from the tuning_key op,
// the kernels' call path builds it from AttentionParams, both through make_key. The table is an
// immutable open-addressing hash table behind an atomic pointer: a call loads the pointer and
// probes, with no string, no lock and no allocation; an install copies the table, adds to the copy
// and publishes it (copy-on-write). Installs are rare (once per tuned shape) and published tables
// are never freed, since a call on another thread may still be reading the one it loaded.
//
// An unknown key resolves to the kernels' defaults (LaunchConfig{} = all zeros).
//
// The same key buckets the tuned default backend of CUDA attention calls (cuda or triton,
// paged_ops.tuning.tune_backend): public/select.cpp keeps that table (a KeyTable of backend
// indices) and computes a call's key with call_key, the function the tuning_key op uses.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "binding.h"
#include "cuda/tuning_candidates.h"
#include "kernels/params.h"

namespace paged_cuda {
namespace tuning {

// ---- the key ----------------------------------------------------------------------------------

// The fields of a key, in their order. Lengths are bucketed (ceil log2): a choice made for one
// length serves the lengths near it. num_sms: a choice made on one GPU model is not reused on one
// with another SM count.
enum KeyField : int {
  kOp,          // 0 decode_attention, 1 prefill_attention (kOpNames)
  kNumSms,      // of the device (0 for CPU tensors: the emulator, tests)
  kDType,       // paged::DType of the query
  kCacheDType,  // ... and of the caches
  kHeadSize,
  kGroup,       // query heads per KV head
  kNumKvHeads,
  kBlockSize,
  kLayout,      // 0 NHD (token-major cache), 1 HND (head-major)
  kSeqsLog2,    // ceil(log2(num_seqs))
  kLenLog2,     // ceil(log2(len)); decode: the block table's capacity in tokens, prefill: max_seqlen_q
  kKeyFields
};
using Key = std::array<int32_t, kKeyFields>;
constexpr const char* kOpNames[] = {"decode_attention", "prefill_attention"};

inline int32_t ceil_log2(int64_t n) { return n <= 1 ? 0 : 64 - __builtin_clzll(uint64_t(n - 1)); }

// A block table's capacity in tokens, saturated: a product past int64 is the last bucket.
inline int64_t capacity_tokens(int64_t blocks, int64_t block_size) {
  int64_t tokens;
  return __builtin_mul_overflow(blocks, block_size, &tokens) ? INT64_MAX : tokens;
}

// Sizes as the CUDA binding checked them (each fits an int, num_kv_heads >= 1).
inline Key make_key(bool decode, int num_sms, paged::DType dtype, paged::DType cache_dtype, int64_t head_size,
                    int64_t num_heads, int64_t num_kv_heads, int64_t block_size, bool head_major, int64_t num_seqs,
                    int64_t len) {
  return Key{decode ? 0 : 1,
             num_sms,
             int32_t(dtype),
             int32_t(cache_dtype),
             int32_t(head_size),
             int32_t(num_heads / num_kv_heads),
             int32_t(num_kv_heads),
             int32_t(block_size),
             head_major ? 1 : 0,
             ceil_log2(num_seqs),
             ceil_log2(len)};
}

// What the kernels' call path looks up.
inline Key key_of(const paged::AttentionParams& p, bool decode) {
  return make_key(decode, p.num_sms, p.dtype, p.cache_dtype, p.head_size, p.num_heads, p.num_kv_heads, p.block_size,
                  p.k_stride_head > p.k_stride_token, p.num_seqs,
                  decode ? capacity_tokens(p.max_blocks_per_seq, p.block_size) : p.max_seqlen_q);
}

// The key of an attention call from its tensors' sizes, strides and dtypes (host-known, never their
// contents), with the device's SM count: false where the call has none (a size outside [1, 2^31) or
// a dtype without a code), which then runs on the defaults. The one definition for the tuning_key op
// (the tuner's key) and public/select.cpp (the key a call's tuned backend is looked up by), equal to
// key_of of the params the binding makes of the same call.
// query: [num_tokens, num_heads, head_size], key_cache: [num_blocks, block_size, num_kv_heads,
// head_size], block_tables: [num_seqs, max_blocks_per_seq]; max_seqlen_q: prefill only.
inline bool call_key(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& block_tables,
                     int64_t max_seqlen_q, bool decode, int num_sms, Key& key) {
  if (query.dim() != 3 || key_cache.dim() != 4 || block_tables.dim() != 2) return false;
  const int64_t head_size = query.size(2), num_heads = query.size(1), num_kv_heads = key_cache.size(2),
                block_size = key_cache.size(1);
  for (int64_t v : {head_size, num_heads, num_kv_heads, block_size})
    if (v < 1 || v > INT32_MAX) return false;
  const auto code = [](at::ScalarType t) -> int {
    switch (t) {  // binding.h dtype_code, without its error: a call with no code has no key
      case at::kFloat: case at::kHalf: case at::kBFloat16: case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
        return int(paged::binding::dtype_code(t));
      default: return -1;
    }
  };
  const int dtype = code(query.scalar_type()), cache_dtype = code(key_cache.scalar_type());
  if (dtype < 0 || cache_dtype < 0) return false;
  key = make_key(decode, num_sms, paged::DType(dtype), paged::DType(cache_dtype), head_size, num_heads, num_kv_heads,
                 block_size, key_cache.stride(2) > key_cache.stride(1), block_tables.size(0),
                 decode ? capacity_tokens(block_tables.size(1), block_size) : max_seqlen_q);
  return true;
}

inline uint64_t hash_key(const Key& k) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (int32_t v : k) {
    h = (h ^ uint32_t(v)) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 29;
  }
  return h;
}

// ---- what a valid key and config are -----------------------------------------------------------

// Why `key` (from Python) is not a key of op `op` (nullptr: either op), or nullptr if it is one.
inline const char* key_problem(at::IntArrayRef key, const char* op) {
  if (key.size() != size_t(kKeyFields)) return "a key has 11 fields (csrc/cuda/tuning.h KeyField)";
  for (int64_t v : key)
    if (v < 0 || v > INT32_MAX) return "a key's fields are in [0, 2^31)";
  if (key[kOp] > 1) return "op must be 0 (decode_attention) or 1 (prefill_attention)";
  if (op != nullptr && std::string(op) != kOpNames[key[kOp]]) return "the key is another op's";
  if (key[kDType] > 4 || key[kCacheDType] > 4) return "dtype codes are 0..4 (kernels/params.h DType)";
  if (key[kHeadSize] < 1 || key[kGroup] < 1 || key[kNumKvHeads] < 1 || key[kBlockSize] < 1)
    return "head_size, group, num_kv_heads and block_size are at least 1";
  if (key[kLayout] > 1) return "layout must be 0 (NHD) or 1 (HND)";
  if (key[kSeqsLog2] > 63 || key[kLenLog2] > 63) return "the length buckets are log2s in [0, 63]";
  return nullptr;
}

inline Key key_from_list(at::IntArrayRef key, const char* what) {
  const char* problem = key_problem(key, nullptr);
  TORCH_CHECK_VALUE(problem == nullptr, what, ": ", problem ? problem : "", " (got ", key, ")");
  Key k;
  for (int i = 0; i < kKeyFields; ++i) k[i] = int32_t(key[i]);
  return k;
}

// The fields of paged::LaunchConfig, in its order: the tuner's config dicts use these names and
// every list of a config (the test namespace's *_config ops, binding.h config_from_list) this order.
constexpr const char* kConfigFields[] = {"threads", "partition_size", "kv_tile", "force_split", "tensor_cores"};
constexpr int kConfigSize = 5;

inline std::vector<int64_t> config_list(const paged::LaunchConfig& c) {
  return {c.threads, c.partition_size, c.kv_tile, c.force_split, c.tensor_cores};
}

// Whether a config is one the kernels accept (0 = the kernels' default for a field). The one check:
// paged_ops/tuning.py asks it through launch_config_problem.
inline const char* config_problem(at::IntArrayRef c) {
  if (c.size() != size_t(kConfigSize))
    return "a config has 5 fields [threads, partition_size, kv_tile, force_split, tensor_cores]";
  const int64_t threads = c[0], partition_size = c[1], kv_tile = c[2], force_split = c[3], tensor_cores = c[4];
  if (!(threads == 0 || (threads >= 32 && threads <= 1024 && threads % 32 == 0)))
    return "threads must be 0 or a multiple of 32 in [32, 1024]";
  if (!(partition_size == 0 || partition_size == -1 ||
        (partition_size >= 16 && partition_size <= (int64_t(1) << 20) && partition_size % 16 == 0)))
    return "partition_size must be -1, 0 or a multiple of 16 in [16, 2^20]";
  if (!(kv_tile == 0 || (kv_tile >= 8 && kv_tile <= 256 && (kv_tile & (kv_tile - 1)) == 0)))
    return "kv_tile must be 0 or a power of two in [8, 256]";
  if (force_split != 0 && force_split != 1) return "force_split must be 0 or 1";
  if (tensor_cores < -1 || tensor_cores > 1) return "tensor_cores must be -1, 0 or 1";
  return nullptr;
}

// ---- the tables ---------------------------------------------------------------------------------

// An immutable open-addressing hash table of Key -> Value. Two are kept: the launch configs below
// (Value LaunchConfig), and the tuned backend choice of public/select.cpp (Value: a backend index).
template <class Value>
class KeyTable {
 public:
  struct Entry {
    Key key;
    Value value;
  };

  explicit KeyTable(std::vector<Entry> entries) : entries_(std::move(entries)) {
    size_t capacity = 2;
    while (capacity < 2 * entries_.size()) capacity <<= 1;  // at most half full: short probes
    mask_ = capacity - 1;
    slots_.assign(capacity, -1);
    for (size_t i = 0; i < entries_.size(); ++i) {
      size_t s = hash_key(entries_[i].key) & mask_;
      while (slots_[s] >= 0) s = (s + 1) & mask_;
      slots_[s] = int32_t(i);
    }
  }

  const Value* find(const Key& key) const {
    for (size_t s = hash_key(key) & mask_;; s = (s + 1) & mask_) {
      const int32_t i = slots_[s];
      if (i < 0) return nullptr;
      if (entries_[i].key == key) return &entries_[i].value;
    }
  }

  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;  // one per key
  std::vector<int32_t> slots_;  // index into entries_, -1 empty
  size_t mask_;
};

// Adds (replace: only) these entries to the table `published` points to, copy-on-write under `mu`
// (installs only; lookups never take it); a later entry of the same key wins. The old table is
// never freed: a call on another thread may still be reading it.
template <class Value>
void install_into(std::atomic<const KeyTable<Value>*>& published, std::mutex& mu,
                  const std::vector<typename KeyTable<Value>::Entry>& added, bool replace) {
  std::lock_guard<std::mutex> lock(mu);
  const KeyTable<Value>* old = published.load(std::memory_order_acquire);
  std::vector<typename KeyTable<Value>::Entry> entries;
  if (old && !replace) entries = old->entries();
  for (const auto& e : added) {
    bool found = false;
    for (auto& have : entries)
      if (have.key == e.key) {
        have.value = e.value;
        found = true;
        break;
      }
    if (!found) entries.push_back(e);
  }
  published.store(entries.empty() ? nullptr : new KeyTable<Value>(std::move(entries)), std::memory_order_release);
}

using Table = KeyTable<paged::LaunchConfig>;
using Entry = Table::Entry;

// nullptr: nothing installed. Constant-initialized, so reading it needs no static guard.
inline std::atomic<const Table*> published{nullptr};

inline std::mutex& install_mutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

inline void install(const std::vector<Entry>& added, bool replace) {
  install_into(published, install_mutex(), added, replace);
}

// The launch configuration of a call that names none (binding Target::tuned_config): one atomic
// load, the key's eleven integers, a hash and a probe or two.
inline paged::LaunchConfig tuned_config(const paged::AttentionParams& p, bool decode) {
  const Table* table = published.load(std::memory_order_acquire);
  if (table == nullptr) return paged::LaunchConfig{};
  const paged::LaunchConfig* found = table->find(key_of(p, decode));
  return found ? *found : paged::LaunchConfig{};
}

// ---- the ops paged_ops/tuning.py uses ---------------------------------------------------------

// The key of a call with these tensors (its other arguments do not change the key).
inline std::vector<int64_t> tuning_key(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& block_tables, int64_t max_seqlen_q, bool decode) {
  TORCH_CHECK_VALUE(query.dim() == 3 && key_cache.dim() == 4 && block_tables.dim() == 2,
                    "tuning_key: query [num_tokens, num_heads, head_size], key_cache [num_blocks, block_size, "
                    "num_kv_heads, head_size], block_tables [num_seqs, max_blocks_per_seq]");
  for (int64_t v : {query.size(2), query.size(1), key_cache.size(2), key_cache.size(1)})
    TORCH_CHECK_VALUE(v >= 1 && v <= INT32_MAX, "tuning_key: sizes must be in [1, 2^31), got ", v);
  paged::binding::dtype_code(query.scalar_type());  // an unsupported dtype: its error
  paged::binding::dtype_code(key_cache.scalar_type());
  int sms = 0;
  if (query.is_cuda() && cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, query.get_device()) != cudaSuccess)
    sms = 0;
  Key k;
  call_key(query, key_cache, block_tables, max_seqlen_q, decode, sms, k);
  return std::vector<int64_t>(k.begin(), k.end());
}

inline std::string tuning_key_problem(at::IntArrayRef key, const std::string& op) {
  const char* problem = key_problem(key, op.c_str());
  return problem ? problem : "";
}

inline std::vector<std::string> launch_config_fields() {
  return std::vector<std::string>(std::begin(kConfigFields), std::end(kConfigFields));
}

inline std::string launch_config_problem(at::IntArrayRef config) {
  const char* problem = config_problem(config);
  return problem ? problem : "";
}

// The candidates of the key's op and shape, config after config.
inline std::vector<int64_t> tuning_candidates(at::IntArrayRef key) {
  const Key k = key_from_list(key, "tuning_candidates");
  std::vector<int64_t> flat;
  for (const paged::LaunchConfig& c : k[kOp] == 0 ? decode_candidates(k[kGroup]) : prefill_candidates())
    for (int64_t v : config_list(c)) flat.push_back(v);
  return flat;
}

// n keys and n configs, each list flat (n * 11 and n * 5 integers). All checked before any is
// installed: a bad entry installs nothing.
inline void set_tuned_configs(at::IntArrayRef keys, at::IntArrayRef configs, bool replace) {
  TORCH_CHECK_VALUE(keys.size() % kKeyFields == 0 && configs.size() % kConfigSize == 0 &&
                        keys.size() / kKeyFields == configs.size() / kConfigSize,
                    "set_tuned_configs: n keys of 11 integers and n configs of 5, got ", keys.size(), " and ",
                    configs.size(), " integers");
  std::vector<Entry> entries;
  for (size_t i = 0; i < keys.size() / kKeyFields; ++i) {
    const at::IntArrayRef c = configs.slice(i * kConfigSize, kConfigSize);
    const char* problem = config_problem(c);
    TORCH_CHECK_VALUE(problem == nullptr, "set_tuned_configs: ", problem ? problem : "", " (got ", c, ")");
    entries.push_back(Entry{key_from_list(keys.slice(i * kKeyFields, kKeyFields), "set_tuned_configs"),
                            paged::binding::config_from_list(c)});
  }
  install(entries, replace);
}

// [threads, partition_size, kv_tile, force_split, tensor_cores, tuned (1) or the defaults (0)]
inline std::vector<int64_t> tuned_config_of(at::IntArrayRef key) {
  const Key k = key_from_list(key, "tuned_config");
  const Table* table = published.load(std::memory_order_acquire);
  const paged::LaunchConfig* found = table ? table->find(k) : nullptr;
  std::vector<int64_t> out = config_list(found ? *found : paged::LaunchConfig{});
  out.push_back(found ? 1 : 0);
  return out;
}

// Defines them in the paged_cuda namespace (csrc/cuda/backend.cpp).
inline void define_ops(torch::Library& m) {
  m.def("tuning_key(Tensor query, Tensor key_cache, Tensor block_tables, int max_seqlen_q, bool decode) -> int[]",
        &tuning_key);
  m.def("tuning_key_problem(int[] key, str op) -> str", &tuning_key_problem);
  m.def("launch_config_fields() -> str[]", &launch_config_fields);
  m.def("launch_config_problem(int[] config) -> str", &launch_config_problem);
  m.def("tuning_candidates(int[] key) -> int[]", &tuning_candidates);
  m.def("set_tuned_configs(int[] keys, int[] configs, bool replace=False) -> ()", &set_tuned_configs);
  m.def("tuned_config(int[] key) -> int[]", &tuned_config_of);
}

}  // namespace tuning
}  // namespace paged_cuda

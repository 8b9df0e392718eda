// Validation of the public ops' arguments; see validate.h. The messages name the argument the
// way a Python caller sees it (shapes as tuples, dtypes as torch.float16).
#include "public/validate.h"

#include <c10/util/Exception.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <numeric>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace paged::api {
namespace {
using at::ScalarType;

// 576: MLA's latent (DeepSeek: a 512-wide latent plus 64 RoPE dimensions) read as one key head.
constexpr int64_t kMaxHeadSize = 576;
// The kernels (csrc/cpu, csrc/kernels/params.h) hold sizes and counts in 32-bit ints; strides
// and element offsets are 64-bit.
constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();

constexpr std::initializer_list<ScalarType> kFloat = {at::kFloat, at::kHalf, at::kBFloat16};
constexpr std::initializer_list<ScalarType> kFp8 = {at::kFloat8_e4m3fn, at::kFloat8_e5m2};
constexpr std::initializer_list<ScalarType> kCache = {at::kFloat, at::kHalf, at::kBFloat16,
                                                      at::kFloat8_e4m3fn, at::kFloat8_e5m2};

bool contains(std::initializer_list<ScalarType> set, ScalarType t) {
  return std::find(set.begin(), set.end(), t) != set.end();
}
bool is_fp8(ScalarType t) { return contains(kFp8, t); }

// Python's spelling of a dtype, so messages read as they did when validation was Python.
std::string dtype_str(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case ScalarType::Float8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    case ScalarType::Float8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Short: return "torch.int16";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Bool: return "torch.bool";
    case ScalarType::ComplexFloat: return "torch.complex64";
    case ScalarType::ComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string dtype_list(std::initializer_list<ScalarType> set) {
  std::string s = "[";
  for (auto it = set.begin(); it != set.end(); ++it) {
    if (it != set.begin()) s += ", ";
    s += "'" + dtype_str(*it) + "'";
  }
  return s + "]";
}

// A shape as Python prints tuple(t.shape): (3, 4), (3,), ().
std::string shape_str(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < sizes.size(); ++i) s << (i ? ", " : "") << sizes[i];
  if (sizes.size() == 1) s << ",";
  s << ")";
  return s.str();
}

bool content_checks_forced() {
  const char* v = std::getenv("PAGED_OPS_CHECK");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

std::atomic<const EmulatedDeviceMemory*> emulated_device_memory{nullptr};

// A CPU tensor whose memory stands for device memory (set_emulated_device_memory).
bool emulated_device(const Tensor& t) {
  const EmulatedDeviceMemory* memory = emulated_device_memory.load(std::memory_order_acquire);
  return memory != nullptr && t.is_cpu() && t.numel() > 0 && memory->holds(t.const_data_ptr());
}

// Whether the contents of t are checked: always in host memory; in device memory a host copy
// costs a device sync (and breaks CUDA-graph capture), so only when asked for.
bool reads_contents(const Tensor& t) { return (t.is_cpu() && !emulated_device(t)) || content_checks_forced(); }

// t itself in host memory (no copy); a host copy otherwise. Only contiguous tensors are read.
Tensor host(const Tensor& t) {
  if (!t.is_cpu()) return t.cpu();
  if (!emulated_device(t)) return t;
  TORCH_CHECK(t.is_contiguous(), "paged_ops: internal: a content check read a non-contiguous tensor");
  Tensor copy = at::empty(t.sizes(), t.options());
  emulated_device_memory.load()->copy_to_host(copy.data_ptr(), t.const_data_ptr(), t.nbytes());
  return copy;
}

// ---- outputs apart from inputs ---------------------------------------------------------------
// Whether two tensors may share a byte. Exact for the layouts callers use: disjoint byte spans;
// both dense (each fills its span); or strided views whose rows (the contiguous last dimension)
// fall into disjoint residues modulo the gcd of all their outer strides, as the two halves
// [..., :D] and [..., D:] of one [..., 2 * D] cache (vLLM's layout) do. Anything else whose
// spans intersect counts as an overlap: a false alarm there costs a copy, a missed one garbage.
bool memory_overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto base = reinterpret_cast<intptr_t>(a.storage().data());
  struct Layout {
    int64_t begin, end, row_bytes;  // bytes from the storage's start; a row: the last dimension
  };
  int64_t gcd = 0;
  const auto layout = [&](const Tensor& t) {
    const int64_t e = int64_t(t.element_size());
    int64_t last = 0;  // element offset of the last element from the first (strides >= 0 here)
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::max<int64_t>(t.stride(d), 0);
    const int64_t begin = int64_t(reinterpret_cast<intptr_t>(t.const_data_ptr()) - base);
    const int64_t row = t.dim() == 0 ? 1 : t.size(-1);
    const int64_t row_stride = t.dim() == 0 ? 1 : t.stride(-1);
    for (int64_t d = 0; d + 1 < t.dim(); ++d)
      if (t.size(d) > 1 && t.stride(d) > 0) gcd = std::gcd(gcd, t.stride(d) * e);
    return Layout{begin, begin + (last + 1) * e, row_stride == 1 || row == 1 ? row * e : -1};
  };
  const Layout la = layout(a), lb = layout(b);
  if (la.end <= lb.begin || lb.end <= la.begin) return false;
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) return true;
  if (la.row_bytes < 0 || lb.row_bytes < 0 || gcd == 0 || la.row_bytes > gcd || lb.row_bytes > gcd) return true;
  // Rows of a start at residues [ra, ra + row_bytes) modulo gcd, rows of b at [rb, rb + row_bytes).
  const int64_t ra = la.begin % gcd, rb = lb.begin % gcd;
  const auto meets = [&](int64_t r0, int64_t n0, int64_t r1, int64_t n1) {  // does [r0, r0+n0) meet r1's?
    const int64_t d = ((r1 - r0) % gcd + gcd) % gcd;  // r1's distance after r0, modulo gcd
    return d < n0 || gcd - d < n1;
  };
  return meets(ra, la.row_bytes, rb, lb.row_bytes);
}

// A named argument of an op; tensor null when an optional one is absent.
struct Named {
  const char* name;
  const Tensor* tensor;
};
const Tensor* opt(const OptTensor& t) { return t ? &*t : nullptr; }

// Each output apart from every input and from the other outputs: the kernels read their inputs
// while they write (and may write in any order), so an overlap gives garbage, or a crash when
// an index tensor is overwritten, without an error (torch's assert_no_overlap rule).
void check_outputs_apart(std::initializer_list<Named> outputs, std::initializer_list<Named> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (o->tensor == nullptr) continue;
    for (const Named& i : inputs)
      if (i.tensor != nullptr)
        TORCH_CHECK_VALUE(!memory_overlaps(*o->tensor, *i.tensor), o->name, " overlaps ", i.name,
                          " in memory; an output must not share memory with an input (use a separate buffer)");
    for (auto o2 = std::next(o); o2 != outputs.end(); ++o2)
      if (o2->tensor != nullptr)
        TORCH_CHECK_VALUE(!memory_overlaps(*o->tensor, *o2->tensor), o2->name, " overlaps ", o->name,
                          " in memory; two outputs must not share memory");
  }
}

void check_ndim(const char* name, const Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dimensions, got shape ", shape_str(t.sizes()));
}
void check_dtype(const char* name, const Tensor& t, std::initializer_list<ScalarType> dtypes) {
  TORCH_CHECK_VALUE(contains(dtypes, t.scalar_type()), name, " has dtype ", dtype_str(t.scalar_type()),
                    "; expected one of ", dtype_list(dtypes));
}
void check_device(const char* name, const Tensor& t, const c10::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(), " but must be on ", device,
                    " (like the other tensors)");
}
void check_tensor(const char* name, const Tensor& t, int64_t ndim, std::initializer_list<ScalarType> dtypes,
                  const c10::Device& device) {
  check_ndim(name, t, ndim);
  check_dtype(name, t, dtypes);
  check_device(name, t, device);
}
void check_index_tensor(const char* name, const Tensor& t, ScalarType dtype, int64_t ndim,
                        const c10::Device& device) {
  check_tensor(name, t, ndim, {dtype}, device);
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}
void check_unit_stride(const std::string& name, const Tensor& t) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) == 1, name,
                    " must be contiguous in its last (head_size) dimension");
}
// A size the kernels hold in a 32-bit int: larger values would wrap (#12 item 3).
void check_fits(const char* what, int64_t value, const std::string& argument) {
  TORCH_CHECK_VALUE(value <= kMaxIndex, argument, ": ", what, " = ", value,
                    " does not fit the kernels' 32-bit index type (at most ", kMaxIndex, ")");
}
void check_head_size(const char* name, int64_t head_size) {
  TORCH_CHECK_VALUE(head_size % 8 == 0 && 0 < head_size && head_size <= kMaxHeadSize, name, ": head_size ",
                    head_size, " is not supported (must be a multiple of 8, at most ", kMaxHeadSize, ")");
}

// A cache [num_blocks, block_size, num_kv_heads, head_size]: the sizes the kernels hold in ints
// (block ids are int32 in block_tables; num_blocks itself is only compared against, in 64 bits).
void check_cache_sizes(const std::string& name, const Tensor& c) {
  check_fits("block_size (shape[1])", c.size(1), name);
  check_fits("num_kv_heads (shape[2])", c.size(2), name);
}

void check_caches(const Tensor& key_cache, const Tensor& value_cache) {
  for (auto [name, c] : {std::pair<const char*, const Tensor*>{"key_cache", &key_cache}, {"value_cache", &value_cache}}) {
    check_ndim(name, *c, 4);
    check_dtype(name, *c, kCache);
    check_unit_stride(name, *c);
  }
  // Keys and values may have different head sizes (MLA); everything else is shared.
  TORCH_CHECK_VALUE(key_cache.sizes().slice(0, 3) == value_cache.sizes().slice(0, 3), "key_cache shape ",
                    shape_str(key_cache.sizes()), " and value_cache shape ", shape_str(value_cache.sizes()),
                    " must agree in (num_blocks, block_size, num_kv_heads)");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache dtype ",
                    dtype_str(key_cache.scalar_type()), " != value_cache dtype ",
                    dtype_str(value_cache.scalar_type()));
  TORCH_CHECK_VALUE(key_cache.device() == value_cache.device(),
                    "key_cache and value_cache must be on the same device");
  TORCH_CHECK_VALUE(key_cache.size(1) >= 1, "block_size (key_cache.shape[1]) must be >= 1");
  TORCH_CHECK_VALUE(key_cache.size(2) >= 1, "num_kv_heads (key_cache.shape[2]) must be >= 1");
  check_head_size("key_cache", key_cache.size(3));
  check_head_size("value_cache", value_cache.size(3));
  check_cache_sizes("key_cache", key_cache);
}

// fp8 scales: 1 element (per tensor), 1-D [num_kv_heads] (per KV head) or, where the op has
// sequences (num_seqs >= 0), 2-D [num_seqs, num_kv_heads] (per sequence and KV head); K and V each
// their own form (paged::scale_strides reads them).
void check_scales(ScalarType cache_dtype, int64_t num_kv_heads, const c10::Device& device, const OptTensor& k_scale,
                  const OptTensor& v_scale, int64_t num_seqs = -1) {
  if (!is_fp8(cache_dtype)) {
    TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                      "k_scale/v_scale are only for fp8 caches; the cache dtype is ", dtype_str(cache_dtype));
    return;
  }
  for (auto [name, s] : {std::pair<const char*, const OptTensor*>{"k_scale", &k_scale}, {"v_scale", &v_scale}}) {
    TORCH_CHECK_VALUE(s->has_value(), name, " is required for an fp8 (", dtype_str(cache_dtype), ") cache");
    check_dtype(name, **s, {at::kFloat});
    check_device(name, **s, device);
    TORCH_CHECK_VALUE((*s)->is_contiguous(), name, " must be contiguous");
    const Tensor& t = **s;
    const bool per_tensor = t.numel() == 1;
    const bool per_head = t.dim() == 1 && t.size(0) == num_kv_heads;
    const bool per_seq = num_seqs >= 0 && t.dim() == 2 && t.size(0) == num_seqs && t.size(1) == num_kv_heads;
    TORCH_CHECK_VALUE(per_tensor || per_head || per_seq, name, " must have 1 element (per tensor), shape (",
                      num_kv_heads, ",) (per KV head)",
                      num_seqs >= 0 ? " or shape (num_seqs, num_kv_heads) = (" + std::to_string(num_seqs) + ", " +
                                          std::to_string(num_kv_heads) + ") (per sequence and KV head)"
                                    : std::string(),
                      ", got shape ", shape_str(t.sizes()));
  }
}

// query [num_tokens, num_heads, Dk] against key_cache's Dk; out [num_tokens, num_heads, Dv] against
// value_cache's Dv, Dv <= Dk (MLA reads the latent's first Dv columns as the value).
void check_query_out(const Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache) {
  const c10::Device device = key_cache.device();
  check_tensor("query", query, 3, kFloat, device);
  check_tensor("out", out, 3, {query.scalar_type()}, device);
  check_unit_stride("query", query);
  check_unit_stride("out", out);
  const int64_t num_heads = query.size(1), head_size = query.size(2), num_kv_heads = key_cache.size(2);
  const int64_t value_head_size = value_cache.size(3);
  TORCH_CHECK_VALUE(head_size == key_cache.size(3), "query head_size ", head_size, " != key_cache head_size ",
                    key_cache.size(3));
  TORCH_CHECK_VALUE(value_head_size <= head_size, "value_cache head_size ", value_head_size,
                    " is larger than key_cache head_size ", head_size, " (the value head size must be <= the key's)");
  TORCH_CHECK_VALUE(out.size(0) == query.size(0) && out.size(1) == num_heads && out.size(2) == value_head_size,
                    "out shape ", shape_str(out.sizes()), " must be (num_tokens, num_heads, value_cache head_size) = (",
                    query.size(0), ", ", num_heads, ", ", value_head_size, ")");
  TORCH_CHECK_VALUE(num_heads >= 1, "query num_heads (query.shape[1]) must be >= 1, got ", num_heads);
  TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0, "query num_heads ", num_heads,
                    " is not a multiple of the cache's num_kv_heads ", num_kv_heads);
  // Query rows are counted by int32 cu_seqlens_q.
  check_fits("num_tokens (shape[0])", query.size(0), "query");
  check_fits("num_heads (shape[1])", num_heads, "query");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == query.scalar_type() || is_fp8(key_cache.scalar_type()),
                    "key_cache dtype ", dtype_str(key_cache.scalar_type()), " must be the query dtype ",
                    dtype_str(query.scalar_type()), " or an fp8 dtype");
}

// Per-sequence lengths against the block table, and the block ids the sequences use.
void check_block_tables(const Tensor& block_tables, const Tensor& seq_lens, int64_t num_seqs, int64_t num_blocks,
                        int64_t block_size, const c10::Device& device) {
  check_index_tensor("block_tables", block_tables, at::kInt, 2, device);
  check_index_tensor("seq_lens", seq_lens, at::kInt, 1, device);
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0),
                    " rows but there are ", num_seqs, " sequences");
  TORCH_CHECK_VALUE(seq_lens.size(0) == num_seqs, "seq_lens has ", seq_lens.size(0), " entries but there are ",
                    num_seqs, " sequences");
  check_fits("num_seqs (shape[0])", num_seqs, "seq_lens");
  check_fits("max_blocks_per_seq (shape[1])", block_tables.size(1), "block_tables");
  if (num_seqs == 0 || !reads_contents(seq_lens)) return;
  const Tensor lens_h = host(seq_lens), table_h = host(block_tables);
  const int32_t* lens = lens_h.const_data_ptr<int32_t>();
  int64_t min_len = lens[0], max_len = lens[0];
  for (int64_t s = 1; s < num_seqs; ++s) {
    min_len = std::min<int64_t>(min_len, lens[s]);
    max_len = std::max<int64_t>(max_len, lens[s]);
  }
  TORCH_CHECK_VALUE(min_len >= 0, "seq_lens must be >= 0");
  const int64_t cols = block_tables.size(1), capacity = cols * block_size;
  TORCH_CHECK_VALUE(max_len <= capacity, "seq_lens max ", max_len, " exceeds what block_tables covers (", cols,
                    " blocks x block_size ", block_size, " = ", capacity, ")");
  // Only the entries a sequence actually uses must be valid block ids.
  const int32_t* table = table_h.const_data_ptr<int32_t>();
  int64_t min_id = std::numeric_limits<int64_t>::max(), max_id = std::numeric_limits<int64_t>::min();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (const int32_t* id = table + s * cols; id < table + s * cols + used; ++id) {
      min_id = std::min<int64_t>(min_id, *id);
      max_id = std::max<int64_t>(max_id, *id);
    }
  }
  if (min_id <= max_id) {
    TORCH_CHECK_VALUE(min_id >= 0 && max_id < num_blocks, "block_tables holds a block id outside the cache [0, ",
                      num_blocks, "): min ", min_id, ", max ", max_id);
  }
}

void check_fp8_pair(const Tensor& out, const Tensor& input, const Tensor& scale) {
  TORCH_CHECK_VALUE(out.sizes() == input.sizes(), "out shape ", shape_str(out.sizes()), " != input shape ",
                    shape_str(input.sizes()));
  TORCH_CHECK_VALUE(out.is_contiguous() && input.is_contiguous(), "out and input must be contiguous");
  check_dtype("scale", scale, {at::kFloat});
  check_device("scale", scale, input.device());
  TORCH_CHECK_VALUE(scale.numel() == 1, "scale must have exactly 1 element (per-tensor scale), got ", scale.numel());
}

void check_block_mapping(const Tensor& block_mapping, const c10::Device& device, int64_t src_blocks,
                         int64_t dst_blocks, bool distinct_dst) {
  check_ndim("block_mapping", block_mapping, 2);
  check_dtype("block_mapping", block_mapping, {at::kLong});
  TORCH_CHECK_VALUE(block_mapping.is_cpu() || block_mapping.device() == device, "block_mapping must be on the CPU or on ",
                    device, ", not ", block_mapping.device());
  TORCH_CHECK_VALUE(block_mapping.size(1) == 2, "block_mapping must be [n, 2] (src, dst) pairs, got ",
                    shape_str(block_mapping.sizes()));
  TORCH_CHECK_VALUE(block_mapping.is_contiguous(), "block_mapping must be contiguous");
  const int64_t n = block_mapping.size(0);
  check_fits("number of pairs (shape[0])", n, "block_mapping");
  if (n == 0 || !reads_contents(block_mapping)) return;
  const Tensor pairs_h = host(block_mapping);
  const int64_t* pairs = pairs_h.const_data_ptr<int64_t>();
  int64_t src_min = pairs[0], src_max = pairs[0], dst_min = pairs[1], dst_max = pairs[1];
  for (int64_t i = 1; i < n; ++i) {
    src_min = std::min(src_min, pairs[2 * i]), src_max = std::max(src_max, pairs[2 * i]);
    dst_min = std::min(dst_min, pairs[2 * i + 1]), dst_max = std::max(dst_max, pairs[2 * i + 1]);
  }
  TORCH_CHECK_VALUE(src_min >= 0 && src_max < src_blocks, "block_mapping source ids must be in [0, ", src_blocks,
                    "), got ", src_min, "..", src_max);
  TORCH_CHECK_VALUE(dst_min >= 0 && dst_max < dst_blocks, "block_mapping destination ids must be in [0, ", dst_blocks,
                    "), got ", dst_min, "..", dst_max);
  if (!distinct_dst) return;
  std::vector<int64_t> src(n), dst(n);
  for (int64_t i = 0; i < n; ++i) src[i] = pairs[2 * i], dst[i] = pairs[2 * i + 1];
  std::sort(src.begin(), src.end());
  std::sort(dst.begin(), dst.end());
  TORCH_CHECK_VALUE(std::adjacent_find(dst.begin(), dst.end()) == dst.end(),
                    "block_mapping destination ids must be distinct");
  for (const int64_t d : dst) {
    TORCH_CHECK_VALUE(!std::binary_search(src.begin(), src.end(), d),
                      "block_mapping destination ids must not also be sources");
  }
}

}  // namespace

void check_reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& slot_mapping, const OptTensor& k_scale,
                             const OptTensor& v_scale) {
  check_caches(key_cache, value_cache);
  const c10::Device device = key_cache.device();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  for (auto [name, x, cache] : {std::tuple<const char*, const Tensor*, const Tensor*>{"key", &key, &key_cache},
                                {"value", &value, &value_cache}}) {
    check_tensor(name, *x, 3, kFloat, device);
    check_unit_stride(name, *x);
    TORCH_CHECK_VALUE(x->size(1) == num_kv_heads && x->size(2) == cache->size(3), name, " is [num_tokens, ",
                      x->size(1), ", ", x->size(2), "] but its cache holds [num_kv_heads=", num_kv_heads,
                      ", head_size=", cache->size(3), "]");
  }
  TORCH_CHECK_VALUE(key.size(0) == value.size(0), "key has ", key.size(0), " tokens but value has ", value.size(0));
  TORCH_CHECK_VALUE(key.scalar_type() == value.scalar_type(), "key dtype ", dtype_str(key.scalar_type()),
                    " != value dtype ", dtype_str(value.scalar_type()));
  TORCH_CHECK_VALUE(key_cache.scalar_type() == key.scalar_type() || is_fp8(key_cache.scalar_type()),
                    "key_cache dtype ", dtype_str(key_cache.scalar_type()), " must be the key dtype ",
                    dtype_str(key.scalar_type()), " or an fp8 dtype");
  check_index_tensor("slot_mapping", slot_mapping, at::kLong, 1, device);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
                    " entries but key has ", key.size(0), " tokens");
  check_scales(key_cache.scalar_type(), num_kv_heads, device, k_scale, v_scale);
  check_outputs_apart({{"key_cache", &key_cache}, {"value_cache", &value_cache}},
                      {{"key", &key}, {"value", &value}, {"slot_mapping", &slot_mapping},
                       {"k_scale", opt(k_scale)}, {"v_scale", opt(v_scale)}});
  if (slot_mapping.numel() == 0 || !reads_contents(slot_mapping)) return;
  const Tensor slots_h = host(slot_mapping);
  const int64_t* slots = slots_h.const_data_ptr<int64_t>();
  const int64_t top = *std::max_element(slots, slots + slot_mapping.numel());
  TORCH_CHECK_VALUE(top < num_blocks * block_size, "slot_mapping holds slot ", top, ", outside the cache (",
                    num_blocks, " blocks x ", block_size, " slots)");
}

void check_concat_and_cache_mla(const Tensor& latent, const Tensor& rope, const Tensor& latent_cache,
                                const Tensor& slot_mapping, const OptTensor& scale) {
  check_ndim("latent_cache", latent_cache, 4);
  check_dtype("latent_cache", latent_cache, kCache);
  check_unit_stride("latent_cache", latent_cache);
  const c10::Device device = latent_cache.device();
  for (auto [name, x] : {std::pair<const char*, const Tensor*>{"latent", &latent}, {"rope", &rope}}) {
    check_tensor(name, *x, 2, kFloat, device);
    check_unit_stride(name, *x);
  }
  TORCH_CHECK_VALUE(rope.scalar_type() == latent.scalar_type(), "rope dtype ", dtype_str(rope.scalar_type()),
                    " != latent dtype ", dtype_str(latent.scalar_type()));
  TORCH_CHECK_VALUE(rope.size(0) == latent.size(0), "rope has ", rope.size(0), " tokens but latent has ",
                    latent.size(0));
  const int64_t rank = latent.size(1), rope_dim = rope.size(1);
  TORCH_CHECK_VALUE(rank > 0 && rank % 8 == 0, "latent: kv_lora_rank (shape[1]) ", rank,
                    " is not supported (must be a positive multiple of 8)");
  TORCH_CHECK_VALUE(rope_dim % 8 == 0, "rope: rope_dim (shape[1]) ", rope_dim,
                    " is not supported (must be a multiple of 8)");
  TORCH_CHECK_VALUE(latent_cache.size(1) >= 1, "block_size (latent_cache.shape[1]) must be >= 1");
  TORCH_CHECK_VALUE(latent_cache.size(2) == 1, "latent_cache must hold one KV head (shape[2] == 1), got shape ",
                    shape_str(latent_cache.sizes()));
  TORCH_CHECK_VALUE(latent_cache.size(3) == rank + rope_dim, "latent_cache rows hold ", latent_cache.size(3),
                    " numbers but latent + rope have ", rank, " + ", rope_dim);
  check_cache_sizes("latent_cache", latent_cache);
  check_fits("row size (shape[3])", latent_cache.size(3), "latent_cache");
  const ScalarType cache_dtype = latent_cache.scalar_type();
  TORCH_CHECK_VALUE(cache_dtype == latent.scalar_type() || is_fp8(cache_dtype), "latent_cache dtype ",
                    dtype_str(cache_dtype), " must be the latent dtype ", dtype_str(latent.scalar_type()),
                    " or an fp8 dtype");
  if (is_fp8(cache_dtype)) {
    TORCH_CHECK_VALUE(scale.has_value(), "scale is required for an fp8 (", dtype_str(cache_dtype), ") latent_cache");
    check_dtype("scale", *scale, {at::kFloat});
    check_device("scale", *scale, device);
    TORCH_CHECK_VALUE(scale->numel() == 1 && scale->is_contiguous(),
                      "scale must be one contiguous element (per tensor), got shape ", shape_str(scale->sizes()));
  } else {
    TORCH_CHECK_VALUE(!scale.has_value(), "scale is only for fp8 caches; latent_cache dtype is ",
                      dtype_str(cache_dtype));
  }
  check_index_tensor("slot_mapping", slot_mapping, at::kLong, 1, device);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == latent.size(0), "slot_mapping has ", slot_mapping.size(0),
                    " entries but latent has ", latent.size(0), " tokens");
  check_outputs_apart({{"latent_cache", &latent_cache}}, {{"latent", &latent}, {"rope", &rope},
                                                          {"slot_mapping", &slot_mapping}, {"scale", opt(scale)}});
  if (slot_mapping.numel() == 0 || !reads_contents(slot_mapping)) return;
  const Tensor slots_h = host(slot_mapping);
  const int64_t* slots = slots_h.const_data_ptr<int64_t>();
  const int64_t top = *std::max_element(slots, slots + slot_mapping.numel());
  const int64_t num_slots = latent_cache.size(0) * latent_cache.size(1);
  TORCH_CHECK_VALUE(top < num_slots, "slot_mapping holds slot ", top, ", outside latent_cache (",
                    latent_cache.size(0), " blocks x ", latent_cache.size(1), " slots)");
}

void check_decode_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                            const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                            const OptTensor& k_scale, const OptTensor& v_scale) {
  check_caches(key_cache, value_cache);
  check_query_out(out, query, key_cache, value_cache);
  check_scales(key_cache.scalar_type(), key_cache.size(2), key_cache.device(), k_scale, v_scale, query.size(0));
  // seq_lens 0 is allowed (a padded slot): the row sees no key (reference.attention's empty row).
  check_block_tables(block_tables, seq_lens, query.size(0), key_cache.size(0), key_cache.size(1),
                     key_cache.device());
}

void check_prefill_attention(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& block_tables, const Tensor& cu_seqlens_q,
                             const Tensor& seq_lens, int64_t max_seqlen_q, const OptTensor& k_scale,
                             const OptTensor& v_scale) {
  check_caches(key_cache, value_cache);
  check_query_out(out, query, key_cache, value_cache);
  const c10::Device device = key_cache.device();
  check_index_tensor("cu_seqlens_q", cu_seqlens_q, at::kInt, 1, device);
  const int64_t num_seqs = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK_VALUE(num_seqs >= 0, "cu_seqlens_q must have num_seqs + 1 entries");
  check_scales(key_cache.scalar_type(), key_cache.size(2), device, k_scale, v_scale, num_seqs);
  check_block_tables(block_tables, seq_lens, num_seqs, key_cache.size(0), key_cache.size(1), device);
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q=", max_seqlen_q, " must be >= 0");
  check_fits("the longest query length", max_seqlen_q, "max_seqlen_q");
  if (!reads_contents(cu_seqlens_q)) return;
  const Tensor cu_h = host(cu_seqlens_q);
  const int32_t* cu = cu_h.const_data_ptr<int32_t>();
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[num_seqs] == query.size(0),
                    "cu_seqlens_q must start at 0 and end at total_q_tokens=", query.size(0), ", got ", cu[0], "..",
                    cu[num_seqs]);
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t(cu[s + 1]) - cu[s];
    TORCH_CHECK_VALUE(q_len >= 0, "cu_seqlens_q must be non-decreasing");
    longest = std::max(longest, q_len);
  }
  // q_len > seq_len is allowed: under causal alignment the first rows sit before the first key
  // and see none (reference.attention's empty row: out 0, lse -inf).
  TORCH_CHECK_VALUE(max_seqlen_q >= longest, "max_seqlen_q=", max_seqlen_q, " is smaller than the longest query (",
                    longest, ")");
}

void check_quantize_fp8(const Tensor& out, const Tensor& input, const Tensor& scale) {
  check_dtype("input", input, kFloat);
  check_dtype("out", out, kFp8);
  check_device("out", out, input.device());
  check_fp8_pair(out, input, scale);
  check_outputs_apart({{"out", &out}}, {{"input", &input}, {"scale", &scale}});
}

void check_dequantize_fp8(const Tensor& out, const Tensor& input, const Tensor& scale) {
  check_dtype("input", input, kFp8);
  check_dtype("out", out, kFloat);
  check_device("out", out, input.device());
  check_fp8_pair(out, input, scale);
  check_outputs_apart({{"out", &out}}, {{"input", &input}, {"scale", &scale}});
}

void check_copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const Tensor& block_mapping) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
                    " layers but value_caches has ", value_caches.size());
  TORCH_CHECK_VALUE(!key_caches.empty(), "key_caches must hold at least one layer");
  const c10::Device device = key_caches[0].device();
  const int64_t num_blocks = key_caches[0].dim() == 4 ? key_caches[0].size(0) : 0;
  // Both lists' layers go to the kernels as one array of descriptors counted in an int.
  check_fits("number of layers", int64_t(key_caches.size()), "key_caches");
  for (size_t i = 0; i < key_caches.size(); ++i) {
    const std::string k_name = "key_caches[" + std::to_string(i) + "]";
    const std::string v_name = "value_caches[" + std::to_string(i) + "]";
    check_tensor(k_name.c_str(), key_caches[i], 4, kCache, device);
    check_tensor(v_name.c_str(), value_caches[i], 4, kCache, device);
    TORCH_CHECK_VALUE(key_caches[i].size(0) == num_blocks && value_caches[i].size(0) == num_blocks, "layer ", i,
                      "'s caches have ", key_caches[i].size(0), "/", value_caches[i].size(0),
                      " blocks; every layer needs ", num_blocks);
    check_unit_stride(k_name, key_caches[i]);
    check_unit_stride(v_name, value_caches[i]);
    check_cache_sizes(k_name, key_caches[i]);
    check_cache_sizes(v_name, value_caches[i]);
    check_fits("head_size (shape[3])", key_caches[i].size(3), k_name);
    check_fits("head_size (shape[3])", value_caches[i].size(3), v_name);
  }
  check_block_mapping(block_mapping, device, num_blocks, num_blocks, true);
  // The caches are read and written (cache[dst] = cache[src]); the mapping only read.
  for (size_t i = 0; i < key_caches.size(); ++i) {
    const std::string k_name = "key_caches[" + std::to_string(i) + "]";
    const std::string v_name = "value_caches[" + std::to_string(i) + "]";
    check_outputs_apart({{k_name.c_str(), &key_caches[i]}}, {{"block_mapping", &block_mapping}});
    check_outputs_apart({{v_name.c_str(), &value_caches[i]}}, {{"block_mapping", &block_mapping}});
  }
}

void check_swap_blocks(const Tensor& src, const Tensor& dst, const Tensor& block_mapping) {
  check_ndim("src", src, 4);
  check_dtype("src", src, kCache);
  check_ndim("dst", dst, 4);
  check_dtype("dst", dst, {src.scalar_type()});
  TORCH_CHECK_VALUE(src.sizes().slice(1) == dst.sizes().slice(1), "src blocks ", shape_str(src.sizes().slice(1)),
                    " and dst blocks ", shape_str(dst.sizes().slice(1)), " differ in shape");
  check_unit_stride("src", src);
  check_unit_stride("dst", dst);
  check_ndim("block_mapping", block_mapping, 2);
  check_dtype("block_mapping", block_mapping, {at::kLong});
  TORCH_CHECK_VALUE(block_mapping.is_cpu(), "block_mapping must be on the CPU, not ", block_mapping.device());
  check_block_mapping(block_mapping, c10::Device(c10::kCPU), src.size(0), dst.size(0), false);
  check_outputs_apart({{"dst", &dst}}, {{"src", &src}, {"block_mapping", &block_mapping}});
}

void set_emulated_device_memory(const EmulatedDeviceMemory* memory) {
  emulated_device_memory.store(memory, std::memory_order_release);
}

}  // namespace paged::api

namespace paged::api {

void check_attention_variants(const Tensor& out, const Tensor& query, double softcap, int64_t window_left,
                              const OptTensor& sinks, const OptTensor& alibi_slopes, const OptTensor& lse,
                              bool /*batch_invariant*/, int64_t window_right) {
  // The kernels hold it in a float and scale scores by 1 / softcap and by softcap * log2(e): a
  // value that rounds to 0 there would silently mean "no cap", one near float32's largest value
  // overflows those products to inf and every score to NaN. [2^-126, 2^126] keeps both finite.
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= 0x1p-126 && softcap <= 0x1p126), "softcap=", softcap,
                    " must be 0 (no soft-cap) or within [2^-126, 2^126] (the kernels compute in float32)");
  TORCH_CHECK_VALUE(window_left >= -1, "window_left=", window_left,
                    " must be >= -1 (-1: no window; w >= 0: a query sees itself and the w keys before it)");
  TORCH_CHECK_VALUE(window_right >= -1, "window_right=", window_right,
                    " must be >= -1 (-1: no limit; w >= 0: a query sees at most the w keys after it)");
  const c10::Device device = query.device();
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  for (auto [name, t] : {std::pair<const char*, const OptTensor*>{"sinks", &sinks}, {"alibi_slopes", &alibi_slopes}}) {
    if (!t->has_value()) continue;
    check_tensor(name, **t, 1, {at::kFloat}, device);
    TORCH_CHECK_VALUE((*t)->size(0) == num_heads, name, " must have num_heads=", num_heads, " elements, got ",
                      (*t)->size(0));
    TORCH_CHECK_VALUE((*t)->is_contiguous(), name, " must be contiguous");
  }
  // Sinks may be +-inf or NaN (reference.attention defines them); a slope times a distance has
  // no such meaning (inf * 0 on the diagonal), so slopes must be finite: a content check.
  if (alibi_slopes && reads_contents(*alibi_slopes)) {
    const Tensor slopes_h = host(*alibi_slopes);
    const float* slope = slopes_h.const_data_ptr<float>();
    for (int64_t h = 0; h < num_heads; ++h)
      TORCH_CHECK_VALUE(std::isfinite(slope[h]), "alibi_slopes[", h, "] = ", slope[h], " must be finite");
  }
  if (lse.has_value()) {
    check_tensor("lse", *lse, 2, {at::kFloat}, device);
    TORCH_CHECK_VALUE(lse->size(0) == num_tokens && lse->size(1) == num_heads, "lse shape ",
                      shape_str(lse->sizes()), " must be (num_tokens, num_heads) = (", num_tokens, ", ", num_heads,
                      ")");
    TORCH_CHECK_VALUE(lse->is_contiguous(), "lse must be contiguous");
  }
}

void check_attention_outputs_apart(const Tensor& out, const OptTensor& lse, const Tensor& query,
                                   const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                                   const Tensor& seq_lens, const OptTensor& cu_seqlens_q, const OptTensor& k_scale,
                                   const OptTensor& v_scale, const OptTensor& sinks, const OptTensor& alibi_slopes) {
  check_outputs_apart({{"out", &out}, {"lse", opt(lse)}},
                      {{"query", &query}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
                       {"block_tables", &block_tables}, {"seq_lens", &seq_lens},
                       {"cu_seqlens_q", opt(cu_seqlens_q)}, {"k_scale", opt(k_scale)}, {"v_scale", opt(v_scale)},
                       {"sinks", opt(sinks)}, {"alibi_slopes", opt(alibi_slopes)}});
}

void check_merge_attention_states(const Tensor& out, const OptTensor& out_lse, const Tensor& prefix_out,
                                  const Tensor& prefix_lse, const Tensor& suffix_out, const Tensor& suffix_lse) {
  const c10::Device device = out.device();
  check_tensor("out", out, 3, kFloat, device);
  check_unit_stride("out", out);
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"prefix_out", &prefix_out}, {"suffix_out", &suffix_out}}) {
    check_tensor(name, *t, 3, {out.scalar_type()}, device);
    TORCH_CHECK_VALUE(t->sizes() == out.sizes(), name, " shape ", shape_str(t->sizes()), " != out shape ",
                      shape_str(out.sizes()));
    check_unit_stride(name, *t);
  }
  check_fits("num_tokens (shape[0])", out.size(0), "out");
  check_fits("num_heads (shape[1])", out.size(1), "out");
  check_fits("head_size (shape[2])", out.size(2), "out");
  const std::pair<const char*, const Tensor*> lses[] = {{"prefix_lse", &prefix_lse}, {"suffix_lse", &suffix_lse},
                                                        {"out_lse", out_lse ? &*out_lse : nullptr}};
  for (auto [name, t] : lses) {
    if (t == nullptr) continue;
    check_tensor(name, *t, 2, {at::kFloat}, device);
    TORCH_CHECK_VALUE(t->size(0) == out.size(0) && t->size(1) == out.size(1), name, " shape ",
                      shape_str(t->sizes()), " must be (num_tokens, num_heads) = (", out.size(0), ", ",
                      out.size(1), ")");
    TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous");
  }
  // No in-place merge: a kernel may write a row's out before it has read all of that row's inputs.
  check_outputs_apart({{"out", &out}, {"out_lse", opt(out_lse)}},
                      {{"prefix_out", &prefix_out}, {"prefix_lse", &prefix_lse}, {"suffix_out", &suffix_out},
                       {"suffix_lse", &suffix_lse}});
}

void check_merge_states(const Tensor& out, const OptTensor& out_lse, const Tensor& states, const Tensor& states_lse) {
  const c10::Device device = out.device();
  check_tensor("out", out, 3, kFloat, device);
  check_unit_stride("out", out);
  check_tensor("states", states, 4, {out.scalar_type()}, device);
  check_unit_stride("states", states);
  const int64_t num_tokens = out.size(0), num_heads = out.size(1), head_size = out.size(2);
  const int64_t num_states = states.size(1);
  TORCH_CHECK_VALUE(states.size(0) == num_tokens && states.size(2) == num_heads && states.size(3) == head_size,
                    "states shape ", shape_str(states.sizes()),
                    " must be (num_tokens, num_states, num_heads, head_size) with out's (", num_tokens, ", ",
                    num_heads, ", ", head_size, ")");
  check_tensor("states_lse", states_lse, 3, {at::kFloat}, device);
  TORCH_CHECK_VALUE(states_lse.size(0) == num_tokens && states_lse.size(1) == num_states &&
                        states_lse.size(2) == num_heads,
                    "states_lse shape ", shape_str(states_lse.sizes()),
                    " must be (num_tokens, num_states, num_heads) = (", num_tokens, ", ", num_states, ", ",
                    num_heads, ")");
  for (auto [name, t] : {std::pair<const char*, const Tensor*>{"states", &states}, {"states_lse", &states_lse}})
    for (int64_t d = 0; d < t->dim(); ++d)
      TORCH_CHECK_VALUE(t->stride(d) >= 0, name, " must not have negative strides");
  for (auto [what, n] : {std::pair<const char*, int64_t>{"num_tokens (shape[0])", num_tokens},
                         {"num_heads (shape[1])", num_heads}, {"head_size (shape[2])", head_size}})
    check_fits(what, n, "out");
  check_fits("num_states (shape[1])", num_states, "states");
  if (out_lse) {
    check_tensor("out_lse", *out_lse, 2, {at::kFloat}, device);
    TORCH_CHECK_VALUE(out_lse->size(0) == num_tokens && out_lse->size(1) == num_heads, "out_lse shape ",
                      shape_str(out_lse->sizes()), " must be (num_tokens, num_heads) = (", num_tokens, ", ",
                      num_heads, ")");
    TORCH_CHECK_VALUE(out_lse->is_contiguous(), "out_lse must be contiguous");
  }
  check_outputs_apart({{"out", &out}, {"out_lse", opt(out_lse)}},
                      {{"states", &states}, {"states_lse", &states_lse}});
}

}  // namespace paged::api

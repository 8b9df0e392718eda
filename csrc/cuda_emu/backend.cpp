// Backend `cuda_emu`: the CUDA kernels run on CPU tensors by the emulator (csrc/emu/cuda_emu.h),
// registered as torch.ops.paged_cuda_emu.* (CPU dispatch key) by the one registration
// (csrc/binding.h) over the emulator's launchers (kernels_*.cpp); launches are synchronous,
// there is no stream, and the launch configuration is the kernels' default. Test-only ops (an
// explicit launch configuration, the KV byte counter) are in the namespace paged_cuda_emu_test.
#include <torch/library.h>

#include <atomic>
#include <cstring>

#include "public/validate.h"

#include "binding.h"

namespace paged {
void emu_load_watch_begin(const void* a, size_t a_bytes, const void* b, size_t b_bytes);  // kernels_decode.cpp
int emu_decode_rows_per_step(int cache_bytes);       // kernels_decode.cpp
int emu_decode_rows_per_step_sm80(int cache_bytes);  // kernels_decode_sm80.cpp
uint64_t emu_load_watch_end();
// Device memory the host cannot read (device_memory.cpp).
void* emu_device_alloc(size_t bytes);
void emu_device_free(void* p, size_t bytes);
void emu_close_device_memory(bool closed);
bool emu_in_device_memory(const void* p);
void emu_device_copy(void* dst, const void* src, size_t bytes);
}  // namespace paged

namespace paged_cuda_emu {
namespace {

// cudaMemcpyAsync's counterpart (swap_blocks): a copy engine's, so it may read device memory.
void copy_bytes(void* dst, const void* src, size_t bytes, paged::Stream) { paged::emu_device_copy(dst, src, bytes); }

// The test switch device_memory_as_host(True): the public layer is told the emulator's device memory
// is host memory, so its content checks read it on the host (what a broken op path would do); the
// graph-safety test shows that such a read dies.
std::atomic<bool> device_memory_as_host{false};

const paged::api::EmulatedDeviceMemory kDeviceMemory{
    [](const void* p) { return !device_memory_as_host.load() && paged::emu_in_device_memory(p); },
    paged::emu_device_copy};

// The public layer learns which CPU memory is the emulator's device memory when the library loads.
[[maybe_unused]] const bool kDeviceMemoryInstalled = (paged::api::set_emulated_device_memory(&kDeviceMemory), true);

}  // namespace

// What the GPU heuristics see on the emulator: an H100-sized device (132 SMs) unless a test sets
// another count (paged_cuda_emu_test::set_num_sms), so the emulated launches take the same
// decisions (one-pass vs split-KV, partition sizes) as a GPU with that many SMs.
constexpr int kDefaultEmulatedSMs = 132;
inline std::atomic<int>& emulated_sms() {
  static std::atomic<int> n{kDefaultEmulatedSMs};
  return n;
}

// Whose compiled code the emulated decode runs: sm_90's (the default) or, after a test's
// paged_cuda_emu_test::set_emulated_arch(80), sm_80 / 86 / 89's (kernels_decode_sm80.cpp), where
// the kernels' device code takes other choices (decode_kernel_rows_per_step).
constexpr int kDefaultEmulatedArch = 90;
inline std::atomic<int>& emulated_arch() {
  static std::atomic<int> arch{kDefaultEmulatedArch};
  return arch;
}

// Blocks a thread-block cluster may have on the emulated device: 16 on sm_90 (its non-portable size,
// which the decode plan's cluster merge takes) unless a test sets another count
// (paged_cuda_emu_test::set_max_cluster_size; -1: the arch's); none before sm_90.
inline std::atomic<int>& emulated_max_cluster() {
  static std::atomic<int> n{-1};
  return n;
}
inline int emulated_max_cluster_size() {
  const int n = emulated_max_cluster().load();
  return emulated_arch().load() < 90 ? 0 : n >= 0 ? n : 16;
}

struct Backend {
  using Guard = paged::registration::NoGuard;
  static paged::binding::Target target(const at::Device&) {
    return {emulated_arch().load() < 90 ? &paged::kEmuDecodeSm80 : &paged::kEmuDecode, &paged::kEmuPrefill, nullptr, &paged::kEmuCache, &paged::kEmuMerge,
            &paged::kEmuMergeStates, nullptr, emulated_sms().load(), copy_bytes, nullptr, /*int32_sizes=*/true,
            emulated_max_cluster_size()};
  }
};

namespace {

using at::Tensor;
using paged::binding::OptTensor;
using Ops = paged::registration::Ops<Backend>;

// How many bytes `run` makes the kernels read from the two KV caches' storages (through the
// kernels' load helpers).
template <typename F>
int64_t kv_bytes_read(const Tensor& key_cache, const Tensor& value_cache, F&& run) {
  auto range = [](const Tensor& t) { return std::make_pair(t.storage().data(), t.storage().nbytes()); };
  const auto k = range(key_cache), v = range(value_cache);
  paged::emu_load_watch_begin(k.first, k.second, v.first, v.second);
  try {
    run();
  } catch (...) {
    paged::emu_load_watch_end();
    throw;
  }
  return int64_t(paged::emu_load_watch_end());
}

// decode_attention_config (with optional sliding windows) that also returns how many bytes its
// kernels read from the two KV caches. Tests compare it with the bytes of the live tokens to prove
// each KV token is read once per query group, and that a window reads only its own tokens.
int64_t decode_kv_bytes_read(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, double scale,
                             const OptTensor& k_scale, const OptTensor& v_scale, at::IntArrayRef config,
                             int64_t window_left, int64_t window_right) {
  return kv_bytes_read(key_cache, value_cache, [&] {
    Ops::decode_attention_config(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                            config, 0.0, window_left, std::nullopt, std::nullopt, std::nullopt, false, window_right);
  });
}
// The same for prefill_attention_config: a window (left, right, or both) must cost O(window) keys
// per row tile (batch_invariant: per row, through the decode kernel), not O(seq_len).
int64_t prefill_kv_bytes_read(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                              int64_t max_seqlen_q, double scale, bool causal, const OptTensor& k_scale,
                              const OptTensor& v_scale, at::IntArrayRef config, int64_t window_left,
                              int64_t window_right, bool batch_invariant) {
  return kv_bytes_read(key_cache, value_cache, [&] {
    Ops::prefill_attention_config(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                             scale, causal, k_scale, v_scale, config, 0.0, window_left, std::nullopt, std::nullopt,
                             std::nullopt, batch_invariant, window_right);
  });
}

// The SM count the plans see from now on (0: the default, 132); returns the previous one.
int64_t set_num_sms(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= 1 << 20, "set_num_sms: ", n, " SMs");
  return emulated_sms().exchange(n ? int(n) : kDefaultEmulatedSMs);
}

// The cluster size the plans may take from now on (0: no clusters, as before sm_90; 2..16; -1: the
// emulated arch's, 16 on sm_90); returns the previous setting.
int64_t set_max_cluster_size(int64_t n) {
  TORCH_CHECK_VALUE(n >= -1 && n <= 16, "set_max_cluster_size: ", n, " (-1: the arch's, 0: none, up to 16)");
  return emulated_max_cluster().exchange(int(n));
}

// The architecture whose code the emulated decode runs from now on (80, 86, 89: sm_80's build;
// 90 or 0: sm_90's); returns the previous one.
int64_t set_emulated_arch(int64_t arch) {
  TORCH_CHECK_VALUE(arch == 0 || arch == 80 || arch == 86 || arch == 89 || arch == 90,
                    "set_emulated_arch: ", arch, " (emulated: 80, 86, 89, 90; 0: the default, 90)");
  return emulated_arch().exchange(arch ? int(arch) : kDefaultEmulatedArch);
}

// Token rows a step of the group-4 decode kernel takes in the emulated architecture's build.
int64_t decode_rows_per_step(int64_t cache_bytes) {
  const int b = int(cache_bytes);
  return emulated_arch().load() < 90 ? paged::emu_decode_rows_per_step_sm80(b) : paged::emu_decode_rows_per_step(b);
}

// The decode plan (kernels/plan.h) decode_attention_config would launch with: [grid_x, grid_y,
// grid_z, threads, split, partition_size, heads_per_thread, tile_tokens, smem bytes, blocks_per_sm,
// fast_path, score_mods, cluster_blocks, tpt], for a call with this soft-cap and these ALiBi slopes.
std::vector<int64_t> decode_plan(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
                                 at::IntArrayRef config, double softcap, const std::optional<Tensor>& alibi_slopes) {
  const paged::binding::Target tgt = Backend::target(query.device());
  paged::AttentionVariants variants;
  variants.softcap = softcap;
  variants.alibi_slopes = alibi_slopes;
  const paged::AttentionParams p =
      paged::binding::attention_params(tgt, out, query, key_cache, value_cache, block_tables, seq_lens, nullptr, 1,
                                       1.0, true, std::nullopt, std::nullopt, variants);
  const paged::DecodePlan pl = paged::plan_decode(p, paged::binding::config_from_list(config));
  return {pl.grid_x, pl.grid_y, pl.grid_z, pl.threads, pl.split, pl.partition_size, pl.heads_per_thread,
          pl.sh.tile_tokens, int64_t(pl.smem), pl.blocks_per_sm, pl.fast_path, pl.score_mods, pl.sh.cluster_blocks, pl.tpt};
}

}  // namespace
}  // namespace paged_cuda_emu

PAGED_OPS_REGISTER_BACKEND(paged_cuda_emu, CPU, paged_cuda_emu::Backend)
PAGED_OPS_REGISTER_TEST_OPS(paged_cuda_emu_test, CPU, paged_cuda_emu::Backend)

// The KV byte counters (tests): the decode / prefill test ops that also say what their kernels read.
TORCH_LIBRARY_FRAGMENT(paged_cuda_emu_test, m) {
  m.def("decode_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, int[] config, "
        "int window_left=-1, int window_right=-1) -> int");
  m.def("prefill_kv_bytes_read(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, int max_seqlen_q, float scale, bool causal, "
        "Tensor? k_scale, Tensor? v_scale, int[] config, int window_left=-1, int window_right=-1, "
        "bool batch_invariant=False) -> int");
  m.def("set_num_sms(int n) -> int", &paged_cuda_emu::set_num_sms);
  m.def("set_emulated_arch(int arch) -> int", &paged_cuda_emu::set_emulated_arch);
  m.def("set_max_cluster_size(int n) -> int", &paged_cuda_emu::set_max_cluster_size);
  m.def("decode_rows_per_step(int cache_bytes) -> int", &paged_cuda_emu::decode_rows_per_step);
  m.def("decode_plan(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, int[] config, float softcap=0.0, Tensor? alibi_slopes=None) -> int[]");
}

TORCH_LIBRARY_IMPL(paged_cuda_emu_test, CPU, m) {
  m.impl("decode_kv_bytes_read", &paged_cuda_emu::decode_kv_bytes_read);
  m.impl("prefill_kv_bytes_read", &paged_cuda_emu::prefill_kv_bytes_read);
  m.impl("decode_plan", &paged_cuda_emu::decode_plan);
}

// Device memory the host cannot read (tests/test_cuda_graph_safety.py): device_memory(nbytes) is a
// fresh page-aligned uint8 buffer that the ops take as device memory (their content checks skip it,
// as on CUDA tensors); after close_device_memory(True) only kernels and device copies may touch it,
// so any host read is a SIGSEGV; close_device_memory(False) makes it readable again.
namespace paged_cuda_emu {
namespace {

at::Tensor device_memory(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes > 0, "device_memory: nbytes must be > 0, got ", nbytes);
  void* p = paged::emu_device_alloc(size_t(nbytes));
  return at::from_blob(p, {nbytes}, [nbytes](void* q) { paged::emu_device_free(q, size_t(nbytes)); },
                       at::TensorOptions(at::kByte));
}
void close_device_memory(bool closed) { paged::emu_close_device_memory(closed); }
void set_device_memory_as_host(bool on) { device_memory_as_host = on; }

}  // namespace
}  // namespace paged_cuda_emu

// Defined with their kernels (catch-all): device_memory has no tensor argument to dispatch on.
TORCH_LIBRARY_FRAGMENT(paged_cuda_emu_test, m) {
  m.def("device_memory(int nbytes) -> Tensor", &paged_cuda_emu::device_memory);
  m.def("close_device_memory(bool closed) -> ()", &paged_cuda_emu::close_device_memory);
  m.def("device_memory_as_host(bool on) -> ()", &paged_cuda_emu::set_device_memory_as_host);
  // How many device copies of cache descriptors copy_blocks has built (binding::descriptor_table),
  // over every C++ backend: a set of caches is uploaded once, not per call.
  m.def("copy_blocks_descriptor_tables() -> int",
        []() -> int64_t { return paged::binding::descriptor_tables_built().load(); });
}

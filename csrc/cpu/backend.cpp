// Backend `cpu`: torch.ops.paged_cpu.* through the one registration (csrc/binding.h). What is
// this backend's own: its Target, the launchers of the active ISA build of the kernels
// (csrc/cpu/isa.h) plus the kernels built once (merges, copy_blocks). The active build is the best
// this CPU runs, chosen once at the first call, unless PAGED_OPS_CPU_ISA names another;
// torch.ops.paged_cpu.set_isa switches it at run time (tests and benchmarks run every path in one
// process that way). Compiled with the baseline flags: this file must run on any CPU the package
// is built for.
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/isa.h"
#include "binding.h"

namespace paged::cpu {
namespace {

struct Isa {
  const char* name;
  IsaKernels (*kernels)();  // nullptr: not built into this package (another architecture)
  bool (*runs_here)();
  std::string (*why_not)() = nullptr;  // why it does not run here, where there is more to say than the CPU
};

#if defined(__x86_64__) || defined(__i386__)
bool has_avx2() {
  __builtin_cpu_init();  // libgcc's check includes the OS enabling the AVX / AVX-512 register state
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif

// Why the AMX build cannot run here ("" when it can). Tiles need the CPU (CPUID.(7,0):EDX bits 24
// AMX-TILE and 22 AMX-BF16), the OS saving their state (XCR0 bits 17 XTILECFG and 18 XTILEDATA),
// and, on Linux, the process's permission: without arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA) the first tile instruction is a SIGILL. Asked once; the permission, once
// granted, holds for every thread of the process.
std::string amx_missing() {
#if defined(__x86_64__) && defined(PAGED_CPU_HAVE_AMX)
  static const std::string why = []() -> std::string {
    if (!has_avx512_bf16()) return "this CPU has no AVX-512 BF16 (the amx build's other kernels use it)";
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
      return "this CPU has no AMX-TILE + AMX-BF16 (CPUID)";
    uint32_t xcr0_lo = 0, xcr0_hi = 0;  // XGETBV runs: the AVX-512 check above includes OSXSAVE
    asm volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & (3u << 17)) != (3u << 17)) return "the OS has not enabled the AMX tile state (XCR0 bits 17, 18)";
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, Linux >= 5.16
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("Linux refused the AMX tile permission (arch_prctl(ARCH_REQ_XCOMP_PERM, "
                         "XFEATURE_XTILEDATA): ") + std::strerror(errno) + ")";
    return "";
  }();
  return why;
#else
  return "not an x86-64 build with AMX";
#endif
}
bool has_amx() { return amx_missing().empty(); }
bool always() { return true; }
bool never() { return false; }

// In the order of preference, worst first: the best usable one is the default. amx_emulated (the
// AMX kernels on a scalar model of the tiles, for tests) is the least preferred: portable, which
// always runs, is always chosen over it.
constexpr size_t kNumIsas = 6;
const std::array<Isa, kNumIsas>& isas() {
  static const std::array<Isa, kNumIsas> table = {{
#if defined(PAGED_CPU_HAVE_AMX_EMULATED)
      {"amx_emulated", &isa_amx_emulated::kernels, &has_avx512_bf16},
#else
      {"amx_emulated", nullptr, &never},
#endif
      {"portable", &isa_portable::kernels, &always},
#if defined(PAGED_CPU_HAVE_AVX2)
      {"avx2", &isa_avx2::kernels, &has_avx2},
#else
      {"avx2", nullptr, &never},
#endif
#if defined(PAGED_CPU_HAVE_AVX512)
      {"avx512", &isa_avx512::kernels, &has_avx512},
#else
      {"avx512", nullptr, &never},
#endif
#if defined(PAGED_CPU_HAVE_AVX512_BF16)
      {"avx512_bf16", &isa_avx512_bf16::kernels, &has_avx512_bf16},
#else
      {"avx512_bf16", nullptr, &never},
#endif
#if defined(PAGED_CPU_HAVE_AMX)
      {"amx", &isa_amx::kernels, &has_amx, &amx_missing},
#else
      {"amx", nullptr, &never},
#endif
  }};
  return table;
}

bool usable(const Isa& isa) { return isa.kernels != nullptr && isa.runs_here(); }

std::string join_names(bool only_usable) {
  std::string names;
  for (const Isa& isa : isas())
    if (!only_usable || usable(isa)) names += (names.empty() ? "" : ", ") + std::string(isa.name);
  return names;
}

struct Active {
  const char* name;
  IsaKernels kernels;
  CacheLaunchers cache;  // its reshape_and_cache and fp8 conversions, and the one copy_blocks
};

// One Active per ISA, made once. Only the usable builds' kernels() is called: it is compiled with
// its ISA's flags and may itself use that ISA's instructions.
const Active& build(const Isa& isa) {
  static const std::array<Active, kNumIsas> made = [] {
    std::array<Active, kNumIsas> a{};
    for (size_t i = 0; i < a.size(); ++i) {
      a[i].name = isas()[i].name;
      if (!usable(isas()[i])) continue;
      a[i].kernels = isas()[i].kernels();
      a[i].cache = {a[i].kernels.reshape_and_cache, a[i].kernels.quantize_fp8, a[i].kernels.dequantize_fp8,
                    &copy_blocks};
    }
    return a;
  }();
  return made[size_t(&isa - isas().data())];
}

// `name` as an error message shows it: an environment variable can hold any bytes, of any length.
// The first 64 bytes, those outside printable ASCII as \xNN (the message must stay valid UTF-8
// for Python), then "..." and the length.
std::string shown(const std::string& name) {
  constexpr size_t kMax = 64;
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < name.size() && i < kMax; ++i) {
    const unsigned char ch = static_cast<unsigned char>(name[i]);
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
      out += char(ch);
    } else {
      out += "\\x";
      out += hex[ch >> 4];
      out += hex[ch & 15];
    }
  }
  if (name.size() > kMax) out += "... (" + std::to_string(name.size()) + " bytes)";
  return out;
}

const Active& find(const std::string& name, const char* what) {
  for (const Isa& isa : isas()) {
    if (name != isa.name) continue;
    TORCH_CHECK_VALUE(isa.kernels != nullptr, what, "='", name, "': this build of paged_ops has no ", name,
                      " kernels; supported on this machine: ", join_names(true));
    TORCH_CHECK_VALUE(isa.runs_here(), what, "='", name, "': ",
                      isa.why_not ? isa.why_not() : "this CPU does not support " + name,
                      "; supported on this machine: ", join_names(true));
    return build(isa);
  }
  TORCH_CHECK_VALUE(false, what, "='", shown(name), "' is not a CPU ISA; valid: ", join_names(false),
                    " (supported on this machine: ", join_names(true), ")");
}

const Active& best() {
  const Isa* chosen = &isas()[0];
  for (const Isa& isa : isas())
    if (usable(isa)) chosen = &isa;
  return build(*chosen);
}

std::atomic<const Active*> g_active{nullptr};

// Throws (ValueError) on every call while PAGED_OPS_CPU_ISA names an unknown or unsupported ISA.
const Active& active() {
  const Active* a = g_active.load(std::memory_order_acquire);
  if (a == nullptr) {
    const char* env = std::getenv("PAGED_OPS_CPU_ISA");
    const Active* chosen = (env != nullptr && *env != '\0') ? &find(env, "PAGED_OPS_CPU_ISA") : &best();
    g_active.compare_exchange_strong(a, chosen, std::memory_order_acq_rel);  // a set_isa may have won
    a = g_active.load(std::memory_order_acquire);
  }
  return *a;
}

std::string isa() {
  active();
  return g_active.load(std::memory_order_acquire)->name;
}

// Makes `name` the active ISA and returns the one it replaces.
std::string set_isa(const std::string& name) {
  const std::string previous = isa();
  g_active.store(&find(name, "isa"), std::memory_order_release);
  return previous;
}

std::vector<std::string> supported_isas() {  // worst first; the last is what isa() starts as
  std::vector<std::string> names;
  for (const Isa& isa : isas())
    if (usable(isa)) names.emplace_back(isa.name);
  return names;
}

void copy_bytes(void* dst, const void* src, size_t bytes, Stream) { std::memcpy(dst, src, bytes); }
const MergeLauncher kMerge = &merge_attention_states;
const MergeStatesLauncher kMergeStates = &merge_states;

}  // namespace

struct Backend {
  using Guard = registration::NoGuard;
  static binding::Target target(const at::Device&) {
    const Active& a = active();
    return {nullptr, nullptr, a.kernels.attention, &a.cache, &kMerge, &kMergeStates, nullptr, 0, copy_bytes, nullptr,
            /*int32_sizes=*/false};
  }
};

}  // namespace paged::cpu

PAGED_OPS_REGISTER_BACKEND(paged_cpu, CPU, paged::cpu::Backend)

// The ISA controls: isa() is the active one, supported_isas() those this machine runs (worst
// first), set_isa(name) switches and returns the previous one (ValueError for an unknown or
// unsupported name, listing the supported ones).
TORCH_LIBRARY_FRAGMENT(paged_cpu, m) {
  m.def("isa() -> str", &paged::cpu::isa);
  m.def("supported_isas() -> str[]", &paged::cpu::supported_isas);
  m.def("set_isa(str name) -> str", &paged::cpu::set_isa);
#if defined(PAGED_CPU_HAVE_AMX_EMULATED)
  // The AMX model's test hooks (csrc/cpu/kernels/amx_emulated_probe.cpp, tests/test_cpu_amx.py).
  m.def("amx_emulated_fault(str case) -> str", &paged::cpu::isa_amx_emulated::amx_emulated_fault_case);
  m.def("amx_emulated_tdpbf16ps(Tensor c, Tensor a, Tensor b) -> Tensor",
        &paged::cpu::isa_amx_emulated::amx_emulated_tdpbf16ps);
  m.def("amx_emulated_disturb(str how) -> ()", &paged::cpu::isa_amx_emulated::amx_emulated_disturb);
  m.def("amx_emulated_dot_count() -> int", &paged::cpu::isa_amx_emulated::amx_emulated_dot_count);
#endif
}

// cuda_emu.h — run the header-only CUDA kernels of csrc/kernels/*.cuh on the CPU.
//
// Include this header *instead of* compiling with nvcc; then include the .cuh files. It gives the
// subset of the CUDA programming model the kernels use, with CUDA's semantics:
//
//  * a grid of blocks; blocks run one after another on an OS thread, and on several OS threads
//    in parallel through OpenMP (CUDA_EMU_SEQUENTIAL=1 in the environment forces one thread);
//  * the threads of a block are fibers (user-level contexts with their own stack) that run on one
//    OS thread and switch only at synchronisation points (__syncthreads, __syncwarp, warp
//    shuffles and votes). A 128-thread block costs 128 stack switches per barrier, never 128 OS
//    threads; stacks are pooled per OS thread and reused across blocks and launches;
//  * `__shared__` inside a kernel becomes `static thread_local`: a block runs start to finish on
//    one OS thread before that thread starts another block, so thread-local storage is exactly
//    per-block storage (uninitialised at block start, as on a GPU);
//  * dynamic shared memory: kernels obtain it with PAGED_DYNAMIC_SMEM(T, name, count), which
//    checks count * sizeof(T) against the bytes the launch requested (throws if larger); the
//    buffer is filled with 0xFF bytes (NaN for floats) at every block start so a kernel that
//    relies on zeroed shared memory fails its tests;
//  * warp shuffles / votes exchange values among the 32 lanes of a warp (lane = linear thread id
//    % 32) through a per-warp buffer; each is a warp barrier over the lanes in `mask`;
//  * atomics are real atomics (blocks can run on different OS threads).
//
// Everything the GPU would report as a hang, a trap or a launch error is a C++ exception
// (cuda_emu::Error, a std::runtime_error) thrown from launch(): torch turns it into a Python
// RuntimeError. Checked: a barrier that not every thread of the block reaches (a thread exits
// while others wait, or threads wait at different barriers forever), a shuffle whose mask names
// a lane that never arrives or lanes that disagree on the mask, dynamic shared memory over the
// launch's size or over the per-block limit, invalid launch dimensions.
//
// Not modelled: static __shared__ usage against the shared-memory limit, memory-model races
// between threads of a block that are not separated by a barrier (fibers run in program order
// until they block, so such races are hidden, not detected), warp-synchronous code that relies
// on implicit lock-step execution without __syncwarp.
//
// Tensor cores: see `paged_mma` in csrc/kernels/mma.cuh, which has an emulated path built on the
// warp exchange below.
#pragma once

#include <driver_types.h>  // cudaStream_t, cudaError_t (plain C types; no cudart needed)
#include <vector_types.h>  // dim3, float4, int4, uint4, uint2 (host versions)
#include <vector_functions.h>  // make_uint3, make_float4, ...
#include <cuda_bf16.h>     // __nv_bfloat16 conversions are host-callable
#include <cuda_fp16.h>     // __half conversions are host-callable
#include <cuda_fp8.h>      // __nv_cvt_float_to_fp8 etc. are host-callable (software path)

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#define PAGED_EMU 1

// Execution-space qualifiers mean nothing on the host. __shared__: see the header comment.
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __forceinline__
#undef __launch_bounds__
#undef __restrict__
#define __global__
#define __device__
#define __host__
#define __constant__ static
#define __shared__ static thread_local
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict

namespace cuda_emu {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// sm_90 limits (what the kernels will meet on an H100/H200).
constexpr size_t kMaxDynamicSmemPerBlock = 227 * 1024;  // 228 KB per SM, 1 KB reserved per block
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr unsigned kMaxGridDimX = 2147483647u;
constexpr unsigned kMaxGridDimYZ = 65535u;

namespace detail {

// ----------------------------------------------------------------------------------------------
// Context switch. x86-64 SysV: save the callee-saved registers, mxcsr and the x87 control word on
// the current stack, store the stack pointer, load the other one and pop the same. Much cheaper
// than swapcontext, which makes a sigprocmask system call on every switch.
// ----------------------------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" inline __attribute__((naked, noinline, used)) void cuda_emu_switch_stack(void** /*save_sp*/,
                                                                                   void* /*load_sp*/) {
  __asm__ volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#else
#error "cuda_emu: only x86-64 has a context switch implementation"
#endif

struct BlockRun;

enum class FiberState : uint8_t { Runnable, WaitBlock, WaitWarp, Done };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address
  uint3 tid{};
  unsigned linear = 0;
  FiberState state = FiberState::Runnable;
};

constexpr size_t kMaxGatherBytes = 64;

struct Warp {
  unsigned expected = 0;  // mask of lanes taking part in the current exchange
  unsigned arrived = 0;
  unsigned existing = 0;  // lanes that exist in this warp (a partial last warp has fewer)
  unsigned done = 0;      // lanes that have exited
  int phase = 0;
  uint64_t buf[2][32];
  unsigned char big[2][32][kMaxGatherBytes];  // warp_allgather payloads (tensor-core fragments)
};

constexpr size_t kStackSize = 256 * 1024;

// Per-OS-thread execution state: the fiber pool and the block being run.
struct Worker {
  std::vector<char*> stacks;  // mmapped, guard page below each
  std::vector<char> dyn_smem;
  void* sched_sp = nullptr;
  BlockRun* block = nullptr;
  Fiber* cur = nullptr;

  ~Worker() {
    const size_t page = sysconf(_SC_PAGESIZE);
    for (char* s : stacks) munmap(s - page, kStackSize + page);
  }
  char* stack(size_t i) {
    const size_t page = sysconf(_SC_PAGESIZE);
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw Error("cuda_emu: cannot allocate a fiber stack");
      mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
      stacks.push_back(static_cast<char*>(p) + page);
    }
    return stacks[i];
  }
};

inline Worker& worker() {
  static thread_local Worker w;
  return w;
}

struct BlockRun {
  dim3 grid, block;
  uint3 bidx{};
  unsigned nthreads = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  unsigned bar_arrived = 0;
  unsigned done = 0;
  char* dyn_smem = nullptr;
  size_t dyn_smem_bytes = 0;
  void (*body)(void*) = nullptr;
  void* body_ctx = nullptr;
  std::exception_ptr error;
};

inline Fiber& cur() { return *worker().cur; }
inline BlockRun& blk() { return *worker().block; }

[[noreturn]] inline void fail(const std::string& what) {
  const BlockRun& b = blk();
  const Fiber& f = cur();
  throw Error("cuda_emu: " + what + " [block (" + std::to_string(b.bidx.x) + "," + std::to_string(b.bidx.y) +
              "," + std::to_string(b.bidx.z) + "), thread (" + std::to_string(f.tid.x) + "," +
              std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) + ")]");
}

// Give the OS thread back to the scheduler until this fiber is runnable again.
inline void yield() {
  Worker& w = worker();
  Fiber* f = w.cur;
  cuda_emu_switch_stack(&f->sp, w.sched_sp);
  // The scheduler only resumes us when we are Runnable or the block was aborted.
  if (w.block->error) throw Error("cuda_emu: block aborted");  // unwinds this fiber's frames
}

inline void fiber_main() {
  Worker& w = worker();
  BlockRun& b = *w.block;
  Fiber& f = *w.cur;
  try {
    if (b.error) throw Error("cuda_emu: block aborted");  // never start a thread of a failed block
    b.body(b.body_ctx);
    // Exiting while others wait at a barrier they can never pass any more.
    if (b.bar_arrived > 0)
      fail("thread exited while " + std::to_string(b.bar_arrived) +
           " thread(s) wait at __syncthreads (barrier not reached by every thread of the block)");
    Warp& wp = b.warps[f.linear / 32];
    const unsigned bit = 1u << (f.linear % 32);
    if (wp.arrived && (wp.expected & bit))
      fail("thread exited while lanes of its warp wait for it in a shuffle/vote/__syncwarp");
    wp.done |= bit;
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  f.state = FiberState::Done;
  ++b.done;
  void* dummy;
  cuda_emu_switch_stack(&dummy, w.sched_sp);
  __builtin_trap();  // never resumed
}

// Prepare a fresh stack so that switching to it "returns" into fiber_main with the stack
// alignment of a normal call (rsp % 16 == 8 at function entry).
inline void* init_stack(char* lo) {
  uintptr_t top = reinterpret_cast<uintptr_t>(lo + kStackSize) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                               // fake return address of fiber_main
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);        // popped by `ret` (slot is 16-aligned)
  for (int i = 0; i < 6; ++i) *--sp = 0;                  // rbp rbx r12 r13 r14 r15
  uint32_t mxcsr;
  uint16_t fpcw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpcw));
  *--sp = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
  return sp;
}

inline std::string dim_str(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// Run every thread of one block to completion on the calling OS thread.
inline void run_block(BlockRun& b) {
  Worker& w = worker();
  w.block = &b;
  b.bar_arrived = 0;
  b.done = 0;
  b.error = nullptr;
  for (unsigned i = 0; i < b.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.state = FiberState::Runnable;
    f.stack = w.stack(i);
    f.sp = init_stack(f.stack);
  }
  for (size_t i = 0; i < b.warps.size(); ++i) {
    Warp& wp = b.warps[i];
    const unsigned lanes = std::min(32u, b.nthreads - unsigned(i) * 32);
    wp.existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
    wp.expected = wp.arrived = wp.done = 0;
    wp.phase = 0;
  }
  if (b.dyn_smem_bytes) std::memset(b.dyn_smem, 0xff, b.dyn_smem_bytes);

  bool aborting = false;
  while (b.done < b.nthreads) {
    bool progress = false;
    for (unsigned i = 0; i < b.nthreads; ++i) {
      Fiber& f = b.fibers[i];
      if (f.state == FiberState::Done) continue;
      if (f.state != FiberState::Runnable && !aborting) continue;
      w.cur = &f;
      cuda_emu_switch_stack(&w.sched_sp, f.sp);
      w.cur = nullptr;
      progress = true;
      if (b.error) aborting = true;  // resume every fiber once so that it unwinds and finishes
    }
    if (!progress && !aborting) {
      // Everybody left is waiting for somebody who will never come.
      unsigned at_bar = 0, at_warp = 0;
      for (unsigned i = 0; i < b.nthreads; ++i) {
        at_bar += b.fibers[i].state == FiberState::WaitBlock;
        at_warp += b.fibers[i].state == FiberState::WaitWarp;
      }
      b.error = std::make_exception_ptr(
          Error("cuda_emu: deadlock in block " + dim_str(dim3(b.bidx.x, b.bidx.y, b.bidx.z)) + ": " +
                std::to_string(at_bar) + " thread(s) wait at __syncthreads, " + std::to_string(at_warp) +
                " at a warp shuffle/vote/__syncwarp, " + std::to_string(b.done) +
                " exited (a barrier is not reached by every thread it waits for)"));
      aborting = true;
    }
  }
  w.block = nullptr;
}

// A warp-wide barrier over the lanes of `mask` (those that exist). Before arriving, each lane
// deposits its payload into the slot of the current phase through `deposit(phase, lane)`; the
// phase is returned so that the lane reads the other lanes' payloads of this very exchange. Two
// phases suffice: a lane can only deposit into a phase again after every lane has passed the
// intermediate exchange, i.e. after everybody finished reading it.
template <class Deposit>
inline int warp_barrier(unsigned mask, Deposit&& deposit) {
  BlockRun& b = blk();
  Fiber& f = cur();
  Warp& wp = b.warps[f.linear / 32];
  const unsigned lane = f.linear % 32;
  const unsigned bit = 1u << lane;
  const unsigned want = mask & wp.existing;
  if (!(mask & bit)) fail("warp shuffle/vote/__syncwarp called by a lane that is not in its mask");
  if (want & wp.done) fail("warp shuffle/vote/__syncwarp mask names a lane that has exited");
  if (wp.arrived == 0) {
    wp.expected = want;
  } else if (wp.expected != want) {
    fail("lanes of a warp disagree on the mask of a shuffle/vote/__syncwarp");
  }
  const int phase = wp.phase;
  deposit(phase, lane);
  wp.arrived |= bit;
  if (wp.arrived == wp.expected) {
    wp.arrived = 0;
    wp.phase ^= 1;
    const unsigned base = (f.linear / 32) * 32;
    for (unsigned l = 0; l < 32; ++l)
      if ((want >> l) & 1u) b.fibers[base + l].state = FiberState::Runnable;
  } else {
    f.state = FiberState::WaitWarp;
    yield();
  }
  return phase;
}

// Every lane of `mask` deposits `v` and gets the 32 slots of this exchange.
inline const uint64_t* warp_exchange(unsigned mask, uint64_t v) {
  Warp& wp = blk().warps[cur().linear / 32];
  const int phase = warp_barrier(mask, [&](int ph, unsigned lane) { wp.buf[ph][lane] = v; });
  return wp.buf[phase];
}

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type over 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

inline unsigned lane_id() { return cur().linear % 32; }

template <typename T>
inline T shfl_from(unsigned mask, T v, unsigned src, bool valid) {
  const uint64_t* slots = warp_exchange(mask, to_bits(v));
  const unsigned present = mask & blk().warps[cur().linear / 32].existing;
  if (!valid || src >= 32 || !((present >> src) & 1u)) return v;  // undefined on a GPU; keep our own value
  return from_bits<T>(slots[src]);
}

// Launch plumbing ---------------------------------------------------------------------------------

inline void check_launch(dim3 grid, dim3 block, size_t smem) {
  auto bad = [&](const std::string& why) {
    throw Error("cuda_emu: invalid launch (grid " + dim_str(grid) + ", block " + dim_str(block) +
                ", dynamic smem " + std::to_string(smem) + " B): " + why);
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) bad("a grid dimension is 0");
  if (block.x == 0 || block.y == 0 || block.z == 0) bad("a block dimension is 0");
  if (grid.x > kMaxGridDimX || grid.y > kMaxGridDimYZ || grid.z > kMaxGridDimYZ) bad("grid dimension over the limit");
  if (block.x > kMaxThreadsPerBlock || block.y > kMaxThreadsPerBlock || block.z > kMaxBlockDimZ)
    bad("block dimension over the limit");
  if (uint64_t(block.x) * block.y * block.z > kMaxThreadsPerBlock) bad("more than 1024 threads per block");
  if (smem > kMaxDynamicSmemPerBlock) bad("dynamic shared memory over the 227 KB per-block limit");
}

}  // namespace detail

// Number of OS threads used for the blocks of one launch (1 = sequential).
inline int max_workers() {
  const char* s = std::getenv("CUDA_EMU_SEQUENTIAL");
  if (s && s[0] == '1') return 1;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// kernel<<<grid, block, smem>>>(args...) on the CPU. Synchronous; throws cuda_emu::Error.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  detail::check_launch(grid, block, smem);
  using Tuple = std::tuple<std::decay_t<KArgs>...>;
  Tuple params(std::forward<Args>(args)...);
  struct Ctx {
    void (*kernel)(KArgs...);
    Tuple* params;
  } ctx{kernel, &params};
  auto body = [](void* p) {
    Ctx* c = static_cast<Ctx*>(p);
    std::apply(c->kernel, *c->params);
  };

  const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
  const unsigned nthreads = block.x * block.y * block.z;
  std::exception_ptr first_error;
  std::atomic<bool> failed{false};

  auto run_range = [&](int64_t i) {
    detail::Worker& w = detail::worker();
    (void)w;
    static thread_local detail::BlockRun b;
    b.grid = grid;
    b.block = block;
    b.nthreads = nthreads;
    b.fibers.resize(nthreads);
    b.warps.resize((nthreads + 31) / 32);
    for (unsigned t = 0; t < nthreads; ++t) {
      detail::Fiber& f = b.fibers[t];
      f.linear = t;
      f.tid = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    }
    if (w.dyn_smem.size() < smem + 16) w.dyn_smem.resize(smem + 16);
    b.dyn_smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(w.dyn_smem.data()) + 15) & ~uintptr_t(15));
    b.dyn_smem_bytes = smem;
    b.body = body;
    b.body_ctx = &ctx;
    b.bidx = make_uint3(unsigned(i % grid.x), unsigned((i / grid.x) % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y)));
    detail::run_block(b);
    return b.error;
  };

  const int workers = nblocks > 1 ? max_workers() : 1;
  if (workers <= 1) {
    for (uint64_t i = 0; i < nblocks; ++i) {
      std::exception_ptr e = run_range(int64_t(i));
      if (e) std::rethrow_exception(e);
    }
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers)
  for (int64_t i = 0; i < int64_t(nblocks); ++i) {
    if (failed.load(std::memory_order_relaxed)) continue;
    std::exception_ptr e;
    try {
      e = run_range(i);
    } catch (...) {
      e = std::current_exception();
    }
    if (e && !failed.exchange(true)) first_error = e;
  }
  if (first_error) std::rethrow_exception(first_error);
}

// Warp-collective helper for emulating warp-wide instructions (mma.sync): every lane of `mask`
// contributes `bytes` (<= 64) bytes; returns a pointer to 32 consecutive 64-byte slots, slot l
// holding lane l's contribution, valid until this lane's next-but-one warp exchange.
inline const unsigned char* warp_allgather(unsigned mask, const void* mine, size_t bytes) {
  if (bytes > detail::kMaxGatherBytes) throw Error("cuda_emu: warp_allgather payload over 64 bytes");
  detail::Warp& wp = detail::blk().warps[detail::cur().linear / 32];
  const int phase =
      detail::warp_barrier(mask, [&](int ph, unsigned lane) { std::memcpy(wp.big[ph][lane], mine, bytes); });
  return &wp.big[phase][0][0];
}
inline unsigned lane_id() { return detail::cur().linear % 32; }

// Load accounting for tests: while a watch is on, the kernels' global-load helpers (load8,
// copy_async in kernels/common.cuh) add the bytes they read from the watched address ranges. It is
// how tests prove how often a kernel reads each KV-cache byte; loads that bypass the helpers are
// not seen, so the count is a lower bound of what a kernel reads.
struct LoadWatch {
  std::atomic<bool> on{false};
  std::atomic<uintptr_t> lo[2]{}, hi[2]{};
  std::atomic<uint64_t> bytes{0};
};
inline LoadWatch& load_watch() {
  static LoadWatch w;
  return w;
}
inline void note_load(const void* p, size_t n) {
  LoadWatch& w = load_watch();
  if (!w.on.load(std::memory_order_relaxed)) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (int i = 0; i < 2; ++i) {
    if (a >= w.lo[i].load(std::memory_order_relaxed) && a < w.hi[i].load(std::memory_order_relaxed)) {
      w.bytes.fetch_add(n, std::memory_order_relaxed);
      return;
    }
  }
}

// Dynamic shared memory of the running block, checked against what the launch asked for.
template <typename T>
inline T* dynamic_smem(size_t count) {
  detail::BlockRun& b = detail::blk();
  if (count * sizeof(T) > b.dyn_smem_bytes)
    detail::fail("kernel uses " + std::to_string(count * sizeof(T)) + " B of dynamic shared memory, launch gave " +
                 std::to_string(b.dyn_smem_bytes) + " B");
  return reinterpret_cast<T*>(b.dyn_smem);
}

}  // namespace cuda_emu

// ---- The CUDA built-ins, as the kernels see them --------------------------------------------------
#define threadIdx (::cuda_emu::detail::cur().tid)
#define blockIdx (::cuda_emu::detail::blk().bidx)
#define blockDim (::cuda_emu::detail::blk().block)
#define gridDim (::cuda_emu::detail::blk().grid)
constexpr int warpSize = 32;

inline void __syncthreads() {
  using namespace cuda_emu::detail;
  BlockRun& b = blk();
  Fiber& f = cur();
  if (b.done > 0)
    fail("__syncthreads reached after " + std::to_string(b.done) +
         " thread(s) of the block exited (barrier not reached by every thread)");
  if (++b.bar_arrived == b.nthreads) {
    b.bar_arrived = 0;
    for (Fiber& o : b.fibers)
      if (o.state == FiberState::WaitBlock) o.state = FiberState::Runnable;
  } else {
    f.state = FiberState::WaitBlock;
    yield();
  }
}

inline void __syncwarp(unsigned mask = 0xffffffffu) { cuda_emu::detail::warp_exchange(mask, 0); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() {}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const unsigned lane = cuda_emu::detail::lane_id();
  const unsigned s = (lane / width) * width + (unsigned(src) % width);
  return cuda_emu::detail::shfl_from(mask, v, s, true);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const unsigned lane = cuda_emu::detail::lane_id();
  const unsigned s = lane ^ unsigned(lane_mask);
  // CUDA: a lane reading from a later group of `width` lanes gets its own value.
  return cuda_emu::detail::shfl_from(mask, v, s, s < (lane / width + 1) * width && s < 32);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = cuda_emu::detail::lane_id();
  const unsigned s = lane + delta;
  return cuda_emu::detail::shfl_from(mask, v, s, s < (lane / width + 1) * width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const unsigned lane = cuda_emu::detail::lane_id();
  const bool ok = lane >= delta && (lane - delta) >= (lane / width) * width;
  return cuda_emu::detail::shfl_from(mask, v, ok ? lane - delta : lane, ok);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t* s = cuda_emu::detail::warp_exchange(mask, pred != 0);
  const unsigned want = mask & cuda_emu::detail::blk().warps[cuda_emu::detail::cur().linear / 32].existing;
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if (((want >> l) & 1u) && s[l]) r |= 1u << l;
  return r;
}
inline int __all_sync(unsigned mask, int pred) {
  const unsigned want = mask & cuda_emu::detail::blk().warps[cuda_emu::detail::cur().linear / 32].existing;
  return __ballot_sync(mask, pred) == want;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }

// Atomics: GCC builtins, so they are atomic across the OpenMP threads running blocks.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED), nw;
  do {
    float f;
    std::memcpy(&f, &old, 4);
    f += v;
    std::memcpy(&nw, &f, 4);
  } while (!__atomic_compare_exchange_n(u, &old, nw, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  float f;
  std::memcpy(&f, &old, 4);
  return f;
}
inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline int atomicMin(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline int atomicCAS(int* p, int cmp, int v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

// Device math intrinsics used by the kernels, with IEEE host equivalents.
inline float __expf(float x) { return std::exp(x); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's integer min/max overloads (device code calls them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }

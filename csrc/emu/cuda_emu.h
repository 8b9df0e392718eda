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
// launch's size or over the per-block limit, invalid launch dimensions, and (stricter than x86,
// as strict as the GPU, each with its document in the code below):
//  * misaligned accesses: every reinterpret_cast pointer against its type's alignment (16-byte
//    vectors, float2, half2, ...), every cp.async against its size (4/8/16; .cg only 16);
//  * cp.async is asynchronous: destination NaN until the wait_group / wait_all covering its
//    commit group; exiting with copies in flight, or a barrier with uncommitted copies, fails;
//  * over 48 KB of dynamic shared memory without cudaFuncSetAttribute on that kernel, and more
//    threads than the kernel's __launch_bounds__ (PAGED_LAUNCH_BOUNDS_CHECK), fail at launch;
//  * fiber order: between synchronisation points the fibers of a block run in a seeded random
//    order by default (CUDA_EMU_SCHEDULE=forward|reverse|random[:seed], or set_schedule()), so a
//    missing __syncthreads changes results instead of being hidden by program order;
//  * thread-block clusters (launch_cluster, sm_90): a grid of whole clusters of at most 8 blocks (16
//    with the kernel's non-portable attribute); a cluster's blocks run at once on their own OS
//    threads, one turn each between cluster barriers in the schedule's order (ClusterRun);
//    map_shared_rank only into dynamic shared memory, only after the first barrier.cluster and
//    only into a block that has not exited (whose shared memory turns to NaN when it exits); every
//    thread of every block reaches every cluster barrier (the hardware releases it for exited
//    threads: stricter).
//
// Not modelled: static __shared__ usage against the shared-memory limit, static __shared__ is
// not poisoned between blocks (dynamic shared memory is), races between two accesses of the same
// segment between synchronisation points (a fiber runs its segment without interleaving),
// warp-synchronous code that relies on implicit lock-step execution without __syncwarp.
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
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
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
struct ClusterRun;

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class FiberState : uint8_t { Runnable, WaitBlock, WaitWarp, WaitCluster, Done };

// One cp.async in flight: the source bytes read at issue, written to `dst` when a
// cp.async.wait_group / wait_all of this thread covers its commit group.
struct PendingCopy {
  char* dst;
  int bytes;
  int group;  // index of the commit group it belongs to (== Fiber::committed while uncommitted)
  unsigned char data[16];
};

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address
  uint3 tid{};
  unsigned linear = 0;
  FiberState state = FiberState::Runnable;
  std::vector<PendingCopy> copies;  // this thread's cp.async copies not yet waited for, in issue order
  int committed = 0;                // cp.async.commit_group count of this thread
};

// Order in which the fibers of a block run between synchronisation points. A GPU gives no order
// at all; running them in reverse or in a seeded random order makes a missing barrier (a read of
// shared memory another thread has not written yet, or overwrites before everybody read) change
// the results instead of being hidden by program order.
enum class Schedule : int { Forward = 0, Reverse = 1, Random = 2 };

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
  // __syncthreads_or/_count/_and: the predicates counted by the threads at the current barrier,
  // and the count of the last completed one (read by each thread after the barrier releases it;
  // no thread can complete the next barrier before every thread has read it).
  unsigned bar_count = 0, bar_result = 0;
  unsigned done = 0;
  char* dyn_smem = nullptr;
  size_t dyn_smem_bytes = 0;
  void (*body)(void*) = nullptr;
  void* body_ctx = nullptr;
  std::exception_ptr error;
  Schedule schedule = Schedule::Random;
  uint64_t seed = 0;
  std::vector<unsigned> order;       // forward / reverse: fiber indices in the order they run
  std::vector<unsigned> warp_order;  // random: warp indices, reshuffled every scheduling pass
  // Thread-block cluster (launch_cluster): the cluster, this block's rank in it (%cluster_ctarank),
  // and the threads of this block at the current barrier.cluster. nullptr: a launch without
  // clusters, where every block is a cluster of one (as on sm_90).
  ClusterRun* cluster = nullptr;
  unsigned cluster_rank = 0;
  unsigned cluster_arrived = 0;
};

// The blocks of one cluster run at the same time, each on its own OS thread (a block's static
// __shared__ is thread_local, so two blocks can never share one), but one at a time: a block runs
// its turn until every one of its threads waits at barrier.cluster, or it exits, then hands the
// turn on. Turns go round in the launch's schedule order (random: a fresh seeded permutation per
// round), so whether a block runs before or after another between two cluster barriers changes
// from seed to seed, and a missing barrier.cluster changes results instead of hiding.
struct ClusterRun {
  unsigned size = 1;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<char*> smem;            // each block's dynamic shared memory (map_shared_rank's targets)
  size_t smem_bytes = 0;
  std::vector<std::vector<char>> smem_store;
  std::vector<uint8_t> exited;        // a block's threads have all exited: its shared memory is gone
  unsigned waiting = 0;               // blocks whose every thread waits at the current barrier.cluster
  unsigned exited_this_round = 0;
  uint64_t barriers = 0;              // barrier.cluster completions so far
  std::vector<unsigned> order;        // the ranks taking a turn this round, in turn order
  size_t pos = 0;                     // order[pos] runs now
  Schedule schedule = Schedule::Random;
  uint64_t rng = 0;
  bool failed = false;
  std::exception_ptr first_error;

  bool my_turn(unsigned rank) const { return pos < order.size() && order[pos] == rank; }
  void new_round(const std::vector<unsigned>& live) {
    order = live;
    if (schedule == Schedule::Reverse) std::reverse(order.begin(), order.end());
    if (schedule == Schedule::Random)
      for (size_t i = order.size(); i > 1; --i) {
        rng = splitmix64(rng);
        std::swap(order[i - 1], order[size_t(rng % i)]);
      }
    pos = 0;
  }
  // The running block's turn is over (mu held): the next block's, or the round is complete. Every
  // block still running has then arrived at barrier.cluster: it completes, unless a block exited
  // in this round while the others wait for it (the hardware releases the barrier for exited
  // threads, PTX ISA `exit`; here, as for __syncthreads, it is an error: the kernels' cluster code
  // has every block reach every barrier).
  void end_turn() {
    if (++pos < order.size() || failed) return;
    if (waiting == 0) return;  // every block has exited
    if (exited_this_round > 0) {
      failed = true;
      first_error = std::make_exception_ptr(Error(
          "cuda_emu: a block of a cluster exited while the others wait at barrier.cluster (every block of a "
          "cluster must reach every cluster barrier)"));
      return;
    }
    std::vector<unsigned> live;
    for (unsigned r = 0; r < size; ++r)
      if (!exited[r]) live.push_back(r);
    ++barriers;
    waiting = 0;
    exited_this_round = 0;
    new_round(live);
  }
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
    // Copies still in flight when their thread exits were never waited for: nobody can rely on
    // their data (a kernel bug even where the hardware would finish them).
    if (!f.copies.empty())
      fail("thread exited with " + std::to_string(f.copies.size()) +
           " cp.async copies it never waited for (cp.async.wait_group / wait_all missing)");
    // Exiting while others wait at a barrier they can never pass any more.
    if (b.bar_arrived > 0)
      fail("thread exited while " + std::to_string(b.bar_arrived) +
           " thread(s) wait at __syncthreads (barrier not reached by every thread of the block)");
    if (b.cluster_arrived > 0)
      fail("thread exited while " + std::to_string(b.cluster_arrived) +
           " thread(s) of its block wait at barrier.cluster (barrier not reached by every thread)");
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
  b.bar_count = b.bar_result = 0;
  b.done = 0;
  b.error = nullptr;
  for (unsigned i = 0; i < b.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.state = FiberState::Runnable;
    f.stack = w.stack(i);
    f.sp = init_stack(f.stack);
    f.copies.clear();
    f.committed = 0;
  }
  b.order.resize(b.nthreads);
  for (unsigned i = 0; i < b.nthreads; ++i)
    b.order[i] = b.schedule == Schedule::Reverse ? b.nthreads - 1 - i : i;
  // Random order: a fresh permutation every pass, from a generator seeded by (seed, block index)
  // so that a run is reproducible whatever OS thread runs the block.
  uint64_t rng = splitmix64(b.seed ^ splitmix64(uint64_t(b.bidx.x) | (uint64_t(b.bidx.y) << 32)) ^
                            (uint64_t(b.bidx.z) << 48));
  for (size_t i = 0; i < b.warps.size(); ++i) {
    Warp& wp = b.warps[i];
    const unsigned lanes = std::min(32u, b.nthreads - unsigned(i) * 32);
    wp.existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
    wp.expected = wp.arrived = wp.done = 0;
    wp.phase = 0;
  }
  if (b.dyn_smem_bytes) std::memset(b.dyn_smem, 0xff, b.dyn_smem_bytes);
  b.cluster_arrived = 0;
  if (b.cluster) {  // wait for this block's first turn
    ClusterRun& cl = *b.cluster;
    std::unique_lock<std::mutex> lock(cl.mu);
    cl.cv.wait(lock, [&] { return cl.failed || cl.my_turn(b.cluster_rank); });
    if (cl.failed) b.error = std::make_exception_ptr(Error("cuda_emu: cluster aborted (another block of it failed)"));
  }

  bool aborting = b.error != nullptr;
  auto resume = [&](unsigned i) {  // runs fiber i until it blocks or exits; false if it cannot run
    Fiber& f = b.fibers[i];
    if (f.state == FiberState::Done) return false;
    if (f.state != FiberState::Runnable && !aborting) return false;
    w.cur = &f;
    cuda_emu_switch_stack(&w.sched_sp, f.sp);
    w.cur = nullptr;
    if (b.error) aborting = true;  // resume every fiber once so that it unwinds and finishes
    return true;
  };
  const unsigned nwarps = unsigned(b.warps.size());
  b.warp_order.resize(nwarps);
  for (unsigned i = 0; i < nwarps; ++i) b.warp_order[i] = i;
  auto shuffle = [&](unsigned* v, unsigned n) {  // Fisher-Yates
    for (unsigned i = n; i > 1; --i) {
      rng = splitmix64(rng);
      std::swap(v[i - 1], v[unsigned(rng % i)]);
    }
  };
  while (b.done < b.nthreads) {
    bool progress = false;
    if (b.schedule == Schedule::Random) {
      // Warps in a random order, each run as far as it goes (to a __syncthreads, or exit) before
      // the next starts, its lanes in a random order at every warp exchange: warps drift as far
      // apart as a barrier lets them, so a missing barrier between warps (a read before another
      // warp's write, or a write over data another warp still reads) shows in either direction.
      shuffle(b.warp_order.data(), nwarps);
      for (unsigned wi : b.warp_order) {
        const unsigned base = wi * 32, lanes = std::min(32u, b.nthreads - base);
        unsigned lane_order[32];
        for (unsigned l = 0; l < lanes; ++l) lane_order[l] = base + l;
        for (bool any = true; any;) {
          any = false;
          shuffle(lane_order, lanes);
          for (unsigned l = 0; l < lanes; ++l) any |= resume(lane_order[l]);
          progress |= any;
        }
      }
    } else {
      for (unsigned k = 0; k < b.nthreads; ++k) progress |= resume(b.order[k]);
    }
    if (!progress && !aborting) {
      // Everybody left is waiting for somebody who will never come.
      unsigned at_bar = 0, at_warp = 0, at_cluster = 0;
      for (unsigned i = 0; i < b.nthreads; ++i) {
        at_bar += b.fibers[i].state == FiberState::WaitBlock;
        at_warp += b.fibers[i].state == FiberState::WaitWarp;
        at_cluster += b.fibers[i].state == FiberState::WaitCluster;
      }
      b.error = std::make_exception_ptr(
          Error("cuda_emu: deadlock in block " + dim_str(dim3(b.bidx.x, b.bidx.y, b.bidx.z)) + ": " +
                std::to_string(at_bar) + " thread(s) wait at __syncthreads, " + std::to_string(at_warp) +
                " at a warp shuffle/vote/__syncwarp, " + std::to_string(at_cluster) + " at barrier.cluster, " +
                std::to_string(b.done) +
                " exited (a barrier is not reached by every thread it waits for)"));
      aborting = true;
    }
  }
  w.block = nullptr;
  if (b.cluster) {  // the block is gone: its shared memory too (NaN to a stale remote reader)
    ClusterRun& cl = *b.cluster;
    std::lock_guard<std::mutex> lock(cl.mu);
    cl.exited[b.cluster_rank] = 1;
    ++cl.exited_this_round;
    if (b.dyn_smem_bytes) std::memset(b.dyn_smem, 0xff, b.dyn_smem_bytes);
    if (b.error && !cl.failed) {
      cl.failed = true;
      cl.first_error = b.error;
    }
    cl.end_turn();
    cl.cv.notify_all();
  }
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

// ---- Fiber schedule -------------------------------------------------------------------------------
// The order of a block's fibers between synchronisation points (detail::Schedule). Chosen at each
// launch: set_schedule() if a test set one, else CUDA_EMU_SCHEDULE=forward|reverse|random[:seed]
// from the environment, else random with seed 0 (so every test runs in a non-program order).
namespace detail {
struct ScheduleOverride {
  std::atomic<int> mode{-1};  // -1: none, else a Schedule
  std::atomic<uint64_t> seed{0};
};
inline ScheduleOverride& schedule_override() {
  static ScheduleOverride o;
  return o;
}
inline std::pair<Schedule, uint64_t> parse_schedule(const std::string& s) {
  const size_t colon = s.find(':');
  const std::string mode = s.substr(0, colon);
  uint64_t seed = 0;
  if (colon != std::string::npos) seed = std::strtoull(s.c_str() + colon + 1, nullptr, 10);
  if (mode == "forward") return {Schedule::Forward, seed};
  if (mode == "reverse") return {Schedule::Reverse, seed};
  if (mode == "random") return {Schedule::Random, seed};
  throw Error("cuda_emu: schedule '" + s + "' is not forward, reverse or random[:seed]");
}
inline std::pair<Schedule, uint64_t> current_schedule() {
  ScheduleOverride& o = schedule_override();
  const int m = o.mode.load();
  if (m >= 0) return {Schedule(m), o.seed.load()};
  const char* env = std::getenv("CUDA_EMU_SCHEDULE");
  if (env && env[0]) return parse_schedule(env);
  return {Schedule::Random, 0};
}
}  // namespace detail

// Force a schedule for the following launches ("forward", "reverse", "random[:seed]"); an empty
// string goes back to CUDA_EMU_SCHEDULE / the default.
inline void set_schedule(const std::string& s) {
  detail::ScheduleOverride& o = detail::schedule_override();
  if (s.empty()) {
    o.mode = -1;
    return;
  }
  const std::pair<detail::Schedule, uint64_t> p = detail::parse_schedule(s);
  o.seed = p.second;
  o.mode = int(p.first);
}

// ---- Per-kernel attributes ----------------------------------------------------------------------
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): a launch with
// more than 48 KB of dynamic shared memory fails on a GPU unless this attribute of that very
// kernel (template instance) allows it; the emulator records the attribute per kernel pointer and
// rejects such launches the same way.
constexpr size_t kDefaultMaxDynamicSmem = 48 * 1024;
namespace detail {
struct FuncAttributes {
  std::mutex mu;
  std::unordered_map<const void*, size_t> max_dynamic_smem;
  std::unordered_map<const void*, bool> non_portable_cluster;
};
inline FuncAttributes& func_attributes() {
  static FuncAttributes a;
  return a;
}
inline size_t max_dynamic_smem_of(const void* kernel) {
  FuncAttributes& a = func_attributes();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.max_dynamic_smem.find(kernel);
  return it == a.max_dynamic_smem.end() ? kDefaultMaxDynamicSmem : it->second;
}
}  // namespace detail

template <typename... KArgs>
inline cudaError_t func_set_max_dynamic_smem(void (*kernel)(KArgs...), int bytes) {
  if (bytes < 0 || size_t(bytes) > kMaxDynamicSmemPerBlock) return cudaErrorInvalidValue;
  detail::FuncAttributes& a = detail::func_attributes();
  std::lock_guard<std::mutex> lock(a.mu);
  a.max_dynamic_smem[reinterpret_cast<const void*>(kernel)] = size_t(bytes);
  return cudaSuccess;
}
// cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1): clusters of
// more than 8 blocks (the portable size), up to 16 on sm_90, only for a kernel that allows them
// (CUDA C++ Programming Guide, thread block clusters).
template <typename... KArgs>
inline cudaError_t func_set_non_portable_cluster_size_allowed(void (*kernel)(KArgs...), bool allowed) {
  detail::FuncAttributes& a = detail::func_attributes();
  std::lock_guard<std::mutex> lock(a.mu);
  a.non_portable_cluster[reinterpret_cast<const void*>(kernel)] = allowed;
  return cudaSuccess;
}
constexpr unsigned kMaxPortableClusterSize = 8, kMaxClusterSize = 16;
namespace detail {
inline bool non_portable_cluster_of(const void* kernel) {
  FuncAttributes& a = func_attributes();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.non_portable_cluster.find(kernel);
  return it != a.non_portable_cluster.end() && it->second;
}
}  // namespace detail
// Forget every recorded attribute (tests).
inline void reset_func_attributes() {
  detail::FuncAttributes& a = detail::func_attributes();
  std::lock_guard<std::mutex> lock(a.mu);
  a.max_dynamic_smem.clear();
  a.non_portable_cluster.clear();
}

// ---- Device memory the host cannot read ----------------------------------------------------------
// On a GPU the host cannot read a CUDA tensor without a copy and a sync (and not at all inside a CUDA
// graph); on the emulator every "device" tensor is host memory. A test registers page-aligned regions
// as device memory and closes them (PROT_NONE): from then on only kernels (launch() opens them while
// blocks run) and device copies (device_copy) touch them, so a host read on an op's path is a SIGSEGV
// instead of passing unnoticed.
namespace detail {
struct DeviceRegions {
  std::mutex mu;
  std::vector<std::pair<void*, size_t>> regions;  // page-aligned [begin, begin + bytes)
  std::atomic<bool> any{false};                   // launches skip the lock while none is registered
  bool closed = false;                            // PROT_NONE outside kernels and device copies
  int open_users = 0;                             // launches and copies running now
};
inline DeviceRegions& device_regions() {
  static DeviceRegions r;
  return r;
}
inline void protect_regions(DeviceRegions& r, int prot) {  // r.mu held
  for (const auto& [begin, bytes] : r.regions)
    if (mprotect(begin, bytes, prot) != 0) throw Error("cuda_emu: mprotect of a device memory region failed");
}
// Device memory readable for the scope of one kernel launch or device copy (also when it throws).
struct DeviceMemoryOpen {
  bool counted = false;
  DeviceMemoryOpen() {
    DeviceRegions& r = device_regions();
    if (!r.any.load()) return;
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.open_users++ == 0 && r.closed) protect_regions(r, PROT_READ | PROT_WRITE);
    counted = true;
  }
  ~DeviceMemoryOpen() {
    if (!counted) return;
    DeviceRegions& r = device_regions();
    std::lock_guard<std::mutex> lock(r.mu);
    if (--r.open_users != 0 || !r.closed) return;
    for (const auto& [begin, bytes] : r.regions)  // a destructor cannot throw: a failed mprotect aborts
      if (mprotect(begin, bytes, PROT_NONE) != 0) std::abort();
  }
  DeviceMemoryOpen(const DeviceMemoryOpen&) = delete;
  DeviceMemoryOpen& operator=(const DeviceMemoryOpen&) = delete;
};
}  // namespace detail

// Register [begin, begin + bytes) (page-aligned, e.g. from mmap) as device memory; it takes the
// current protection (closed or open).
inline void register_device_region(void* begin, size_t bytes) {
  detail::DeviceRegions& r = detail::device_regions();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.closed && r.open_users == 0 && mprotect(begin, bytes, PROT_NONE) != 0)
    throw Error("cuda_emu: mprotect of a device memory region failed");
  r.regions.emplace_back(begin, bytes);
  r.any = true;
}
// Forget a region (before it is unmapped); it is left readable.
inline void unregister_device_region(void* begin) {
  detail::DeviceRegions& r = detail::device_regions();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.regions.begin(); it != r.regions.end(); ++it) {
    if (it->first != begin) continue;
    mprotect(it->first, it->second, PROT_READ | PROT_WRITE);
    r.regions.erase(it);
    break;
  }
  r.any = !r.regions.empty();
}
// closed: every region PROT_NONE except while a launch or a device copy runs; open: readable.
inline void close_device_memory(bool closed) {
  detail::DeviceRegions& r = detail::device_regions();
  std::lock_guard<std::mutex> lock(r.mu);
  r.closed = closed;
  if (r.open_users == 0) detail::protect_regions(r, closed ? PROT_NONE : PROT_READ | PROT_WRITE);
}
// Whether p lies in a registered region.
inline bool in_device_memory(const void* p) {
  detail::DeviceRegions& r = detail::device_regions();
  if (!r.any.load()) return false;
  std::lock_guard<std::mutex> lock(r.mu);
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& [begin, bytes] : r.regions)
    if (a >= reinterpret_cast<uintptr_t>(begin) && a < reinterpret_cast<uintptr_t>(begin) + bytes) return true;
  return false;
}
// cudaMemcpy on the emulator: a copy engine's read, not the host's, so it may touch device memory.
inline void device_copy(void* dst, const void* src, size_t bytes) {
  const detail::DeviceMemoryOpen open;
  std::memcpy(dst, src, bytes);
}

namespace detail {
template <typename... KArgs, typename... Args>
void launch_impl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, const dim3* cluster, Args&&... args) {
  detail::check_launch(grid, block, smem);
  if (cluster) {
    auto bad = [&](const std::string& why) {
      throw Error("cuda_emu: invalid cluster launch (grid " + detail::dim_str(grid) + ", cluster " +
                  detail::dim_str(*cluster) + "): " + why);
    };
    const uint64_t size = uint64_t(cluster->x) * cluster->y * cluster->z;
    if (size == 0) bad("a cluster dimension is 0");
    if (grid.x % cluster->x || grid.y % cluster->y || grid.z % cluster->z)
      bad("the grid is not a whole number of clusters in every dimension");
    const bool wide = detail::non_portable_cluster_of(reinterpret_cast<const void*>(kernel));
    if (size > (wide ? kMaxClusterSize : kMaxPortableClusterSize))
      bad(std::to_string(size) + " blocks a cluster, over " +
          (wide ? "16 (sm_90's limit)" : "the portable 8 (more needs cudaFuncAttributeNonPortableClusterSizeAllowed)"));
  }
  const detail::DeviceMemoryOpen device_memory_open;  // the blocks may read device memory, the host not
  const size_t smem_cap = detail::max_dynamic_smem_of(reinterpret_cast<const void*>(kernel));
  if (smem > smem_cap)
    throw Error("cuda_emu: invalid launch (grid " + detail::dim_str(grid) + ", block " + detail::dim_str(block) +
                "): " + std::to_string(smem) + " B of dynamic shared memory, over the kernel's " +
                "cudaFuncAttributeMaxDynamicSharedMemorySize of " + std::to_string(smem_cap) +
                " B (over 48 KB needs cudaFuncSetAttribute on this kernel first)");
  const std::pair<detail::Schedule, uint64_t> sched = detail::current_schedule();
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

  // A block of this launch, its threads and warps laid out, its dynamic shared memory at `dyn`.
  auto prepare = [&](detail::BlockRun& b, char* dyn) {
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
    b.dyn_smem = dyn;
    b.dyn_smem_bytes = smem;
    b.body = body;
    b.body_ctx = &ctx;
    b.schedule = sched.first;
    b.seed = sched.second;
  };
  auto run_range = [&](int64_t i) {
    detail::Worker& w = detail::worker();
    static thread_local detail::BlockRun b;
    if (w.dyn_smem.size() < smem + 16) w.dyn_smem.resize(smem + 16);
    prepare(b, reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(w.dyn_smem.data()) + 15) & ~uintptr_t(15)));
    b.bidx = make_uint3(unsigned(i % grid.x), unsigned((i / grid.x) % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y)));
    detail::run_block(b);
    return b.error;
  };

  // One cluster (cluster launches): its blocks on one OS thread each, taking turns (ClusterRun).
  auto run_cluster = [&](int64_t c) -> std::exception_ptr {
    const dim3 cd = *cluster;
    const unsigned size = cd.x * cd.y * cd.z;
    const dim3 per(grid.x / cd.x, grid.y / cd.y, grid.z / cd.z);  // clusters along each dimension
    const uint3 ci = make_uint3(unsigned(c % per.x), unsigned((c / per.x) % per.y),
                                unsigned(c / (uint64_t(per.x) * per.y)));
    detail::ClusterRun cl;
    cl.size = size;
    cl.smem_bytes = smem;
    cl.smem_store.resize(size);
    cl.smem.resize(size);
    for (unsigned r = 0; r < size; ++r) {
      cl.smem_store[r].resize(smem + 16);
      cl.smem[r] = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(cl.smem_store[r].data()) + 15) & ~uintptr_t(15));
    }
    cl.exited.assign(size, 0);
    cl.schedule = sched.first;
    cl.rng = detail::splitmix64(sched.second ^ detail::splitmix64(uint64_t(c) + 0x5eed));
    std::vector<unsigned> ranks(size);
    for (unsigned r = 0; r < size; ++r) ranks[r] = r;
    cl.new_round(ranks);
    std::vector<std::exception_ptr> errors(size);
    auto run_rank = [&](unsigned r) {
      try {
        detail::BlockRun b;
        prepare(b, cl.smem[r]);
        b.bidx = make_uint3(ci.x * cd.x + r % cd.x, ci.y * cd.y + (r / cd.x) % cd.y, ci.z * cd.z + r / (cd.x * cd.y));
        b.cluster = &cl;
        b.cluster_rank = r;
        detail::run_block(b);
        errors[r] = b.error;
      } catch (...) {
        errors[r] = std::current_exception();
        std::lock_guard<std::mutex> lock(cl.mu);
        cl.failed = true;
        cl.cv.notify_all();
      }
    };
    std::vector<std::thread> threads;
    for (unsigned r = 1; r < size; ++r) threads.emplace_back(run_rank, r);
    run_rank(0);
    for (std::thread& t : threads) t.join();
    if (cl.first_error) return cl.first_error;
    for (const std::exception_ptr& e : errors)
      if (e) return e;
    return nullptr;
  };
  const uint64_t nunits = cluster ? nblocks / (uint64_t(cluster->x) * cluster->y * cluster->z) : nblocks;
  auto run_unit = [&](int64_t i) { return cluster ? run_cluster(i) : run_range(i); };

  const int workers = nunits > 1 ? max_workers() : 1;
  if (workers <= 1) {
    for (uint64_t i = 0; i < nunits; ++i) {
      std::exception_ptr e = run_unit(int64_t(i));
      if (e) std::rethrow_exception(e);
    }
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers)
  for (int64_t i = 0; i < int64_t(nunits); ++i) {
    if (failed.load(std::memory_order_relaxed)) continue;
    std::exception_ptr e;
    try {
      e = run_unit(i);
    } catch (...) {
      e = std::current_exception();
    }
    if (e && !failed.exchange(true)) first_error = e;
  }
  if (first_error) std::rethrow_exception(first_error);
}
}  // namespace detail

// kernel<<<grid, block, smem>>>(args...) on the CPU. Synchronous; throws cuda_emu::Error.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  detail::launch_impl(kernel, grid, block, smem, nullptr, std::forward<Args>(args)...);
}
// The same in clusters of `cluster` blocks (cudaLaunchKernelEx with cudaLaunchAttributeClusterDimension):
// the grid a whole number of clusters, at most 8 blocks a cluster (16 with the kernel's
// non-portable attribute). Blocks of a cluster are cluster_ctarank x-fastest within it.
template <typename... KArgs, typename... Args>
void launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, dim3 cluster, Args&&... args) {
  detail::launch_impl(kernel, grid, block, smem, &cluster, std::forward<Args>(args)...);
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

// ---- Alignment -----------------------------------------------------------------------------------
// A GPU load or store is one instruction only for 1, 2, 4, 8 or 16 bytes at an address that is a
// multiple of its size ("naturally aligned", CUDA C++ Programming Guide, device memory accesses);
// the built-in vector types carry that alignment (float2/uint2: 8, float4/uint4/int4: 16,
// __half2/__nv_bfloat162: 4). A misaligned vector access faults ("misaligned address"); x86 just
// does it. The emulator checks every pointer a kernel makes with reinterpret_cast (see the end of
// this header) against the alignment of the type pointed to, and every cp.async.
namespace detail {
inline std::string hex_address(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}
[[noreturn]] inline void fail_anywhere(const std::string& what) {
  Worker& w = worker();
  if (w.block && w.cur) fail(what);  // inside a kernel: name block and thread
  throw Error("cuda_emu: " + what);
}
inline void check_aligned(const void* p, size_t align, size_t size, const char* what) {
  if (align > 1 && reinterpret_cast<uintptr_t>(p) % align)
    fail_anywhere(std::string("misaligned address: ") + what + " of " + std::to_string(size) + " B at " +
                  hex_address(p) + ", not a multiple of " + std::to_string(align) +
                  " (a GPU faults with cudaErrorMisalignedAddress)");
}
template <class T, class = void>
struct is_complete : std::false_type {};
template <class T>
struct is_complete<T, decltype(void(sizeof(T)))> : std::true_type {};

// reinterpret_cast<To>(v), and when To is a pointer (or reference) to an object type, a check that
// the result is aligned for that type.
template <class To, class From>
inline To strict_reinterpret_cast(From&& v) {
  To r = reinterpret_cast<To>(v);
  if constexpr (std::is_pointer<To>::value) {
    using P = std::remove_cv_t<std::remove_pointer_t<To>>;
    if constexpr (!std::is_void<P>::value && !std::is_function<P>::value && is_complete<P>::value)
      check_aligned((const void*)(r), alignof(P), sizeof(P), "access through a reinterpret_cast pointer");
  } else if constexpr (std::is_reference<To>::value) {
    using P = std::remove_cv_t<std::remove_reference_t<To>>;
    if constexpr (!std::is_function<P>::value && is_complete<P>::value)
      check_aligned((const void*)(&r), alignof(P), sizeof(P), "access through a reinterpret_cast reference");
  }
  return r;
}
}  // namespace detail

// ---- cp.async ------------------------------------------------------------------------------------
// PTX ISA, cp.async: `cp.async.ca.shared.global [dst], [src], cp-size` with cp-size 4, 8 or 16, and
// `cp.async.cg.shared.global [dst], [src], 16` (.cg takes only 16); both addresses aligned to the
// size. The copy is asynchronous: the destination is undefined until a cp.async.wait_group /
// wait_all of the issuing thread covers the copy's commit group. The emulator fills the
// destination with 0xFF bytes (NaN) at issue and writes the data at that wait, so a read before
// the wait (or by another thread before wait + barrier) sees NaN, not the data.
// src_bytes (PTX's optional src-size, -1: absent): only the first src_bytes (0 <= src_bytes <=
// cp-size) come from src, the rest of the destination is zero-filled; src is still held to the
// cp-size alignment (stricter than a GPU may be where nothing is read) and only src_bytes are read.
inline void cp_async(void* dst, const void* src, int bytes, bool cg, int src_bytes = -1) {
  using namespace detail;
  const char* op = cg ? "cp.async.cg" : "cp.async.ca";
  Worker& w = worker();
  if (!w.block || !w.cur) throw Error(std::string("cuda_emu: ") + op + " outside a kernel");
  if (bytes != 4 && bytes != 8 && bytes != 16)
    fail(std::string(op) + " of " + std::to_string(bytes) + " B: cp-size must be 4, 8 or 16");
  if (cg && bytes != 16) fail("cp.async.cg of " + std::to_string(bytes) + " B: .cg copies exactly 16 B");
  if (src_bytes < 0) src_bytes = bytes;
  if (src_bytes > bytes)
    fail(std::string(op) + " with src-size " + std::to_string(src_bytes) + " > cp-size " + std::to_string(bytes));
  check_aligned(src, size_t(bytes), size_t(bytes), (std::string(op) + " source").c_str());
  check_aligned(dst, size_t(bytes), size_t(bytes), (std::string(op) + " destination").c_str());
  Fiber& f = cur();
  PendingCopy c;
  c.dst = static_cast<char*>(dst);
  c.bytes = bytes;
  c.group = f.committed;
  std::memset(c.data, 0, sizeof(c.data));
  std::memcpy(c.data, src, size_t(src_bytes));
  f.copies.push_back(c);
  std::memset(dst, 0xff, size_t(bytes));
}
// A synchronous load + store of 1, 2, 4, 8 or 16 bytes (what a kernel does where cp.async cannot):
// both addresses aligned to the size, as for any GPU access.
inline void aligned_copy(void* dst, const void* src, int bytes) {
  if (bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8 && bytes != 16)
    detail::fail_anywhere("copy of " + std::to_string(bytes) + " B: a GPU access is 1, 2, 4, 8 or 16 B");
  detail::check_aligned(src, size_t(bytes), size_t(bytes), "load");
  detail::check_aligned(dst, size_t(bytes), size_t(bytes), "store");
  std::memcpy(dst, src, size_t(bytes));
}
// cp.async.commit_group: closes the thread's current group (an empty one too, as PTX says).
inline void cp_async_commit_group() {
  detail::Worker& w = detail::worker();
  if (!w.block || !w.cur) throw Error("cuda_emu: cp.async.commit_group outside a kernel");
  ++w.cur->committed;
}
// cp.async.wait_group n: every committed group but the n most recent is complete; copies not yet
// committed stay in flight.
inline void cp_async_wait_group(int n) {
  detail::Worker& w = detail::worker();
  if (!w.block || !w.cur) throw Error("cuda_emu: cp.async.wait_group outside a kernel");
  if (n < 0) detail::fail("cp.async.wait_group with a negative count");
  detail::Fiber& f = *w.cur;
  const int limit = f.committed - n;  // groups [0, limit) must be complete
  size_t keep = 0;
  for (size_t i = 0; i < f.copies.size(); ++i) {
    detail::PendingCopy& c = f.copies[i];
    if (c.group < limit) {
      std::memcpy(c.dst, c.data, size_t(c.bytes));
    } else {
      f.copies[keep++] = c;
    }
  }
  f.copies.resize(keep);
}
// cp.async.wait_all: commit_group followed by wait_group 0.
inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

// ---- ldmatrix ------------------------------------------------------------------------------------
// PTX ISA, "Warp-level matrix load instruction: ldmatrix", for
// ldmatrix.sync.aligned.m8n8{.x1,.x2,.x4}{.trans}.shared.b16 (the kernels' wrapper: ldmatrix in
// csrc/kernels/mma.cuh):
//  * "The mandatory .aligned qualifier indicates that all threads in the warp must execute the same
//    ldmatrix instruction." "The behavior of ldmatrix is undefined if all threads do not use the same
//    qualifiers, or if any thread in the warp has exited."
//  * "The eight addresses required for each matrix are provided by eight threads, depending upon the
//    value of .num": .x1 threads 0-7, .x2 threads 0-15, .x4 threads 0-31. "Each address corresponds
//    to the start of a matrix row. Addresses addr0-addr7 correspond to the rows of the first matrix,
//    addresses addr8-addr15 correspond to the rows of the second matrix, and so on."
//  * "When reading 8x8 matrices, a group of four consecutive threads loads 16 bytes. The matrix
//    addresses must be naturally aligned accordingly."
//  * "Each thread in a warp loads fragments of a row, with thread 0 receiving the first fragment in its
//    register r, and so on. A group of four threads loads an entire row of the matrix" (the figure
//    "ldmatrix fragment layout for one 8x8 Matrix with 16-bit elements": lane i holds row i / 4,
//    elements 2 (i % 4) and 2 (i % 4) + 1, the lower-indexed in the low half of r). "When .num = .x2,
//    the elements of the second matrix are loaded in the next destination register in each thread";
//    .x4 likewise for the third and fourth.
//  * "Optional qualifier .trans indicates that the matrix is loaded in column-major format": lane i
//    holds row i / 4 of the transposed matrix, i.e. stored elements (row 2 (i % 4), column i / 4) and
//    (row 2 (i % 4) + 1, column i / 4).
// Stricter than the hardware: every one of the 32 lanes of a full warp takes part with the same .num
// and .trans; each row address the shape uses is 16-byte aligned, and its 16 bytes lie in the block's
// dynamic shared memory (where the kernels keep every ldmatrix tile; a static __shared__ array is
// thread-local storage here that the emulator cannot tell from a stack); no byte of such a row is the
// destination of a cp.async still in flight in any thread of the block (a wait_group missing or too
// loose: the data would be undefined on a GPU). Addresses of lanes the shape does not use are ignored.
//
// Bank conflicts (counted, not failed: on a GPU they cost time, not correctness): each 8x8 matrix is
// one shared-memory access of its 8 rows of 16 bytes; the 32 banks of 4 bytes serve it in one
// wavefront when the 8 rows fall in 8 distinct 16-byte bank groups ((offset / 16) % 8, offset from
// the start of shared memory), and in k wavefronts when k distinct rows share a group. The extra
// wavefronts are added to ldmatrix_stats(), so a test proves a swizzled layout conflict-free.
struct LdmatrixStats {
  std::atomic<uint64_t> instructions{0};      // warp-wide ldmatrix instructions
  std::atomic<uint64_t> matrices{0};          // 8x8 matrices they read
  std::atomic<uint64_t> extra_wavefronts{0};  // bank-conflict wavefronts over one per matrix
};
inline LdmatrixStats& ldmatrix_stats() {
  static LdmatrixStats s;
  return s;
}
inline void reset_ldmatrix_stats() {
  LdmatrixStats& s = ldmatrix_stats();
  s.instructions = 0;
  s.matrices = 0;
  s.extra_wavefronts = 0;
}

namespace detail {
struct LdmatrixLane {
  const char* row;  // this lane's row address (used when lane < 8 * num)
  int num;          // .x1 / .x2 / .x4
  int trans;
};
inline std::string ldmatrix_name(int num, int trans) {
  return "ldmatrix.m8n8.x" + std::to_string(num) + (trans ? ".trans" : "");
}
}  // namespace detail

// r[0 .. num): this lane's fragment of each matrix; `row`: the row address this lane supplies.
inline void ldmatrix(uint32_t* r, int num, bool trans, const void* row) {
  using namespace detail;
  Worker& w = worker();
  if (!w.block || !w.cur) throw Error("cuda_emu: ldmatrix outside a kernel");
  if (num != 1 && num != 2 && num != 4) fail("ldmatrix .num must be .x1, .x2 or .x4, not " + std::to_string(num));
  BlockRun& b = blk();
  const Warp& wp = b.warps[cur().linear / 32];
  if (wp.existing != 0xffffffffu)
    fail("ldmatrix in a warp of fewer than 32 threads (.aligned: every thread of the warp executes it)");
  const LdmatrixLane mine{static_cast<const char*>(row), num, trans ? 1 : 0};
  // A lane that exited, or one that never comes, fails here (warp_barrier): ".sync".
  const unsigned char* raw = warp_allgather(0xffffffffu, &mine, sizeof(mine));
  LdmatrixLane lanes[32];
  for (unsigned l = 0; l < 32; ++l) std::memcpy(&lanes[l], raw + l * kMaxGatherBytes, sizeof(LdmatrixLane));
  const unsigned lane = detail::lane_id();
  for (unsigned l = 0; l < 32; ++l)
    if (lanes[l].num != num || lanes[l].trans != mine.trans)
      fail("ldmatrix: lanes of one warp execute different instructions (lane " + std::to_string(lane) + ": " +
           ldmatrix_name(num, mine.trans) + ", lane " + std::to_string(l) + ": " +
           ldmatrix_name(lanes[l].num, lanes[l].trans) + "; .aligned: the same qualifiers in every thread)");
  const unsigned rows = 8u * unsigned(num);
  const char* smem_lo = b.dyn_smem;
  const char* smem_hi = b.dyn_smem + b.dyn_smem_bytes;
  for (unsigned l = 0; l < rows; ++l) {
    const char* p = lanes[l].row;
    if (reinterpret_cast<uintptr_t>(p) % 16)
      fail("misaligned address: " + ldmatrix_name(num, mine.trans) + " row address of lane " + std::to_string(l) +
           " at " + hex_address(p) + ", not a multiple of 16 (rows of 16 bytes, naturally aligned)");
    if (p < smem_lo || p + 16 > smem_hi)
      fail(ldmatrix_name(num, mine.trans) + " row address of lane " + std::to_string(l) + " at " + hex_address(p) +
           " is not inside the block's dynamic shared memory (" + std::to_string(b.dyn_smem_bytes) + " B)");
  }
  if (lane == 0) {  // once per instruction: in-flight copies, bank conflicts
    for (const Fiber& f : b.fibers)
      for (const PendingCopy& c : f.copies)
        for (unsigned l = 0; l < rows; ++l)
          if (c.dst < lanes[l].row + 16 && lanes[l].row < c.dst + c.bytes)
            fail(ldmatrix_name(num, mine.trans) + " reads the row of lane " + std::to_string(l) + " at " +
                 hex_address(lanes[l].row) + " while a cp.async of thread " + std::to_string(f.linear) +
                 " into it is still in flight (cp.async.wait_group missing or too loose before the read)");
    uint64_t extra = 0;
    for (unsigned m = 0; m < unsigned(num); ++m) {
      unsigned per_group[8] = {};  // distinct row addresses per 16-byte bank group
      for (unsigned i = 0; i < 8; ++i) {
        const char* p = lanes[m * 8 + i].row;
        bool repeated = false;  // the same address twice is one broadcast read
        for (unsigned k = 0; k < i; ++k) repeated |= lanes[m * 8 + k].row == p;
        if (!repeated) ++per_group[size_t(p - smem_lo) / 16 % 8];
      }
      extra += *std::max_element(per_group, per_group + 8) - 1;
    }
    LdmatrixStats& s = ldmatrix_stats();
    s.instructions.fetch_add(1, std::memory_order_relaxed);
    s.matrices.fetch_add(uint64_t(num), std::memory_order_relaxed);
    s.extra_wavefronts.fetch_add(extra, std::memory_order_relaxed);
  }
  const unsigned g = lane / 4, t = lane % 4;
  for (unsigned m = 0; m < unsigned(num); ++m) {
    uint16_t e[2];
    for (unsigned k = 0; k < 2; ++k) {
      const char* src = trans ? lanes[m * 8 + 2 * t + k].row + 2 * g : lanes[m * 8 + g].row + 2 * (2 * t + k);
      std::memcpy(&e[k], src, 2);
    }
    r[m] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
  }
}

// ---- Thread-block clusters (sm_90) ---------------------------------------------------------------
// What the kernels see of a cluster (CUDA C++ Programming Guide, thread block clusters and
// distributed shared memory; PTX ISA: %cluster_ctarank, %cluster_nctarank, barrier.cluster,
// mapa): the block's rank, the cluster's size, the cluster barrier (arrive.release + wait.acquire:
// cooperative_groups' cluster.sync()) and the mapping of a shared-memory address to the same
// address in another block of the cluster. Stricter than a GPU: only dynamic shared memory maps
// (a kernel's static __shared__ arrays are thread_local here); mapping before the cluster's first
// barrier fails (the guide: the other blocks may not have started, a cluster.sync() first); mapping
// a block that has exited fails, and its shared memory turns to NaN for pointers mapped before
// (the guide: a block must not exit while others still access its shared memory); a thread that
// exits while its block waits at the barrier, or a block that exits while the others wait, fails.
inline unsigned cluster_ctarank() { return detail::blk().cluster_rank; }
inline unsigned cluster_nctarank() {
  const detail::BlockRun& b = detail::blk();
  return b.cluster ? b.cluster->size : 1;
}
inline void cluster_sync() {
  using namespace detail;
  BlockRun& b = blk();
  Fiber& f = cur();
  if (!f.copies.empty() && f.copies.back().group == f.committed)
    fail("barrier.cluster reached with cp.async copies not committed (cp.async.commit_group missing)");
  if (b.done > 0)
    fail("barrier.cluster reached after " + std::to_string(b.done) +
         " thread(s) of the block exited (barrier not reached by every thread)");
  if (++b.cluster_arrived < b.nthreads) {
    f.state = FiberState::WaitCluster;
    yield();
    return;
  }
  // The block's last thread: the block has arrived. Hand the turn on and wait, on this OS thread
  // (every other thread of the block waits at the barrier), until the barrier completes and the
  // block's turn comes round again.
  b.cluster_arrived = 0;
  if (b.cluster) {
    ClusterRun& cl = *b.cluster;
    std::unique_lock<std::mutex> lock(cl.mu);
    const uint64_t before = cl.barriers;
    ++cl.waiting;
    cl.end_turn();
    cl.cv.notify_all();
    cl.cv.wait(lock, [&] { return cl.failed || (cl.barriers > before && cl.my_turn(b.cluster_rank)); });
    if (cl.failed) throw Error("cuda_emu: cluster aborted (another block of it failed)");
  }
  for (Fiber& o : b.fibers)
    if (o.state == FiberState::WaitCluster) o.state = FiberState::Runnable;
}
template <typename T>
inline T* cluster_map_shared_rank(T* p, unsigned rank) {
  using namespace detail;
  BlockRun& b = blk();
  char* const c = reinterpret_cast<char*>(const_cast<std::remove_cv_t<T>*>(p));
  if (!(c >= b.dyn_smem && c < b.dyn_smem + b.dyn_smem_bytes))
    fail("map_shared_rank of an address outside this block's dynamic shared memory (the emulator maps only "
         "dynamic shared memory)");
  if (rank >= cluster_nctarank())
    fail("map_shared_rank to rank " + std::to_string(rank) + " of a cluster of " +
         std::to_string(cluster_nctarank()) + " blocks");
  if (!b.cluster) return p;
  ClusterRun& cl = *b.cluster;
  std::lock_guard<std::mutex> lock(cl.mu);
  if (cl.barriers == 0)
    fail("map_shared_rank before the cluster's first barrier.cluster: block rank " + std::to_string(rank) +
         " may not have started (cluster.sync() before distributed shared memory)");
  if (cl.exited[rank])
    fail("map_shared_rank to block rank " + std::to_string(rank) +
         ", which has exited: its shared memory is gone (a cluster.sync() before exit keeps it)");
  return reinterpret_cast<T*>(cl.smem[rank] + (c - b.dyn_smem));
}

// ---- __launch_bounds__ ---------------------------------------------------------------------------
// A launch with more threads per block than the kernel's __launch_bounds__(max_threads) fails on a
// GPU (CUDA C++ Programming Guide, launch bounds). The emulator drops the attribute itself (the
// host compiler has no such thing); kernels state the bound again with PAGED_LAUNCH_BOUNDS_CHECK
// (kernels/common.cuh) as their first statement, which lands here in every thread.
inline void check_launch_bounds(unsigned max_threads) {
  detail::BlockRun& b = detail::blk();
  if (b.nthreads > max_threads)
    throw Error("cuda_emu: invalid launch (block " + detail::dim_str(b.block) + "): " + std::to_string(b.nthreads) +
                " threads per block, over the kernel's __launch_bounds__(" + std::to_string(max_threads) +
                ") (cudaErrorLaunchOutOfResources on a GPU)");
}

}  // namespace cuda_emu

// ---- The CUDA built-ins, as the kernels see them --------------------------------------------------
#define threadIdx (::cuda_emu::detail::cur().tid)
#define blockIdx (::cuda_emu::detail::blk().bidx)
#define blockDim (::cuda_emu::detail::blk().block)
#define gridDim (::cuda_emu::detail::blk().grid)
constexpr int warpSize = 32;

// __syncthreads with a block-wide count of `pred` (CUDA's __syncthreads_count; _or and _and below):
// every thread gets the number of threads of the block whose pred was non-zero.
inline int __syncthreads_count(int pred);
inline void __syncthreads() { (void)__syncthreads_count(0); }
inline int __syncthreads_or(int pred) { return __syncthreads_count(pred) != 0; }
inline int __syncthreads_and(int pred) {
  return unsigned(__syncthreads_count(pred)) == cuda_emu::detail::blk().nthreads;
}

inline int __syncthreads_count(int pred) {
  using namespace cuda_emu::detail;
  BlockRun& b = blk();
  Fiber& f = cur();
  // Committed cp.async groups may stay in flight across a barrier (double buffering: the next
  // tile loads while this one is used), and stay NaN until their wait. Copies not even committed
  // at a barrier are stricter than the hardware's rule but always a bug in these kernels: no
  // wait_group can cover them before they are committed.
  if (!f.copies.empty() && f.copies.back().group == f.committed)
    fail("__syncthreads reached with cp.async copies not committed (cp.async.commit_group missing)");
  if (b.done > 0)
    fail("__syncthreads reached after " + std::to_string(b.done) +
         " thread(s) of the block exited (barrier not reached by every thread)");
  if (pred) ++b.bar_count;
  if (++b.bar_arrived == b.nthreads) {
    b.bar_arrived = 0;
    b.bar_result = b.bar_count;
    b.bar_count = 0;
    for (Fiber& o : b.fibers)
      if (o.state == FiberState::WaitBlock) o.state = FiberState::Runnable;
  } else {
    f.state = FiberState::WaitBlock;
    yield();
  }
  return int(b.bar_result);
}

namespace cuda_emu::detail {
// y (a normal float) moved 2 ulp in magnitude, up or down by the last bit of `by`: the emulator's
// approximate instructions are never exact, so no kernel can rely on them being so.
inline float two_ulp_off(float y, float by) {
  uint32_t bits, b;
  std::memcpy(&bits, &y, 4);
  std::memcpy(&b, &by, 4);
  bits = (b & 1u) ? bits + 2u : bits - 2u;
  float z;
  std::memcpy(&z, &bits, 4);
  return z;
}
}  // namespace cuda_emu::detail

// ex2.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: ex2"): 2^x with subnormal inputs and
// results flushed to zero, ex2(-Inf) = +0, ex2(+Inf) = +Inf, ex2(NaN) = NaN. The hardware's result
// is an approximation; here the exact value (in double) is moved 2 ulp away from it, toward 0 or
// infinity by the input's last bit (CUDA's exp2f, this instruction plus a range fix-up, is
// documented at 2 ulp), so a kernel that relies on exact powers of two fails its tests.
namespace cuda_emu {
inline float ex2_approx_ftz(float x) {
  if (std::isnan(x)) return x;
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = float(std::exp2(double(x)));
  if (y == 0.f || std::isinf(y)) return y;
  if (std::fpclassify(y) == FP_SUBNORMAL || y < std::numeric_limits<float>::min()) return 0.f;
  const float z = detail::two_ulp_off(y, x);  // y is a positive normal float
  return z < std::numeric_limits<float>::min() ? 0.f : z;
}
}  // namespace cuda_emu

// prmt.b32 d, a, b, c (PTX ISA, "Integer Instructions: prmt"), the generic form (no mode): the
// bytes of {b, a} are numbered 0-7 (a's bytes 0-3, b's 4-7); d's byte n comes from the 4-bit
// selector c[4n+3 : 4n]: its 3 low bits name the source byte, its msb asks for the sign of that byte
// (its bit 7) replicated over all 8 bits instead of the byte itself. Only c's low 16 bits are read.
namespace cuda_emu {
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
  const uint64_t src = (uint64_t(b) << 32) | a;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (c >> (4 * n)) & 0xfu;
    uint32_t byte = uint32_t(src >> (8 * (sel & 7u))) & 0xffu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0x00u;
    d |= byte << (8 * n);
  }
  return d;
}

// mul.rn.f16x2 d, a, b (PTX ISA, "Half Precision Floating-Point Instructions: mul"): each half of d
// the product of a's and b's, rounded to nearest even; without .ftz subnormal inputs and results are
// kept. A NaN operand gives a NaN whose bits the ISA leaves open: here the canonical 0x7fff, so a
// kernel that wants a NaN's sign or payload through the multiply fails its tests.
inline uint32_t mul_rn_f16x2(uint32_t a, uint32_t b) {
  uint32_t d = 0;
  for (int n = 0; n < 2; ++n) {
    __half_raw x, y;
    x.x = uint16_t(a >> (16 * n));
    y.x = uint16_t(b >> (16 * n));
    const float fx = __half2float(__half(x)), fy = __half2float(__half(y));
    // Two 11-bit significands: the float product is exact, so one rounding to half is the instruction's.
    __half_raw r = __half_raw(__float2half_rn(fx * fy));
    if (std::isnan(fx) || std::isnan(fy)) r.x = 0x7fff;
    d |= uint32_t(r.x) << (16 * n);
  }
  return d;
}
}  // namespace cuda_emu

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
// __fdividef (CUDA programming guide, "Intrinsic Functions"): for 2^126 < |b| < 2^128 it delivers
// 0 (NaN when a is infinite), elsewhere a / b within 2 ulp. Modelled stricter than the hardware:
// those cases exactly, and every other finite nonzero quotient 2 ulp off (toward 0 or infinity by
// b's last bit), so a kernel that needs the division exact fails its tests.
inline float __fdividef(float a, float b) {
  const float big = 0x1p126f;
  if (std::fabs(b) > big && std::isfinite(b))
    return std::isinf(a) ? NAN : std::copysign(0.f, a) * std::copysign(1.f, b);
  const float q = a / b;
  if (q == 0.f || !std::isfinite(q) || std::fpclassify(q) == FP_SUBNORMAL) return q;
  return cuda_emu::detail::two_ulp_off(q, b);  // q normal: stays finite or reaches inf
}
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

// Every reinterpret_cast below this point (the kernels' headers come after this one) checks the
// alignment of the pointer it makes (cuda_emu::detail::strict_reinterpret_cast). All the standard
// headers the kernels use are included above, so no library code is compiled under this macro.
#ifndef CUDA_EMU_NO_STRICT_CASTS
#define reinterpret_cast ::cuda_emu::detail::strict_reinterpret_cast
#endif

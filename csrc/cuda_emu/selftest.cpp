// Self-tests of the emulator itself, callable from Python (tests/test_cuda_emu.py):
// torch.ops.paged_cuda_emu_test.<op>. They launch tiny kernels that either compute something
// the test checks (warp shuffles, votes, atomics, barriers, shared memory) or break a rule of the
// CUDA model on purpose (the op must raise, never hang or abort).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_rules.h"

#include "emu/cuda_emu.h"  // after torch: its macros (threadIdx, __shared__, ...) must not reach torch
#define PAGED_KERNEL_NS paged_cuda_emu_selftest_impl
#include "kernels/mma.cuh"

namespace {

// Per thread t of one block of n threads, writes 9 int32 results (see warp_ops below).
__global__ void warp_ops_kernel(const int* in, int* out, unsigned* counter) {
  const int t = threadIdx.x;
  const int v = in[t];
  int* o = out + t * 9;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 1);
  o[1] = __shfl_sync(0xffffffffu, v, 3);
  o[2] = __shfl_down_sync(0xffffffffu, v, 2);
  o[3] = __shfl_up_sync(0xffffffffu, v, 5);
  o[4] = int(__ballot_sync(0xffffffffu, v % 2 == 0));
  o[5] = __all_sync(0xffffffffu, v >= 0);
  o[6] = __any_sync(0xffffffffu, v == 7);
  o[7] = __shfl_xor_sync(0xffffffffu, v, 4, 8);  // sub-warp width
  atomicAdd(counter, unsigned(v));
  // Block-level: reverse through shared memory across a barrier.
  __shared__ int s[1024];
  s[t] = v;
  __syncthreads();
  o[8] = s[blockDim.x - 1 - t];
}

// Per thread t: 4 block-wide votes over in[] (see block_votes below), back to back, so a count
// that leaked from one barrier into the next would show.
__global__ void block_votes_kernel(const int* in, int* out) {
  const int t = threadIdx.x;
  const int v = in[t];
  int* o = out + t * 4;
  o[0] = __syncthreads_or(v == 7);
  o[1] = __syncthreads_count(v % 2 == 0);
  o[2] = __syncthreads_and(v >= 0);
  o[3] = __syncthreads_or(v < 0);
}

// Blocks increment one counter: atomics across the OpenMP threads running blocks.
__global__ void atomic_kernel(int* counter, float* fsum) {
  atomicAdd(counter, 1);
  atomicAdd(fsum, 0.5f);
}

__global__ void divergent_barrier_kernel(int* x) {
  if (threadIdx.x == 5) return;  // leaves while the others wait below
  __syncthreads();
  x[threadIdx.x] = 1;
}

__global__ void different_barriers_kernel(int* x) {
  // Two barriers, each reached by half the block: deadlock on a GPU (undefined behaviour).
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    x[threadIdx.x] = 1;
  }
}

__global__ void divergent_shuffle_kernel(int* x) {
  if (threadIdx.x % 32 < 16) return;  // half the warp leaves; the full-mask shuffle waits for it
  x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

__global__ void smem_kernel(float* out, int count) {
  float* s = ::cuda_emu::dynamic_smem<float>(count);
  s[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// One warp: D = A (16x16) * B (16x8) through the fragment loaders and mma_16816, B taken once from
// a [k][n] and once from an [n][k] (transposed) shared-memory layout. out: [2, 16, 8] float.
template <typename T>
__global__ void mma_kernel(const T* A, const T* B, const T* Bt, float* out) {
  namespace k = paged_cuda_emu_selftest_impl;
  __shared__ T sa[16 * 16], sb[16 * 8], sbt[8 * 16];
  for (int i = threadIdx.x; i < 256; i += 32) sa[i] = A[i];
  for (int i = threadIdx.x; i < 128; i += 32) sb[i] = B[i], sbt[i] = Bt[i];
  __syncthreads();
  uint32_t a[4], b[2], bt[2];
  k::load_a_frag(a, sa, 16, 0, 0);
  k::load_b_frag_kn(b, sb, 8, 0, 0);
  k::load_b_frag_nk(bt, sbt, 16, 0, 0);
  float d[4] = {0, 0, 0, 0}, dt[4] = {0, 0, 0, 0};
  k::mma_16816<T>(d, a, b);
  k::mma_16816<T>(dt, a, bt);
  const int g = threadIdx.x / 4, t = threadIdx.x % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    out[row * 8 + col] = d[i];
    out[128 + row * 8 + col] = dt[i];
  }
}

// ---- mma against the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type") ----
// Registers built from the ISA's formulas, not from kernels/mma.cuh's loaders. With
// groupID = laneid >> 2 and threadID_in_group = laneid % 4, the elements of a lane, low to high
// (two 16-bit elements per .f16x2 register, the lower-numbered one in the low half):
//   A a0..a7: row = groupID for 0 <= i < 2 || 4 <= i < 6, else groupID + 8;
//             col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4
//   B b0..b3: row = threadID_in_group * 2 + (i & 1), + 8 for i >= 2; col = groupID
//   C/D c0..c3 (f32): row = groupID for i < 2, else groupID + 8; col = threadID_in_group * 2 + (i & 1)
struct PtxFrag {
  static int a_row(int lane, int i) { return (lane >> 2) + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8); }
  static int a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
  static int b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
  static int b_col(int lane, int) { return lane >> 2; }
  static int c_row(int lane, int i) { return (lane >> 2) + (i < 2 ? 0 : 8); }
  static int c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }
};

// One warp. A: [16][16], B: [16][8] (k-major), Bt: [8][16] (= B^T, n-major), all row-major T.
// out_d: [16][8] float, D = A B through the emulated mma from ISA-built registers.
// out_regs: [32][3][6] uint32: per lane the ISA registers (a0..a3, b0, b1), the kernels' loaders
// with B from [k][n] (load_b_frag_kn) and with B from [n][k] (load_b_frag_nk).
// `mutation` breaks the ISA side on purpose (the test shows the comparison then fails):
// 1 = A's element rows swapped (groupID + 8 for a0/a1), 2 = B's k halves swapped.
template <typename T>
__global__ void mma_ptx_kernel(const T* A, const T* B, const T* Bt, float* out_d, uint32_t* out_regs, int mutation) {
  namespace k = paged_cuda_emu_selftest_impl;
  const int lane = threadIdx.x;
  auto elem_bits = [](const T* m, int ld, int r, int c) {
    uint16_t u;
    std::memcpy(&u, m + r * ld + c, 2);
    return uint32_t(u);
  };
  uint32_t a[4], b[2];
  for (int reg = 0; reg < 4; ++reg) {
    uint32_t v = 0;
    for (int half = 0; half < 2; ++half) {
      const int i = 2 * reg + half;
      int row = PtxFrag::a_row(lane, i);
      if (mutation == 1) row ^= 8;
      v |= elem_bits(A, 16, row, PtxFrag::a_col(lane, i)) << (16 * half);
    }
    a[reg] = v;
  }
  for (int reg = 0; reg < 2; ++reg) {
    uint32_t v = 0;
    for (int half = 0; half < 2; ++half) {
      const int i = 2 * reg + half;
      int row = PtxFrag::b_row(lane, i);
      if (mutation == 2) row ^= 8;
      v |= elem_bits(B, 8, row, PtxFrag::b_col(lane, i)) << (16 * half);
    }
    b[reg] = v;
  }
  float d[4] = {0, 0, 0, 0};
  k::mma_16816<T>(d, a, b);
  for (int i = 0; i < 4; ++i) out_d[PtxFrag::c_row(lane, i) * 8 + PtxFrag::c_col(lane, i)] = d[i];

  __shared__ T sa[16 * 16], sb[16 * 8], sbt[8 * 16];
  for (int i = lane; i < 256; i += 32) sa[i] = A[i];
  for (int i = lane; i < 128; i += 32) sb[i] = B[i], sbt[i] = Bt[i];
  __syncwarp();
  uint32_t la[4], lb[2], lbt[2];
  k::load_a_frag(la, sa, 16, 0, 0);
  k::load_b_frag_kn(lb, sb, 8, 0, 0);
  k::load_b_frag_nk(lbt, sbt, 16, 0, 0);
  uint32_t* o = out_regs + lane * 18;
  const uint32_t* rows[3][2] = {{a, b}, {la, lb}, {la, lbt}};
  for (int v = 0; v < 3; ++v) {
    for (int i = 0; i < 4; ++i) o[v * 6 + i] = rows[v][0][i];
    o[v * 6 + 4] = rows[v][1][0];
    o[v * 6 + 5] = rows[v][1][1];
  }
}

std::vector<at::Tensor> mma_ptx(const at::Tensor& A, const at::Tensor& B, int64_t mutation) {
  TORCH_CHECK(A.sizes() == at::IntArrayRef({16, 16}) && B.sizes() == at::IntArrayRef({16, 8}));
  TORCH_CHECK(A.scalar_type() == B.scalar_type());
  at::Tensor d = at::full({16, 8}, std::nanf(""), A.options().dtype(at::kFloat));
  at::Tensor regs = at::zeros({32, 3, 6}, A.options().dtype(at::kInt));
  const at::Tensor a = A.contiguous(), b = B.contiguous(), bt = B.t().contiguous();
  auto* r = reinterpret_cast<uint32_t*>(regs.data_ptr<int>());
  if (A.scalar_type() == at::kHalf) {
    using T = __half;
    cuda_emu::launch(mma_ptx_kernel<T>, dim3(1), dim3(32), 0, static_cast<const T*>(a.data_ptr()),
                     static_cast<const T*>(b.data_ptr()), static_cast<const T*>(bt.data_ptr()), d.data_ptr<float>(), r,
                     int(mutation));
  } else {
    TORCH_CHECK(A.scalar_type() == at::kBFloat16);
    using T = __nv_bfloat16;
    cuda_emu::launch(mma_ptx_kernel<T>, dim3(1), dim3(32), 0, static_cast<const T*>(a.data_ptr()),
                     static_cast<const T*>(b.data_ptr()), static_cast<const T*>(bt.data_ptr()), d.data_ptr<float>(), r,
                     int(mutation));
  }
  return {d, regs};
}

// ---- strict checks: tiny kernels that break (or keep) one rule each -----------------------------
// Vector accesses at `off` bytes past a 64-byte aligned buffer; out gets the loaded values.
template <typename V>
__global__ void vec_load_kernel(const unsigned char* base, int off, float* out) {
  static_assert(sizeof(V) >= 4 && sizeof(V) <= 16, "a 4..16-byte access");
  const V v = *reinterpret_cast<const V*>(base + off);
  float f[4] = {};
  std::memcpy(f, &v, sizeof(V));
  out[threadIdx.x] = f[0];
}
template <typename V>
__global__ void vec_store_kernel(unsigned char* base, int off) {
  V v{};
  *reinterpret_cast<V*>(base + off) = v;
}

// Thread t copies 16 bytes of src (row t) to shared memory, then reads them back into out (4 floats
// per thread). mode: what the kernel does wrong.
enum CpMode {
  kCpOk = 0,             // copy, commit, wait_group 0, barrier, read a neighbour's row
  kCpNoWait = 1,         // read its own row right after commit (no wait)
  kCpWaitTooLoose = 2,   // two groups (row t, row t + n), wait_group 1 before reading both
  kCpExitPending = 3,    // never waits
  kCpBarrierUncommitted = 4,  // barrier before the commit
  kCpPipelined = 5,      // committed group in flight across a barrier, waited after: legal
  kCpWaitAll = 6,        // wait_all covers a group never committed
};
__global__ void cp_async_kernel(const float* src, float* out, int mode, int bytes, int src_off, int dst_off, int cg) {
  const int t = threadIdx.x, n = blockDim.x;
  float* s = ::cuda_emu::dynamic_smem<float>(size_t(8) * n + 8);
  char* dst = reinterpret_cast<char*>(s + 4 * t) + dst_off;
  const char* from = reinterpret_cast<const char*>(src + 4 * t) + src_off;
  if (mode == kCpBarrierUncommitted) {
    ::cuda_emu::cp_async(dst, from, bytes, cg);
    __syncthreads();
    ::cuda_emu::cp_async_wait_all();
    return;
  }
  ::cuda_emu::cp_async(dst, from, bytes, cg);
  if (mode == kCpWaitTooLoose) {
    ::cuda_emu::cp_async_commit_group();
    ::cuda_emu::cp_async(s + 4 * (n + t), src + 4 * (n + t), 16, true);
    ::cuda_emu::cp_async_commit_group();
    ::cuda_emu::cp_async_wait_group(1);  // only the first group is complete
    for (int i = 0; i < 4; ++i) out[4 * t + i] = s[4 * t + i], out[4 * (n + t) + i] = s[4 * (n + t) + i];
    ::cuda_emu::cp_async_wait_group(0);
    return;
  }
  if (mode == kCpWaitAll) {
    ::cuda_emu::cp_async_wait_all();
    for (int i = 0; i < 4; ++i) out[4 * t + i] = s[4 * t + i];
    return;
  }
  ::cuda_emu::cp_async_commit_group();
  if (mode == kCpExitPending) return;
  if (mode == kCpNoWait) {
    for (int i = 0; i < 4; ++i) out[4 * t + i] = s[4 * t + i];
    ::cuda_emu::cp_async_wait_group(0);
    return;
  }
  if (mode == kCpPipelined) {
    __syncthreads();  // the group is still in flight here, as in a double-buffered loop
    ::cuda_emu::cp_async_wait_group(0);
  } else {
    ::cuda_emu::cp_async_wait_group(0);
  }
  __syncthreads();
  const int u = (t + 1) % n;
  for (int i = 0; i < 4; ++i) out[4 * t + i] = s[4 * u + i];
}

// cp.async with PTX's src-size (zero-fill): thread t copies 16 B of src row t with src-size
// (t % 3) * 8 (0: all zeros, 8: half data, half zeros, 16: all data), or `fixed` for every thread.
__global__ void cp_async_zfill_kernel(const float* src, float* out, int fixed) {
  const int t = threadIdx.x;
  float* s = ::cuda_emu::dynamic_smem<float>(size_t(4) * blockDim.x);
  ::cuda_emu::cp_async(s + 4 * t, src + 4 * t, 16, true, fixed >= 0 ? fixed : (t % 3) * 8);
  ::cuda_emu::cp_async_wait_all();
  for (int i = 0; i < 4; ++i) out[4 * t + i] = s[4 * t + i];
}

// Every thread writes its value to shared memory; the LAST thread sums them. With `barrier` = 0
// the __syncthreads between is missing: in program order (forward) the last thread runs after
// everybody wrote and the bug is hidden; in reverse or random order it reads unwritten (NaN) slots.
__global__ void sum_last_kernel(const float* in, float* out, int barrier) {
  float* s = ::cuda_emu::dynamic_smem<float>(blockDim.x);
  const unsigned t = threadIdx.x;
  s[t] = in[t];
  if (barrier) __syncthreads();
  if (t == blockDim.x - 1) {
    float acc = 0.f;
    for (unsigned i = 0; i < blockDim.x; ++i) acc += s[i];
    out[blockIdx.x] = acc;
  }
}

// Dynamic shared memory opt-in: two distinct kernels (template instances) touching `count` floats.
template <int Tag>
__global__ void big_smem_kernel(float* out, int count) {
  float* s = ::cuda_emu::dynamic_smem<float>(count);
  for (int i = threadIdx.x; i < count; i += blockDim.x) s[i] = float(i);
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = s[count - 1];
}

// __launch_bounds__(64): the bound restated as the first statement (what kernels/common.cuh's
// PAGED_LAUNCH_BOUNDS_CHECK expands to on the emulator).
__global__ void __launch_bounds__(64) bounded_kernel(float* out) {
  ::cuda_emu::check_launch_bounds(64);
  out[threadIdx.x] = 1.f;
}


// Thread-block clusters (cuda_emu.h launch_cluster): every block writes values tagged with its flat
// block index to its dynamic shared memory and reads its right neighbour's (rank + 1 mod the
// cluster's size) through map_shared_rank, between two cluster barriers; the modes break one rule
// each (the emulator must raise, or, for a read after the last barrier, see NaN).
enum ClusterMode {
  kClusterOk, kClusterNoFirstSync, kClusterNoLastSync, kClusterReadAfterLastSync, kClusterRankExits,
  kClusterThreadExits, kClusterMapGlobal, kClusterMapRankOver, kClusterWriteAfterSync, kClusterWriteSyncRead
};
__global__ void cluster_ring_kernel(float* out, float* global_scratch, int mode) {
  float* s = ::cuda_emu::dynamic_smem<float>(blockDim.x);
  const unsigned t = threadIdx.x, rank = ::cuda_emu::cluster_ctarank(), n = ::cuda_emu::cluster_nctarank();
  const unsigned flat = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (mode == kClusterWriteAfterSync || mode == kClusterWriteSyncRead) {
    // The values written after a first barrier, read by the neighbour with (WriteSyncRead) or
    // without (WriteAfterSync: a missing barrier.cluster) a barrier between.
    ::cuda_emu::cluster_sync();
    s[t] = float(flat * 1000 + t);
    if (mode == kClusterWriteSyncRead) ::cuda_emu::cluster_sync();
    const float v = ::cuda_emu::cluster_map_shared_rank(s, (rank + 1) % n)[t];
    ::cuda_emu::cluster_sync();
    out[flat * blockDim.x + t] = v;
    return;
  }
  s[t] = float(flat * 1000 + t);
  if (mode == kClusterRankExits && rank == 1) return;
  if (mode == kClusterThreadExits && t == 0) return;
  if (mode != kClusterNoFirstSync) ::cuda_emu::cluster_sync();
  const float* mine = mode == kClusterMapGlobal ? global_scratch : s;
  const float* right = ::cuda_emu::cluster_map_shared_rank(mine, mode == kClusterMapRankOver ? n : (rank + 1) % n);
  float v = right[t];
  if (mode == kClusterReadAfterLastSync) {
    ::cuda_emu::cluster_sync();
    v = right[t];  // no barrier after this one: the neighbour may be gone
  } else if (mode != kClusterNoLastSync) {
    ::cuda_emu::cluster_sync();
  }
  out[flat * blockDim.x + t] = v;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Runs one strict-check case; returns what the kernel wrote (cases that must fail raise).
at::Tensor strict(const std::string& what) {
  std::vector<unsigned char> raw(4096 + 64);
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
  for (int i = 0; i < 4096; ++i) base[i] = static_cast<unsigned char>(i * 7 + 1);
  at::Tensor out = at::full({1024}, std::nanf(""), at::kFloat);
  float* o = out.data_ptr<float>();
  at::Tensor src_t = at::arange(1024, at::kFloat).add_(0.25);
  const float* src = src_t.data_ptr<float>();
  auto vec = [&](auto tag, int off, bool store) {
    using V = typename decltype(tag)::type;
    if (store) cuda_emu::launch(vec_store_kernel<V>, dim3(1), dim3(2), 0, base, off);
    else cuda_emu::launch(vec_load_kernel<V>, dim3(1), dim3(2), 0, static_cast<const unsigned char*>(base), off, o);
  };
  auto cp = [&](int mode, int bytes, int src_off, int dst_off, int cg, unsigned threads = 32) {
    cuda_emu::launch(cp_async_kernel, dim3(1), dim3(threads), (size_t(8) * threads + 8) * 4, src, o, mode, bytes,
                     src_off, dst_off, cg);
  };
  cuda_emu::reset_func_attributes();
  // Misaligned vector loads/stores (each must raise).
  if (what == "uint4_load_off2") vec(TypeTag<uint4>{}, 2, false);
  else if (what == "float4_load_off4") vec(TypeTag<float4>{}, 4, false);
  else if (what == "float2_load_off4") vec(TypeTag<float2>{}, 4, false);
  else if (what == "int4_load_off8") vec(TypeTag<int4>{}, 8, false);
  else if (what == "uint2_load_off4") vec(TypeTag<uint2>{}, 4, false);
  else if (what == "half2_load_off2") vec(TypeTag<__half2>{}, 2, false);
  else if (what == "bf162_load_off2") vec(TypeTag<__nv_bfloat162>{}, 2, false);
  else if (what == "float_load_off2") vec(TypeTag<float>{}, 2, false);
  else if (what == "uint4_store_off8") vec(TypeTag<uint4>{}, 8, true);
  else if (what == "float2_store_off4") vec(TypeTag<float2>{}, 4, true);
  // The same accesses aligned (must not raise).
  else if (what == "vectors_aligned") {
    vec(TypeTag<uint4>{}, 16, false), vec(TypeTag<float4>{}, 32, false), vec(TypeTag<float2>{}, 8, false);
    vec(TypeTag<int4>{}, 48, false), vec(TypeTag<uint2>{}, 8, false), vec(TypeTag<__half2>{}, 4, false);
    vec(TypeTag<__nv_bfloat162>{}, 4, false), vec(TypeTag<float>{}, 4, false), vec(TypeTag<uint4>{}, 16, true);
    vec(TypeTag<float2>{}, 8, true);
  }
  // cp.async rules.
  else if (what == "cp_async_ok") cp(kCpOk, 16, 0, 0, 1);
  else if (what == "cp_async_ca_sizes_ok") {
    cp(kCpOk, 4, 0, 0, 0), cp(kCpOk, 8, 0, 0, 0), cp(kCpOk, 16, 0, 0, 0);
  } else if (what == "cp_async_src_off1") cp(kCpOk, 16, 1, 0, 1);
  else if (what == "cp_async_src_off8") cp(kCpOk, 16, 8, 0, 1);
  else if (what == "cp_async_dst_off4") cp(kCpOk, 16, 0, 4, 1);
  else if (what == "cp_async_8_off4") cp(kCpOk, 8, 4, 0, 0);
  else if (what == "cp_async_4_off2") cp(kCpOk, 4, 2, 0, 0);
  else if (what == "cp_async_size_2") cp(kCpOk, 2, 0, 0, 0);
  else if (what == "cp_async_size_12") cp(kCpOk, 12, 0, 0, 0);
  else if (what == "cp_async_cg_8") cp(kCpOk, 8, 0, 0, 1);
  else if (what == "cp_async_no_wait") cp(kCpNoWait, 16, 0, 0, 1);
  else if (what == "cp_async_wait_too_loose") cp(kCpWaitTooLoose, 16, 0, 0, 1);
  else if (what == "cp_async_exit_pending") cp(kCpExitPending, 16, 0, 0, 1);
  else if (what == "cp_async_barrier_uncommitted") cp(kCpBarrierUncommitted, 16, 0, 0, 1);
  else if (what == "cp_async_pipelined") cp(kCpPipelined, 16, 0, 0, 1);
  else if (what == "cp_async_wait_all") cp(kCpWaitAll, 16, 0, 0, 1);
  else if (what == "cp_async_zfill")
    cuda_emu::launch(cp_async_zfill_kernel, dim3(1), dim3(32), size_t(4) * 32 * 4, src, o, -1);
  else if (what == "cp_async_zfill_past_cp_size")
    cuda_emu::launch(cp_async_zfill_kernel, dim3(1), dim3(32), size_t(4) * 32 * 4, src, o, 20);
  // A missing __syncthreads (output: one sum per block).
  else if (what == "missing_barrier" || what == "with_barrier") {
    at::Tensor in = at::arange(128, at::kFloat).add_(1);
    cuda_emu::launch(sum_last_kernel, dim3(8), dim3(128), 128 * 4, static_cast<const float*>(in.data_ptr<float>()), o,
                     int(what == "with_barrier"));
  }
  // Dynamic shared memory opt-in (64 KB = 16384 floats).
  else if (what == "smem_64k_no_optin") cuda_emu::launch(big_smem_kernel<0>, dim3(1), dim3(64), 65536, o, 16384);
  else if (what == "smem_48k_no_optin") cuda_emu::launch(big_smem_kernel<0>, dim3(1), dim3(64), 49152, o, 12288);
  else if (what == "smem_64k_optin") {
    TORCH_CHECK(cuda_emu::func_set_max_dynamic_smem(big_smem_kernel<0>, 65536) == cudaSuccess);
    cuda_emu::launch(big_smem_kernel<0>, dim3(1), dim3(64), 65536, o, 16384);
  } else if (what == "smem_64k_optin_other_kernel") {
    TORCH_CHECK(cuda_emu::func_set_max_dynamic_smem(big_smem_kernel<1>, 65536) == cudaSuccess);
    cuda_emu::launch(big_smem_kernel<0>, dim3(1), dim3(64), 65536, o, 16384);
  } else if (what == "smem_64k_optin_too_small") {
    TORCH_CHECK(cuda_emu::func_set_max_dynamic_smem(big_smem_kernel<0>, 57344) == cudaSuccess);
    cuda_emu::launch(big_smem_kernel<0>, dim3(1), dim3(64), 65536, o, 16384);
  } else if (what == "smem_optin_over_limit") {
    TORCH_CHECK(cuda_emu::func_set_max_dynamic_smem(big_smem_kernel<0>, 228 * 1024) == cudaErrorInvalidValue);
  }
  // __launch_bounds__.
  else if (what == "bounds_ok") cuda_emu::launch(bounded_kernel, dim3(2), dim3(64), 0, o);
  else if (what == "bounds_over") cuda_emu::launch(bounded_kernel, dim3(2), dim3(128), 0, o);
  else TORCH_CHECK(false, "unknown strict case ", what);
  return out;
}


// One cluster case: `what` names the mode; grid and cluster dims (3 each), 64 threads a block.
// cluster [0, 0, 0]: an ordinary launch (every block a cluster of one). Returns out, [blocks x 64].
at::Tensor cluster(const std::string& what, std::vector<int64_t> grid, std::vector<int64_t> cluster,
                   bool non_portable) {
  TORCH_CHECK(grid.size() == 3 && cluster.size() == 3, "grid and cluster: 3 dimensions each");
  const int mode = what == "ok" ? kClusterOk : what == "no_first_sync" ? kClusterNoFirstSync
                   : what == "no_last_sync" ? kClusterNoLastSync : what == "read_after_last_sync" ? kClusterReadAfterLastSync
                   : what == "rank_exits" ? kClusterRankExits : what == "thread_exits" ? kClusterThreadExits
                   : what == "map_global" ? kClusterMapGlobal : what == "map_rank_over" ? kClusterMapRankOver
                   : what == "write_after_sync" ? kClusterWriteAfterSync
                   : what == "write_sync_read" ? kClusterWriteSyncRead : -1;
  TORCH_CHECK(mode >= 0, "unknown cluster case ", what);
  constexpr unsigned kThreads = 64;
  const dim3 g{unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2])};
  at::Tensor out = at::full({int64_t(g.x) * g.y * g.z * kThreads}, std::nanf(""), at::kFloat);
  std::vector<float> scratch(kThreads, 1.f);
  cuda_emu::reset_func_attributes();
  if (non_portable) TORCH_CHECK(cuda_emu::func_set_non_portable_cluster_size_allowed(cluster_ring_kernel, true) == cudaSuccess);
  if (cluster[0] == 0 && cluster[1] == 0 && cluster[2] == 0)
    cuda_emu::launch(cluster_ring_kernel, g, dim3(kThreads), kThreads * 4, out.data_ptr<float>(), scratch.data(), mode);
  else
    cuda_emu::launch_cluster(cluster_ring_kernel, g, dim3(kThreads), kThreads * 4,
                             dim3(unsigned(cluster[0]), unsigned(cluster[1]), unsigned(cluster[2])),
                             out.data_ptr<float>(), scratch.data(), mode);
  return out;
}

void set_schedule(const std::string& mode) { cuda_emu::set_schedule(mode); }

at::Tensor mma(const at::Tensor& A, const at::Tensor& B) {
  at::Tensor out = at::full({2, 16, 8}, std::nanf(""), A.options().dtype(at::kFloat));
  const at::Tensor a = A.contiguous(), b = B.contiguous(), bt = B.t().contiguous();
  if (A.scalar_type() == at::kHalf) {
    cuda_emu::launch(mma_kernel<__half>, dim3(1), dim3(32), 0, static_cast<const __half*>(a.data_ptr()),
                     static_cast<const __half*>(b.data_ptr()), static_cast<const __half*>(bt.data_ptr()),
                     out.data_ptr<float>());
  } else {
    TORCH_CHECK(A.scalar_type() == at::kBFloat16);
    cuda_emu::launch(mma_kernel<__nv_bfloat16>, dim3(1), dim3(32), 0,
                     static_cast<const __nv_bfloat16*>(a.data_ptr()), static_cast<const __nv_bfloat16*>(b.data_ptr()),
                     static_cast<const __nv_bfloat16*>(bt.data_ptr()), out.data_ptr<float>());
  }
  return out;
}

at::Tensor warp_ops(const at::Tensor& in) {
  TORCH_CHECK(in.scalar_type() == at::kInt && in.dim() == 1 && in.is_contiguous());
  const int n = int(in.numel());
  at::Tensor out = at::full({n, 9}, -999, in.options());
  at::Tensor counter = at::zeros({1}, in.options());
  cuda_emu::launch(warp_ops_kernel, dim3(1), dim3(n), 0, in.data_ptr<int>(), out.data_ptr<int>(),
                   reinterpret_cast<unsigned*>(counter.data_ptr<int>()));
  return at::cat({out.reshape(-1), counter});
}

// [n, 4]: any in == 7, count of even in, all in >= 0, any in < 0 (one block of n threads).
at::Tensor block_votes(const at::Tensor& in) {
  TORCH_CHECK(in.scalar_type() == at::kInt && in.dim() == 1 && in.is_contiguous());
  const int n = int(in.numel());
  at::Tensor out = at::full({n, 4}, -999, in.options());
  cuda_emu::launch(block_votes_kernel, dim3(1), dim3(n), 0, in.data_ptr<int>(), out.data_ptr<int>());
  return out;
}

std::vector<double> atomics(int64_t blocks, int64_t threads) {
  int counter = 0;
  float fsum = 0.f;
  cuda_emu::launch(atomic_kernel, dim3(unsigned(blocks)), dim3(unsigned(threads)), 0, &counter, &fsum);
  return {double(counter), double(fsum)};
}

// Launch one of the rule-breaking kernels; must throw.
void misuse(const std::string& what) {
  std::vector<int> x(2048);
  std::vector<float> f(2048);
  if (what == "barrier_exit") cuda_emu::launch(divergent_barrier_kernel, dim3(3), dim3(128), 0, x.data());
  else if (what == "different_barriers") cuda_emu::launch(different_barriers_kernel, dim3(1), dim3(64), 0, x.data());
  else if (what == "shuffle_exit") cuda_emu::launch(divergent_shuffle_kernel, dim3(1), dim3(64), 0, x.data());
  else if (what == "smem_over_request") cuda_emu::launch(smem_kernel, dim3(2), dim3(64), 64 * 4, f.data(), 65);
  else if (what == "smem_over_limit") cuda_emu::launch(smem_kernel, dim3(1), dim3(64), 228 * 1024, f.data(), 64);
  else if (what == "block_too_large") cuda_emu::launch(smem_kernel, dim3(1), dim3(1025), 0, f.data(), 0);
  else if (what == "block_zero") cuda_emu::launch(smem_kernel, dim3(1), dim3(0), 0, f.data(), 0);
  else if (what == "grid_zero") cuda_emu::launch(smem_kernel, dim3(0), dim3(32), 0, f.data(), 0);
  else if (what == "grid_y_too_large") cuda_emu::launch(smem_kernel, dim3(1, 65536), dim3(32), 0, f.data(), 0);
  else if (what == "ok") cuda_emu::launch(smem_kernel, dim3(2), dim3(64), 64 * 4, f.data(), 64);
  else TORCH_CHECK(false, "unknown misuse case ", what);
}


// ---- the shared rules (csrc/attention_rules.h) against their definition ------------------------
// paged_ops/reference.py attention: the per-key visibility test, and the row's log-sum-exp over
// its scores and sink computed in long double. Raises on the first rule broken.
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b); }
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b); }

void check_visible_keys() {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t windows[] = {-1, 0, 1, 2, 7, kMax - 1, kMax};
  for (int64_t kv_len = 0; kv_len <= 6; ++kv_len)
    // Rows of q_len up to 9 (pos = kv_len - q_len + i), and positions past the last key too.
    for (int64_t pos = kv_len - 9; pos < kv_len + 3; ++pos)
      for (int causal = 0; causal < 2; ++causal)
        for (int64_t wl : windows)
          for (int64_t wr : windows) {
            const paged::KeyRange<int64_t> r = paged::visible_keys(pos, kv_len, causal, wl, wr);
            TORCH_CHECK(r.lo >= 0 && r.hi <= kv_len, "visible_keys out of [0, kv_len): ", r.lo, " ", r.hi);
            const paged::KeyRange<int> r32 = paged::visible_keys(int(pos), int(kv_len), causal, wl, wr);
            TORCH_CHECK(r32.lo == r.lo && r32.hi == r.hi, "visible_keys on int positions differs at pos ", pos);
            for (int64_t j = -2; j < kv_len + 2; ++j) {
              const bool want = j >= 0 && j < kv_len && (!causal || j <= pos) &&
                                (wl < 0 || __int128(j) >= __int128(pos) - wl) &&
                                (wr < 0 || __int128(j) <= __int128(pos) + wr);
              TORCH_CHECK(r.contains(j) == want && r.empty() == (r.lo >= r.hi), "visible_keys(pos ", pos,
                          ", kv_len ", kv_len, ", causal ", causal, ", window ", wl, " / ", wr, ") at key ", j);
            }
          }
  // Sums that would overflow int64: windows of INT64_MAX around positions far from 0.
  const int64_t big = int64_t(1) << 62;
  auto is = [](paged::KeyRange<int64_t> r, int64_t lo, int64_t hi) { return r.lo == lo && r.hi == hi; };
  TORCH_CHECK(is(paged::visible_keys(big - 1, big, false, kMax, kMax), 0, big), "INT64_MAX windows at 2^62");
  TORCH_CHECK(is(paged::visible_keys(big - 1, big, true, kMax, kMax), 0, big), "causal INT64_MAX window at 2^62");
  TORCH_CHECK(is(paged::visible_keys(big - 1, big, false, 5, 3), big - 6, big), "window 5 / 3 at 2^62");
  TORCH_CHECK(paged::visible_keys(-big, int64_t(10), false, kMax, 3).empty(), "window_right 3 at -2^62: none");
  TORCH_CHECK(is(paged::visible_keys(-big, int64_t(10), false, kMax, kMax), 0, 10), "INT64_MAX windows at -2^62");
  TORCH_CHECK(paged::visible_keys(-big, int64_t(10), true, kMax, kMax).empty(), "causal at -2^62 sees nothing");
  // int positions (the CUDA kernels): windows still int64, no int overflow near INT_MAX.
  constexpr int kIntMax = std::numeric_limits<int>::max();
  const paged::KeyRange<int> ri = paged::visible_keys(kIntMax - 1, kIntMax, false, kMax, kMax);
  TORCH_CHECK(ri.lo == 0 && ri.hi == kIntMax, "int positions: INT64_MAX windows at INT_MAX - 1");
  const paged::KeyRange<int> rn = paged::visible_keys(-kIntMax, kIntMax, false, 2, kMax - 1);
  TORCH_CHECK(rn.lo == 0 && rn.hi == kIntMax, "int positions: kv_len - pos past INT_MAX");
  const paged::KeyRange<int> rw = paged::visible_keys(kIntMax - 3, kIntMax, false, 1, 1);
  TORCH_CHECK(rw.lo == kIntMax - 4 && rw.hi == kIntMax - 1, "int positions: window 1 / 1 at INT_MAX - 3");
}

// The row of natural-log scores `scores` (-inf: masked) in Base's arithmetic, as a kernel keeps it:
// running max m and sum l of b^(x - m), x the score in base b.
template <typename Base, typename F = typename Base::F>
void row_state(const std::vector<double>& scores, F& m, F& l) {
  m = -F(INFINITY);
  l = F(0);
  for (double s : scores) m = std::fmax(m, Base::from_ln(F(s)));
  for (double s : scores) {
    const F x = Base::from_ln(F(s));
    if (x == -F(INFINITY)) continue;
    l += m == -F(INFINITY) ? F(0) : Base::exp(x - m);
  }
}

template <typename Base, typename F = typename Base::F>
void check_end_row(const char* base) {
  const F inf = F(INFINITY), nan = F(NAN);
  auto end = [](F m, F l, F sink, F num = F(1)) { return paged::end_row<Base>(m, l, sink, num); };
  // Rows with nothing to weigh (no key, or only -inf scores): out 0, lse -inf or the sink exactly.
  const paged::RowEnd<F> none = end(-inf, F(0), -inf);
  TORCH_CHECK(none.mul == F(0) && none.lse == -inf, base, ": an empty row without a sink is 0 / -inf");
  const float finite_sinks[] = {-0.45f, -0.9f, 0.f, 1.f, 88.f, -3e38f, 3e38f, 3.4e38f};
  for (float sink : finite_sinks) {
    const paged::RowEnd<F> e = end(-inf, F(0), F(sink), F(2));
    TORCH_CHECK(e.mul == F(0) && same_bits(e.lse, F(sink)), base, ": an empty row with sink ", sink,
                " is out 0, lse the sink exactly (got ", e.lse, ")");
  }
  const paged::RowEnd<F> empty_inf = end(-inf, F(0), inf), empty_nan = end(-inf, F(0), nan);
  TORCH_CHECK(empty_inf.mul == F(0) && empty_inf.lse == inf, base, ": an empty row with sink +inf is 0 / +inf");
  TORCH_CHECK(empty_nan.mul != empty_nan.mul && empty_nan.lse != empty_nan.lse, base,
              ": an empty row with a NaN sink is NaN");
  // A sink of -inf is no sink, bit for bit; +inf zeroes a finite row (lse +inf); NaN sinks and
  // NaN rows are NaN.
  const F m = Base::from_ln(F(1.25)), l = F(3.5);
  const paged::RowEnd<F> plain = end(m, l, -inf), pinf = end(m, l, inf), pnan = end(m, l, nan);
  TORCH_CHECK(same_bits(plain.mul, Base::ratio(F(1), l)) && same_bits(plain.lse, Base::to_ln(m + Base::log(l))),
              base, ": sink -inf is no sink");
  TORCH_CHECK(pinf.mul == F(0) && pinf.lse == inf, base, ": sink +inf gives out 0, lse +inf");
  TORCH_CHECK(pnan.mul != pnan.mul && pnan.lse != pnan.lse, base, ": a NaN sink makes the row NaN");
  for (F sink : {-inf, F(0.5), F(40.f)}) {
    const paged::RowEnd<F> e = end(m, nan, sink);
    TORCH_CHECK(e.mul != e.mul && e.lse != e.lse, base, ": a NaN row stays NaN with sink ", sink);
  }
  // A sink too large for base 2 in fp32 (3e38 log2 e overflows) dominates a finite row; one too
  // small vanishes.
  const paged::RowEnd<F> huge = end(m, l, F(3e38f)), tiny = end(m, l, F(-3e38f));
  TORCH_CHECK(huge.mul == F(0) && same_bits(huge.lse, F(3e38f)), base, ": sink 3e38 dominates");
  TORCH_CHECK(same_bits(tiny.mul, plain.mul) && same_bits(tiny.lse, plain.lse), base, ": sink -3e38 vanishes");
  // The multiplier and lse against the reference's log-sum-exp over the row's scores and sink.
  const std::vector<std::vector<double>> rows = {
      {0.5}, {-3.0, 2.0, 1.0}, {10.0, 10.0, -INFINITY}, {-INFINITY, -20.0}, {60.0, -60.0, 0.0}, {}, {-INFINITY}};
  const double sinks[] = {-INFINITY, -30.0, -1.0, 0.0, 2.0, 9.99, 10.0, 70.0};
  for (const std::vector<double>& scores : rows)
    for (double sink : sinks)
      for (F num : {F(1), F(0.75)}) {
        F mr, lr;
        row_state<Base>(scores, mr, lr);
        const paged::RowEnd<F> e = end(mr, lr, F(sink), num);
        // out = acc * mul with acc = sum b^(x - m) v: mul = num b^m / Z.
        long double z = sink == -INFINITY ? 0.0L : std::exp((long double)sink);
        for (double s : scores) z += std::exp((long double)s);
        const long double lse = std::log(z);
        const long double scale_m = mr == -inf ? 0.0L : std::exp((long double)Base::to_ln(mr));
        const long double mul = z == 0.0L ? 0.0L : num * scale_m / z;
        const bool ok_lse = lse == -INFINITY ? e.lse == -inf
                                              : std::fabs((long double)e.lse - lse) <= 1e-5L * (1 + std::fabs(lse));
        TORCH_CHECK(ok_lse && std::fabs((long double)e.mul - mul) <= 1e-5L * mul, base, ": row of ", scores.size(),
                    " scores with sink ", sink, ": mul ", double(e.mul), " lse ", double(e.lse), ", want ",
                    double(mul), " ", double(lse));
      }
}

void attention_rules() {
  check_visible_keys();
  check_end_row<paged::Base2F32>("Base2F32");
  check_end_row<paged::BaseEF64>("BaseEF64");
}

// The emulator's approximate math, as the kernels call it (kernels/common.cuh): ex2.approx.ftz
// (cuda_emu::ex2_approx_ftz), __fdividef and tanh_fast over it, elementwise on float32 x (and y,
// the divisor): [ex2(x), x / y by __fdividef, tanh_fast(x)].
std::vector<at::Tensor> approx_math(const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.sizes() == y.sizes(),
              "approx_math: float32 x and y of one shape");
  const at::Tensor xc = x.contiguous(), yc = y.contiguous();
  std::vector<at::Tensor> out = {at::empty_like(xc), at::empty_like(xc), at::empty_like(xc)};
  const float *xp = xc.data_ptr<float>(), *yp = yc.data_ptr<float>();
  for (int64_t i = 0; i < xc.numel(); ++i) {
    out[0].data_ptr<float>()[i] = PAGED_KERNEL_NS::exp2_approx(xp[i]);
    out[1].data_ptr<float>()[i] = __fdividef(xp[i], yp[i]);
    out[2].data_ptr<float>()[i] = PAGED_KERNEL_NS::tanh_fast(xp[i]);
  }
  return out;
}

// The sm_80 / 86 fp8 pair conversion of the kernels (kernels/common.cuh fp8x2_to_half2_bits) and
// cuda_fp8.h's __nv_cvt_fp8x2_to_halfraw2 (its host path: the library's software conversion) on every
// 16-bit pair of the format (as a word's low pair and as its high pair) (`e4m3` true: float8_e4m3fn, else float8_e5m2): int32 [65536] each,
// the fp16 pair's bits (low half the first element).
std::vector<at::Tensor> fp8_pairs(bool e4m3) {
  at::Tensor ours = at::empty({65536}, at::kInt), lib = at::empty({65536}, at::kInt);
  for (uint32_t pair = 0; pair < 65536; ++pair) {
    auto convert = [e4m3](uint32_t word, bool high) {
      return e4m3 ? PAGED_KERNEL_NS::fp8x2_to_half2_bits<PAGED_KERNEL_NS::e4m3_t>(word, high)
                  : PAGED_KERNEL_NS::fp8x2_to_half2_bits<PAGED_KERNEL_NS::e5m2_t>(word, high);
    };
    const uint32_t mine = convert(pair | 0xa5c30000u, false);  // the other pair's bytes must not leak in
    TORCH_CHECK(convert((pair << 16) | 0x3c5au, true) == mine, "fp8_pairs: the high pair of a word differs");
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), e4m3 ? __NV_E4M3 : __NV_E5M2);
    ours.data_ptr<int>()[pair] = int(mine);
    lib.data_ptr<int>()[pair] = int(uint32_t(h.x) | (uint32_t(h.y) << 16));
  }
  return {ours, lib};
}

// The emulator's integer / half instruction models the kernels call (kernels/common.cuh prmt,
// mul_rn_f16x2), on one operand triple: [prmt(a, b, c), mul.rn.f16x2(a, b)] as int64 of their 32 bits.
std::vector<int64_t> bit_ops(int64_t a, int64_t b, int64_t c) {
  return {int64_t(PAGED_KERNEL_NS::prmt(uint32_t(a), uint32_t(b), uint32_t(c))),
          int64_t(PAGED_KERNEL_NS::mul_rn_f16x2(uint32_t(a), uint32_t(b)))};
}

}  // namespace

// A fragment of the test namespace (csrc/cuda_emu/backend.cpp defines it): test-only ops live apart from the backend.
TORCH_LIBRARY_FRAGMENT(paged_cuda_emu_test, m) {
  m.def("warp_ops(Tensor input) -> Tensor", &warp_ops);
  m.def("atomics(int blocks, int threads) -> float[]", &atomics);
  m.def("block_votes(Tensor input) -> Tensor", &block_votes);
  m.def("misuse(str what) -> ()", &misuse);
  m.def("mma(Tensor A, Tensor B) -> Tensor", &mma);
  m.def("mma_ptx(Tensor A, Tensor B, int mutation) -> Tensor[]", &mma_ptx);
  m.def("strict(str what) -> Tensor", &strict);
  m.def("cluster(str what, int[] grid, int[] cluster, bool non_portable) -> Tensor", &cluster);
  m.def("set_schedule(str mode) -> ()", &set_schedule);
  m.def("attention_rules() -> ()", &attention_rules);
  m.def("approx_math(Tensor x, Tensor y) -> Tensor[]", &approx_math);
  m.def("fp8_pairs(bool e4m3) -> Tensor[]", &fp8_pairs);
  m.def("bit_ops(int a, int b, int c) -> int[]", &bit_ops);
}

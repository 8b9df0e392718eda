// Self-tests of the emulator's ldmatrix (csrc/emu/cuda_emu.h, PTX ISA "Warp-level matrix load
// instruction: ldmatrix") and of its use with cp.async groups, callable from Python
// (tests/test_emu_ldmatrix.py) as torch.ops.paged_cuda_emu_test.ldmatrix / ldmatrix_mma /
// ldmatrix_stats. Each kernel reads 8x8 matrices through the kernels' own wrapper (ldmatrix in
// kernels/mma.cuh), either as the PTX ISA allows or broken in one way on purpose (the op must raise).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "emu/cuda_emu.h"  // after torch: its macros (threadIdx, __shared__, ...) must not reach torch
#define PAGED_KERNEL_NS paged_cuda_emu_ldmatrix_selftest_impl
#include "kernels/mma.cuh"

namespace {
namespace k = paged_cuda_emu_ldmatrix_selftest_impl;

// How the 32 rows (4 matrices of 8 rows x 8 16-bit elements) reach shared memory.
enum Fill : int {
  kFillStore = 0,       // plain 16-byte stores, barrier
  kFillAsync = 1,       // cp.async, commit, wait_group 0, barrier
  kFillAsyncNoWait = 2, // cp.async, commit, barrier (legal), read: no wait at all
  kFillAsyncStages = 3, // matrix m's rows in commit group m (4 groups), wait_group `wait_n`, barrier
};
// What one lane (`bad_lane`) does wrong at the ldmatrix.
enum Mutation : int {
  kNone = 0,
  kMisaligned = 1,  // its row address 8 bytes on (inside shared memory, not 16-byte aligned)
  kOutside = 2,     // its row address at the end of the block's dynamic shared memory
  kShape = 3,       // it executes the other shape (.x2 for .x4, else .x4)
  kTrans = 4,       // it executes the other .trans qualifier
  kExit = 5,        // it has exited before the ldmatrix
};
struct Case {
  int pitch;    // bytes between consecutive stored rows (a multiple of 16)
  int swizzle;  // row r's 16 bytes at chunk r % 8 of its line (the XOR swizzle of chunk 0)
  int fill, wait_n;
  int mutation, bad_lane;
  size_t smem;  // dynamic shared memory of the launch
};

__device__ inline unsigned char* row_of(unsigned char* s, const Case& c, int r) {
  return s + size_t(r) * c.pitch + (c.swizzle ? (r % 8) * 16 : 0);
}

// src: [32][8] 16-bit values (matrix m = rows 8m .. 8m + 7); out: [32 lanes][4] registers.
template <int N, bool Trans>
__global__ void ldmatrix_kernel(const uint16_t* src, int32_t* out, Case c) {
  unsigned char* s = ::cuda_emu::dynamic_smem<unsigned char>(c.smem);
  const int lane = int(threadIdx.x);
  unsigned char* mine = row_of(s, c, lane);  // lane l fills row l, and gives its address
  if (c.fill == kFillStore) {
    std::memcpy(mine, src + 8 * lane, 16);
  } else if (c.fill == kFillAsyncStages) {
    // Matrix m's rows in group m: lane l's copy is in group l / 8, and every lane commits 4 groups.
    for (int m = 0; m < 4; ++m) {
      if (lane / 8 == m) ::cuda_emu::cp_async(mine, src + 8 * lane, 16, true);
      ::cuda_emu::cp_async_commit_group();
    }
    ::cuda_emu::cp_async_wait_group(c.wait_n);
  } else {
    ::cuda_emu::cp_async(mine, src + 8 * lane, 16, true);
    ::cuda_emu::cp_async_commit_group();
    if (c.fill == kFillAsync) ::cuda_emu::cp_async_wait_group(0);
  }
  __syncthreads();
  const bool bad = lane == c.bad_lane;
  if (bad && c.mutation == kExit) {
    ::cuda_emu::cp_async_wait_group(0);
    return;
  }
  const unsigned char* addr = mine;
  if (bad && c.mutation == kMisaligned) addr += 8;
  if (bad && c.mutation == kOutside) addr = s + c.smem;
  uint32_t r[4] = {0, 0, 0, 0};
  if (bad && c.mutation == kShape) {
    if constexpr (N == 4) {
      uint32_t q[2];
      k::ldmatrix<2, Trans>(q, addr);
    } else {
      uint32_t q[4];
      k::ldmatrix<4, Trans>(q, addr);
    }
  } else if (bad && c.mutation == kTrans) {
    uint32_t q[N];
    k::ldmatrix<N, !Trans>(q, addr);
  } else {
    uint32_t q[N];
    k::ldmatrix<N, Trans>(q, addr);
    for (int m = 0; m < N; ++m) r[m] = q[m];
  }
  ::cuda_emu::cp_async_wait_group(0);  // the stages case's later groups: never exit with copies in flight
  for (int m = 0; m < 4; ++m) out[4 * lane + m] = int32_t(r[m]);
}

template <int N>
void launch_ldmatrix(bool trans, const uint16_t* src, int32_t* out, const Case& c) {
  if (trans) cuda_emu::launch(ldmatrix_kernel<N, true>, dim3(1), dim3(32), c.smem, src, out, c);
  else cuda_emu::launch(ldmatrix_kernel<N, false>, dim3(1), dim3(32), c.smem, src, out, c);
}

// src: int16 [32, 8]; returns int32 [32, 4]: lane l's registers r[0 .. num) (the rest 0).
at::Tensor ldmatrix(const at::Tensor& src, int64_t num, bool trans, int64_t pitch, bool swizzle, int64_t fill,
                    int64_t wait_n, int64_t mutation, int64_t bad_lane) {
  TORCH_CHECK(src.scalar_type() == at::kShort && src.sizes() == at::IntArrayRef({32, 8}));
  TORCH_CHECK(pitch % 16 == 0 && pitch >= 16);
  const at::Tensor s = src.contiguous();
  at::Tensor out = at::full({32, 4}, -1, at::kInt);
  Case c{int(pitch), swizzle ? 1 : 0, int(fill), int(wait_n), int(mutation), int(bad_lane), 0};
  c.smem = size_t(31) * c.pitch + (c.swizzle ? 7 * 16 : 0) + 16;
  const auto* p = reinterpret_cast<const uint16_t*>(s.data_ptr<int16_t>());
  int32_t* o = out.data_ptr<int32_t>();
  if (num == 1) launch_ldmatrix<1>(trans, p, o, c);
  else if (num == 2) launch_ldmatrix<2>(trans, p, o, c);
  else if (num == 4) launch_ldmatrix<4>(trans, p, o, c);
  else TORCH_CHECK(false, "ldmatrix: num must be 1, 2 or 4");
  return out;
}

// D = A B for A [16][16] and B [16][8] (k x n, row-major as V's [token][dim] rows), both through
// ldmatrix: A by .x4, B by .x2.trans, or by .x2 without .trans when `trans` is false (the
// mutation: B's rows then arrive as if B were stored n-major).
template <typename T>
__global__ void ldmatrix_mma_kernel(const T* A, const T* B, float* D, bool trans) {
  T* s = ::cuda_emu::dynamic_smem<T>(16 * 16 + 16 * 8);
  T* As = s;            // [16][16]: 32-byte rows
  T* Bs = s + 16 * 16;  // [16][8]: 16-byte rows
  const int lane = int(threadIdx.x), g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * 16; i += 32) As[i] = A[i];
  for (int i = lane; i < 16 * 8; i += 32) Bs[i] = B[i];
  __syncthreads();
  // A fragment: matrix l / 8 = (rows 0-7 | 8-15) x (cols 0-7 | 8-15), in mma.cuh's a[0..3] order.
  const int mi = lane / 8;
  uint32_t a[4], b[2];
  k::ldmatrix<4, false>(a, As + (lane % 8 + 8 * (mi % 2)) * 16 + 8 * (mi / 2));
  // B fragments b[0] (k 0-7), b[1] (k 8-15): lanes 0-15 give rows k = lane (lanes 16-31 unused).
  const T* brow = Bs + (lane % 16) * 8;
  if (trans) k::ldmatrix<2, true>(b, brow);
  else k::ldmatrix<2, false>(b, brow);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  k::mma_16816<T>(d, a, b);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

at::Tensor ldmatrix_mma(const at::Tensor& A, const at::Tensor& B, bool trans) {
  TORCH_CHECK(A.sizes() == at::IntArrayRef({16, 16}) && B.sizes() == at::IntArrayRef({16, 8}));
  TORCH_CHECK(A.scalar_type() == B.scalar_type());
  const at::Tensor a = A.contiguous(), b = B.contiguous();
  at::Tensor d = at::full({16, 8}, std::nanf(""), at::kFloat);
  const size_t smem = (16 * 16 + 16 * 8) * 2;
  if (A.scalar_type() == at::kHalf) {
    cuda_emu::launch(ldmatrix_mma_kernel<__half>, dim3(1), dim3(32), smem, static_cast<const __half*>(a.data_ptr()),
                     static_cast<const __half*>(b.data_ptr()), d.data_ptr<float>(), trans);
  } else {
    TORCH_CHECK(A.scalar_type() == at::kBFloat16);
    cuda_emu::launch(ldmatrix_mma_kernel<__nv_bfloat16>, dim3(1), dim3(32), smem,
                     static_cast<const __nv_bfloat16*>(a.data_ptr()), static_cast<const __nv_bfloat16*>(b.data_ptr()),
                     d.data_ptr<float>(), trans);
  }
  return d;
}

// [instructions, matrices, extra bank-conflict wavefronts] of every ldmatrix since the last reset
// (cuda_emu::ldmatrix_stats; every kernel of the process counts); reset: zero them afterwards.
std::vector<int64_t> ldmatrix_stats(bool reset) {
  const cuda_emu::LdmatrixStats& s = cuda_emu::ldmatrix_stats();
  std::vector<int64_t> r{int64_t(s.instructions.load()), int64_t(s.matrices.load()),
                         int64_t(s.extra_wavefronts.load())};
  if (reset) cuda_emu::reset_ldmatrix_stats();
  return r;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_cuda_emu_test, m) {
  m.def(
      "ldmatrix(Tensor src, int num, bool trans, int pitch, bool swizzle, int fill, int wait_n, int mutation, "
      "int bad_lane) -> Tensor",
      &ldmatrix);
  m.def("ldmatrix_mma(Tensor A, Tensor B, bool trans) -> Tensor", &ldmatrix_mma);
  m.def("ldmatrix_stats(bool reset) -> int[]", &ldmatrix_stats);
}

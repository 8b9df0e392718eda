// Self-tests of the emulator itself, callable from Python (tests/test_cuda_emu.py):
// torch.ops.paged_cuda_emu_selftest.<op>. They launch tiny kernels that either compute something
// the test checks (warp shuffles, votes, atomics, barriers, shared memory) or break a rule of the
// CUDA model on purpose (the op must raise, never hang or abort).
#include <ATen/ATen.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY(paged_cuda_emu_selftest, m) {
  m.def("warp_ops(Tensor input) -> Tensor", &warp_ops);
  m.def("atomics(int blocks, int threads) -> float[]", &atomics);
  m.def("misuse(str what) -> ()", &misuse);
  m.def("mma(Tensor A, Tensor B) -> Tensor", &mma);
}

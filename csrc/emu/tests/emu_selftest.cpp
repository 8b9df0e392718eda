// Standalone smoke test of the emulator without torch (the real self-tests are tests/test_cuda_emu.py):
//   g++ -std=c++17 -O2 -fopenmp -Icsrc -I$CUDA_HOME/include csrc/emu/tests/emu_selftest.cpp -o /tmp/emu_selftest
//   /tmp/emu_selftest   # prints a block reduction, two caught misuse errors and vote results
#include "emu/cuda_emu.h"
#include <cstdio>
#include <chrono>
__global__ void k_reduce(const float* in, float* out, int n) {
  __shared__ float part[32];
  float v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += in[blockIdx.x * n + i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) w += __shfl_down_sync(0xffffffffu, w, o);
    if (threadIdx.x == 0) out[blockIdx.x] = w;
  }
}
__global__ void k_diverge(int* x) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  x[threadIdx.x] = 1;
}
__global__ void k_vote(unsigned* out) {
  unsigned b = __ballot_sync(0xffffffffu, threadIdx.x % 3 == 0);
  int a = __all_sync(0xffffffffu, threadIdx.x < 64);
  int y = __any_sync(0xffffffffu, threadIdx.x == 7);
  atomicAdd(&out[0], 1u);
  if (threadIdx.x == 0) { out[1] = b; out[2] = a; out[3] = y; }
}
int main() {
  const int B = 64, N = 1000;
  std::vector<float> in(B * N), out(B);
  for (int i = 0; i < B * N; ++i) in[i] = (i % 7) * 0.5f;
  auto t0 = std::chrono::steady_clock::now();
  cuda_emu::launch(k_reduce, dim3(B), dim3(128), 0, in.data(), out.data(), N);
  auto t1 = std::chrono::steady_clock::now();
  double ref = 0; for (int i = 0; i < N; ++i) ref += in[i];
  printf("reduce %f vs %f, %.3f ms\n", out[0], ref, std::chrono::duration<double,std::milli>(t1-t0).count());
  std::vector<int> x(128);
  try { cuda_emu::launch(k_diverge, dim3(2), dim3(128), 0, x.data()); printf("NO THROW\n"); }
  catch (std::exception& e) { printf("ok: %s\n", e.what()); }
  try { cuda_emu::launch(k_diverge, dim3(2), dim3(1025), 0, x.data()); printf("NO THROW\n"); }
  catch (std::exception& e) { printf("ok: %s\n", e.what()); }
  unsigned v[4] = {0};
  cuda_emu::launch(k_vote, dim3(1), dim3(96), 0, v);
  printf("vote %u %x %u %u\n", v[0], v[1], v[2], v[3]);
}

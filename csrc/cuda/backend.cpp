// Backend `cuda`: the GPU kernels, as torch.ops.paged_cuda.* (CUDA dispatch key) and the test
// namespace paged_cuda_test (an explicit launch configuration), through the one registration
// (csrc/binding.h). What is this backend's own: where a call runs — the device guard, the
// launcher tables of the nvcc build, the current stream, the SM count and the tuned launch
// configuration (csrc/cuda/tuning.h).
// c10/cuda only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers a minimal toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "cuda/tuning.h"
#include "binding.h"

namespace paged_cuda {
namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "paged_cuda: ", what, ": ", cudaGetErrorString(e));
}

// A device attribute, asked once per device (the ops read them on every call).
template <cudaDeviceAttr kAttr>
int device_attribute(int device) {
  static std::array<std::atomic<int>, 64> cached{};  // 0 = not asked yet, else the answer + 1
  std::atomic<int>* slot = device >= 0 && device < 64 ? &cached[device] : nullptr;
  if (slot && slot->load(std::memory_order_relaxed)) return slot->load(std::memory_order_relaxed) - 1;
  int value = 0;
  check(cudaDeviceGetAttribute(&value, kAttr, device), "cudaDeviceGetAttribute");
  if (slot) slot->store(value + 1, std::memory_order_relaxed);
  return value;
}

int num_sms(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Blocks a thread-block cluster may have (kernels/plan.h plan_cluster_merge): 16, the non-portable size
// the programming guide gives compute capability 9.0, where the device launches clusters at all
// (cudaDevAttrClusterLaunch); else 0.
int max_cluster_size(int device) { return device_attribute<cudaDevAttrClusterLaunch>(device) ? 16 : 0; }

// Any direction (host<->device, device<->device): unified addressing lets cudaMemcpyDefault infer
// it. Asynchronous on the stream when the host side is pinned.
void copy_bytes(void* dst, const void* src, size_t bytes, paged::Stream stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "cudaMemcpyAsync");
}

}  // namespace

struct Backend {
  using Guard = c10::cuda::CUDAGuard;
  static paged::binding::Target target(const at::Device& device) {
    const int index = device.index() >= 0 ? device.index() : c10::cuda::current_device();
    return {&paged::kCudaDecode, &paged::kCudaPrefill, nullptr, &paged::kCudaCache, &paged::kCudaMerge,
            &paged::kCudaMergeStates, c10::cuda::getCurrentCUDAStream(index).stream(), num_sms(index), copy_bytes,
            tuning::tuned_config, /*int32_sizes=*/true, max_cluster_size(index)};
  }
};

}  // namespace paged_cuda

PAGED_OPS_REGISTER_BACKEND(paged_cuda, CUDA, paged_cuda::Backend)
PAGED_OPS_REGISTER_TEST_OPS(paged_cuda_test, CUDA, paged_cuda::Backend)

TORCH_LIBRARY_FRAGMENT(paged_cuda, m) {
  paged_cuda::tuning::define_ops(m);  // the tuning store's hooks (paged_ops/tuning.py)
}

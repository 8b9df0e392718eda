// Whether this build holds a kernel image (SASS for the device's architecture, or PTX it can JIT)
// for a device: the public ops fall back to the triton backend on a GPU the cuda backend was not
// compiled for (csrc/public/select.cpp) instead of failing at the first launch.
#include <cuda_runtime.h>

namespace paged_cuda {
namespace {
// Compiled for exactly the architectures of every other kernel in this build.
__global__ void image_probe_kernel() {}
}  // namespace

bool has_kernel_image(int device) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for torch's next check
    return false;
  }
  if (device != previous && cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaFuncAttributes attributes;
  const bool ok = cudaFuncGetAttributes(&attributes, image_probe_kernel) == cudaSuccess;
  if (!ok) cudaGetLastError();
  if (device != previous) cudaSetDevice(previous);
  return ok;
}
}  // namespace paged_cuda

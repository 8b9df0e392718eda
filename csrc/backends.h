// The one table of backends. A backend is one implementation of the whole op contract
// (paged_ops/reference.py), registered as its own torch.library namespace of the same schemas
// (csrc/ops.h). Everything that knows the backends reads this table: the router of the public ops
// (csrc/public/select.cpp, dispatch.cpp), paged_ops/backends.py (through paged_ops._C._backends())
// and the registration of each C++ backend (csrc/binding.h).
//
// One row per backend: X(id, name, torch.library namespace, devices, Python module)
//   devices  where its kernels take tensors: kOnCpu, kOnCuda (triton on CPU tensors only under
//            TRITON_INTERPRET=1: its module says where it runs in this process);
//   module   "" for a C++ backend: built or not with the extension (CMakeLists.txt), available where
//            its namespace has every op and one of its devices exists; else the Python module
//            that registers its kernels on first use and says whether it runs here
//            (is_available(), DEVICES).
// The index order is paged_ops.available_backends()'s. Choice by device when nothing forces a
// backend (select.cpp): CPU tensors -> cpu; CUDA tensors -> cuda where built for the GPU, else triton.
#pragma once

#define PAGED_OPS_BACKENDS(X)                                                   \
  X(kCpu, "cpu", "paged_cpu", kOnCpu, "")                                       \
  X(kTriton, "triton", "paged_triton", kOnCpu | kOnCuda, "paged_ops.triton")    \
  X(kCuda, "cuda", "paged_cuda", kOnCuda, "")                                   \
  X(kCudaEmu, "cuda_emu", "paged_cuda_emu", kOnCpu, "")

namespace paged::backends {

enum Devices : unsigned { kOnCpu = 1u, kOnCuda = 2u };

enum Backend : int {
#define PAGED_OPS_BACKEND_ID(id, name, ns, devices, module) id,
  PAGED_OPS_BACKENDS(PAGED_OPS_BACKEND_ID)
#undef PAGED_OPS_BACKEND_ID
      kNumBackends
};

struct Row {
  const char* name;
  const char* ns;  // torch.library namespace
  unsigned devices;
  const char* module;  // "" = C++
};

inline constexpr Row kTable[kNumBackends] = {
#define PAGED_OPS_BACKEND_ROW(id, name, ns, devices, module) {name, ns, devices, module},
    PAGED_OPS_BACKENDS(PAGED_OPS_BACKEND_ROW)
#undef PAGED_OPS_BACKEND_ROW
};

}  // namespace paged::backends

// The public contract's schemas, and the triton backend's (a Python backend: csrc/backends.h).
// Importing paged_ops._C runs these static registrations (the public ops' kernels:
// csrc/public/dispatch.cpp; each C++ backend registers itself through csrc/binding.h); the
// Python module holds only the backend-selection hooks paged_ops/backends.py uses
// (csrc/public/select.cpp).
#include <Python.h>
#include <torch/library.h>

#include "inference_only.h"
#include "ops.h"
#include "public/select.h"

TORCH_LIBRARY(paged, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

// The triton backend's schemas; its CPU and CUDA kernels are Python (paged_ops/backends.py
// registers them with torch.library and imports paged_ops.triton on the first call).
TORCH_LIBRARY(paged_triton, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }
TORCH_LIBRARY_IMPL(paged_triton, Autograd, m) { PAGED_OPS_IMPL_INFERENCE_ONLY(m); }

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, paged::api::python_methods()};
  return PyModule_Create(&module);
}

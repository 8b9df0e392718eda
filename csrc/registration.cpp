// The public contract plus the cpu backend's registration. Importing paged_ops._C runs these
// static registrations (the public ops' kernels: csrc/public/dispatch.cpp); the Python module
// holds only the backend-selection hooks paged_ops/backends.py uses (csrc/public/select.cpp).
#include <Python.h>
#include <torch/library.h>

#include "cpu/ops.h"
#include "ops.h"
#include "public/select.h"

TORCH_LIBRARY(paged, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY(paged_cpu, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

// The triton backend's schemas; its CPU and CUDA kernels are Python (paged_ops/backends.py
// registers them with torch.library and imports paged_ops.triton on the first call).
TORCH_LIBRARY(paged_triton, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY_IMPL(paged_cpu, CPU, m) {
  m.impl("reshape_and_cache", &paged::cpu::reshape_and_cache);
  m.impl("decode_attention", &paged::cpu::decode_attention);
  m.impl("prefill_attention", &paged::cpu::prefill_attention);
  m.impl("quantize_fp8", &paged::cpu::quantize_fp8);
  m.impl("dequantize_fp8", &paged::cpu::dequantize_fp8);
  m.impl("copy_blocks", &paged::cpu::copy_blocks);
  m.impl("swap_blocks", &paged::cpu::swap_blocks);
  m.impl("merge_attention_states", &paged::cpu::merge_attention_states);
  m.impl("merge_states", &paged::cpu::merge_states);
}

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, paged::api::python_methods()};
  return PyModule_Create(&module);
}

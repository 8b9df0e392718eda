// The public contract plus the cpu backend's registration. Importing paged_ops._C runs these
// static registrations; the Python module itself is empty.
#include <Python.h>
#include <torch/library.h>

#include "cpu/ops.h"
#include "ops.h"

TORCH_LIBRARY(paged, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY(paged_cpu, m) { PAGED_OPS_DEFINE_SCHEMAS(m); }

TORCH_LIBRARY_IMPL(paged_cpu, CPU, m) {
  m.impl("reshape_and_cache", &paged::cpu::reshape_and_cache);
  m.impl("decode_attention", &paged::cpu::decode_attention);
  m.impl("prefill_attention", &paged::cpu::prefill_attention);
  m.impl("quantize_fp8", &paged::cpu::quantize_fp8);
  m.impl("dequantize_fp8", &paged::cpu::dequantize_fp8);
  m.impl("copy_blocks", &paged::cpu::copy_blocks);
  m.impl("swap_blocks", &paged::cpu::swap_blocks);
}

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

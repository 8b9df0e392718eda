// Backend choice and the batch-invariant mode of the public ops; see select.h.
//
// Forcing, innermost first:
//  1. paged_ops.backend(name).op(...): a thread-local slot Python sets around that one call
//     (the call is synchronous, so no other task can run on the thread meanwhile);
//  2. paged_ops.use_backend(name): a contextvars.ContextVar, so the choice follows asyncio tasks
//     and threads. Reading it needs the GIL, so it is read only while some use_backend block is
//     active anywhere in the process (an atomic count): the default path runs no Python;
//  3. PAGED_OPS_BACKEND, read per call.
//
// The batch-invariant mode, the same way: paged_ops.batch_invariant(enabled) sets a ContextVar
// (so two asyncio tasks on one thread never see, or restore, each other's mode), read only while
// some batch_invariant block is open in the process; else PAGED_OPS_BATCH_INVARIANT, per call.
#include "public/select.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#ifdef PAGED_OPS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

namespace paged_cuda {
bool has_kernel_image(int device);  // csrc/cuda/device_support.cu
}
#endif

namespace paged::api {
namespace {

thread_local int t_call_backend = -1;   // 1.
std::atomic<int> g_active_overrides{0};  // 2.: use_backend blocks open in the process
PyObject* g_backend_var = nullptr;       // 2.: the ContextVar (value: backend index or None)
// paged_ops.batch_invariant blocks open in the process, and their ContextVar. Its value: None (no
// block in this context: PAGED_OPS_BATCH_INVARIANT decides) or the innermost block's node, a list
// [state, parent node]; state 1 on, 0 off, -1 once that block closed (paged_ops/backends.py).
std::atomic<int> g_open_batch_invariant{0};
PyObject* g_batch_invariant_var = nullptr;

// The mode of the innermost block still open in the calling thread's context: 0 / 1, or -1
// (none). Only called while a block is open somewhere: the GIL is taken only then.
int batch_invariant_by_context() {
  if (g_open_batch_invariant.load(std::memory_order_relaxed) == 0 || g_batch_invariant_var == nullptr) return -1;
#if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return -1;
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return -1;
#endif
  const PyGILState_STATE gil = PyGILState_Ensure();  // the op may run with the GIL released
  int state = -1;
  PyObject* value = nullptr;
  if (PyContextVar_Get(g_batch_invariant_var, Py_None, &value) == 0 && value != nullptr) {
    // Nodes are made by backends.py only; the depth bound guards against a hand-made cycle.
    PyObject* node = value;
    for (int depth = 0; depth < 100000 && PyList_Check(node) && PyList_GET_SIZE(node) == 2; ++depth) {
      const long s = PyLong_AsLong(PyList_GET_ITEM(node, 0));
      if (s == 0 || s == 1) {
        state = int(s);
        break;
      }
      node = PyList_GET_ITEM(node, 1);
    }
    Py_DECREF(value);
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(gil);
  return state;
}

int forced_by_context() {
  if (g_active_overrides.load(std::memory_order_relaxed) == 0 || g_backend_var == nullptr) return -1;
#if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return -1;
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return -1;
#endif
  // The op may run with the GIL released (torch.ops releases it); the thread's Python thread
  // state, and with it the current context, is the caller's.
  const PyGILState_STATE gil = PyGILState_Ensure();
  int backend = -1;
  PyObject* value = nullptr;
  if (PyContextVar_Get(g_backend_var, Py_None, &value) == 0 && value != nullptr) {
    if (value != Py_None) backend = int(PyLong_AsLong(value));
    Py_DECREF(value);
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyGILState_Release(gil);
  return backend >= 0 && backend < kNumBackends ? backend : -1;
}

std::string valid_names() {
  std::string s;
  for (const Row& row : kTable) s += std::string(s.empty() ? "" : ", ") + "'" + row.name + "'";
  return s;
}

int forced_by_env() {
  const char* value = std::getenv("PAGED_OPS_BACKEND");
  if (value == nullptr || *value == '\0') return -1;
  for (int b = 0; b < kNumBackends; ++b) {
    if (std::strcmp(value, kTable[b].name) == 0) return b;
  }
  TORCH_CHECK_VALUE(false, "PAGED_OPS_BACKEND='", value, "' is not a paged_ops backend; valid names (exact, ",
                    "lower case): ", valid_names());
}

// The table's devices column (triton on CPU tensors: its module checks TRITON_INTERPRET).
bool runs_on(int backend, c10::DeviceType type) {
  const unsigned devices = kTable[backend].devices;
  return (type == c10::kCPU && (devices & kOnCpu)) || (type == c10::kCUDA && (devices & kOnCuda));
}

#ifdef PAGED_OPS_WITH_CUDA
// Whether this build's CUDA kernels can run on `device`, asked once per device; a fallback to
// triton is said once per device.
bool cuda_kernels_run_on(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int8_t>, kMaxDevices> known{};  // 0 unknown, 1 yes, 2 no
  // No such GPU (selected_backend("cuda") on a machine without one): not a missing image.
  if (device >= c10::cuda::device_count()) return false;
  if (device < 0 || device >= kMaxDevices) return paged_cuda::has_kernel_image(device);
  const int8_t state = known[device].load(std::memory_order_acquire);
  if (state != 0) return state == 1;
  const bool ok = paged_cuda::has_kernel_image(device);
  int8_t expected = 0;
  if (known[device].compare_exchange_strong(expected, ok ? 1 : 2) && !ok) {
    TORCH_WARN("paged_ops: the cuda backend was not built for cuda:", device,
               " (no kernel image for its architecture; rebuild with PAGED_OPS_CUDA_ARCHS), "
               "using the triton backend on it");
  }
  return ok;
}
#endif

}  // namespace

bool batch_invariant_mode(bool requested) {
  if (requested) return true;  // the call's own argument cannot be turned off from outside
  const int by_context = batch_invariant_by_context();
  if (by_context >= 0) return by_context == 1;
  // Read per call, like PAGED_OPS_BACKEND, so a test or a process can flip it at run time.
  const char* env = std::getenv("PAGED_OPS_BATCH_INVARIANT");
  return env != nullptr && env[0] == '1' && env[1] == '\0';
}

int select_backend(const c10::Device& device) {
  int forced = t_call_backend;
  const char* how = "";
  if (forced < 0) forced = forced_by_context(), how = " (forced by use_backend)";
  if (forced < 0) forced = forced_by_env(), how = " (forced by PAGED_OPS_BACKEND)";
  if (forced >= 0) {
    TORCH_CHECK(runs_on(forced, device.type()), "backend '", kTable[forced].name, "'", how, " does not run on ",
                c10::DeviceTypeName(device.type(), /*lower_case=*/true), " tensors");
    return forced;
  }
  if (device.is_cpu()) return kCpu;
  if (device.is_cuda()) {
#ifdef PAGED_OPS_WITH_CUDA
    if (cuda_kernels_run_on(device.has_index() ? device.index() : 0)) return kCuda;
#endif
    return kTriton;
  }
  TORCH_CHECK(false, "no paged_ops backend runs on ", c10::DeviceTypeName(device.type(), true), " tensors");
}

namespace {

// ---- paged_ops._C module functions (paged_ops/backends.py) -------------------------------

// A C++ exception as the Python exception torch would raise for it.
template <class F>
PyObject* translate(F&& f) {
  try {
    return f();
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// _backends() -> ((name, namespace, devices, module), ...): the table (csrc/backends.h), in index
// order; devices a tuple of device types ("cpu", "cuda"), module "" for a C++ backend.
PyObject* py_backends(PyObject*, PyObject*) {
  PyObject* rows = PyTuple_New(kNumBackends);
  for (int b = 0; b < kNumBackends; ++b) {
    const Row& row = kTable[b];
    PyObject* devices = PyTuple_New((row.devices & kOnCpu ? 1 : 0) + (row.devices & kOnCuda ? 1 : 0));
    Py_ssize_t i = 0;
    if (row.devices & kOnCpu) PyTuple_SET_ITEM(devices, i++, PyUnicode_FromString("cpu"));
    if (row.devices & kOnCuda) PyTuple_SET_ITEM(devices, i++, PyUnicode_FromString("cuda"));
    PyTuple_SET_ITEM(rows, b, Py_BuildValue("(ssNs)", row.name, row.ns, devices, row.module));
  }
  return rows;
}

// _set_backend_var(var): the ContextVar use_backend sets (once, at import).
PyObject* py_set_backend_var(PyObject*, PyObject* var) {
  if (!PyContextVar_CheckExact(var)) {
    PyErr_SetString(PyExc_TypeError, "expected a contextvars.ContextVar");
    return nullptr;
  }
  Py_INCREF(var);
  Py_XSETREF(g_backend_var, var);
  Py_RETURN_NONE;
}

// _add_override(delta): +1 when a use_backend block opens, -1 when it closes.
PyObject* py_add_override(PyObject*, PyObject* delta) {
  const long d = PyLong_AsLong(delta);
  if (d == -1 && PyErr_Occurred()) return nullptr;
  g_active_overrides.fetch_add(int(d), std::memory_order_relaxed);
  Py_RETURN_NONE;
}

// _swap_call_backend(index) -> previous: the backend of the next public op on this thread
// (-1: none), set and restored around one call by paged_ops.backend(name).op.
PyObject* py_swap_call_backend(PyObject*, PyObject* index) {
  const long b = PyLong_AsLong(index);
  if (b == -1 && PyErr_Occurred()) return nullptr;
  const int previous = t_call_backend;
  t_call_backend = (b >= 0 && b < kNumBackends) ? int(b) : -1;
  return PyLong_FromLong(previous);
}

// _set_batch_invariant_var(var): the ContextVar paged_ops.batch_invariant() sets (once, at import).
PyObject* py_set_batch_invariant_var(PyObject*, PyObject* var) {
  if (!PyContextVar_CheckExact(var)) {
    PyErr_SetString(PyExc_TypeError, "expected a contextvars.ContextVar");
    return nullptr;
  }
  Py_INCREF(var);
  Py_XSETREF(g_batch_invariant_var, var);
  Py_RETURN_NONE;
}

// _add_batch_invariant_blocks(delta): +1 when a batch_invariant block opens, -1 when it closes.
PyObject* py_add_batch_invariant_blocks(PyObject*, PyObject* delta) {
  const long d = PyLong_AsLong(delta);
  if (d == -1 && PyErr_Occurred()) return nullptr;
  g_open_batch_invariant.fetch_add(int(d), std::memory_order_relaxed);
  Py_RETURN_NONE;
}

// _selected_backend(device) -> name: what a public op would run on for tensors on `device`
// ("cpu", "cuda", "cuda:1").
PyObject* py_selected_backend(PyObject*, PyObject* device) {
  const char* text = PyUnicode_AsUTF8(device);
  if (text == nullptr) return nullptr;
  return translate([&] { return PyUnicode_FromString(kTable[select_backend(c10::Device(std::string(text)))].name); });
}

PyMethodDef g_methods[] = {
    {"_backends", py_backends, METH_NOARGS, "the table of backends (csrc/backends.h), in index order"},
    {"_set_backend_var", py_set_backend_var, METH_O, "the ContextVar of use_backend"},
    {"_add_override", py_add_override, METH_O, "count of open use_backend blocks += delta"},
    {"_swap_call_backend", py_swap_call_backend, METH_O, "force the next call's backend on this thread"},
    {"_selected_backend", py_selected_backend, METH_O, "the backend a public op picks for a device"},
    {"_set_batch_invariant_var", py_set_batch_invariant_var, METH_O, "the ContextVar of batch_invariant"},
    {"_add_batch_invariant_blocks", py_add_batch_invariant_blocks, METH_O,
     "count of open batch_invariant blocks += delta"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_methods() { return g_methods; }

}  // namespace paged::api

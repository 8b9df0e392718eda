// Backend choice and the batch-invariant mode of the public ops; see select.h.
//
// Forcing, innermost first:
//  1. paged_ops.backend(name).op(...): a thread-local slot Python sets around that one call
//     (the call is synchronous, so no other task can run on the thread meanwhile);
//  2. paged_ops.use_backend(name): a contextvars.ContextVar, so the choice follows asyncio tasks
//     and threads. Reading it needs the GIL, so it is read only while some use_backend block is
//     active anywhere in the process (an atomic count): the default path runs no Python;
//  3. PAGED_OPS_BACKEND, read per call.
// Else by device: CPU -> cpu; CUDA -> cuda where its kernels run on the device, else triton; for
// decode_attention / prefill_attention on a device where the cuda kernels run, the tuner's choice
// of the call's shape bucket where it made one (paged_ops/tuning.py tune_backend): a table keyed by
// csrc/cuda/tuning.h's Key, immutable behind an atomic pointer like the launch configs' (null: no
// choice installed, the only cost then one atomic load), computed from the call's sizes only.
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

#include <mutex>
#include <vector>

#ifdef PAGED_OPS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "cuda/tuning.h"

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

namespace {

// The backend forced for this call (-1: none), checked to run on `type` tensors.
int forced_backend(c10::DeviceType type) {
  int forced = t_call_backend;
  const char* how = "";
  if (forced < 0) forced = forced_by_context(), how = " (forced by use_backend)";
  if (forced < 0) forced = forced_by_env(), how = " (forced by PAGED_OPS_BACKEND)";
  if (forced >= 0) {
    TORCH_CHECK(runs_on(forced, type), "backend '", kTable[forced].name, "'", how, " does not run on ",
                c10::DeviceTypeName(type, /*lower_case=*/true), " tensors");
  }
  return forced;
}

// The backend of a call on `device`: forced, else by device, where `on_cuda()` is the default of
// CUDA tensors (called only for them).
template <class OnCuda>
int choose_backend(const c10::Device& device, OnCuda&& on_cuda) {
  const int forced = forced_backend(device.type());
  if (forced >= 0) return forced;
  if (device.is_cpu()) return kCpu;
  if (device.is_cuda()) return on_cuda();
  TORCH_CHECK(false, "no paged_ops backend runs on ", c10::DeviceTypeName(device.type(), true), " tensors");
}

#ifdef PAGED_OPS_WITH_CUDA
namespace tuning = paged_cuda::tuning;

// The tuned choices: bucket key -> kCuda or kTriton. nullptr: none installed.
using ChoiceTable = tuning::KeyTable<int8_t>;
std::atomic<const ChoiceTable*> g_choices{nullptr};

std::mutex& choices_mutex() {  // installs only; lookups never take it
  static std::mutex* mu = new std::mutex;
  return *mu;
}

// The device's SM count (the key's kNumSms, as the tuning_key op reads it), asked once per device;
// 0 where it cannot be read (no such bucket was tuned: the default stands).
int num_sms_of(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> known{};  // 0 = not asked yet
  std::atomic<int>* slot = device >= 0 && device < kMaxDevices ? &known[device] : nullptr;
  if (slot) {
    const int n = slot->load(std::memory_order_relaxed);
    if (n) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not this call's error to report
    return 0;
  }
  if (slot) slot->store(n, std::memory_order_relaxed);
  return n;
}

// The default of CUDA tensors where the cuda kernels run: the choice for the key `key_of(key)`
// fills (false: the call has no key), else cuda. The key is computed only when a choice exists.
template <class KeyOf>
int tuned_or_cuda(KeyOf&& key_of) {
  const ChoiceTable* table = g_choices.load(std::memory_order_acquire);
  if (table == nullptr) return kCuda;
  tuning::Key key;
  if (!key_of(key)) return kCuda;
  const int8_t* found = table->find(key);
  return found ? int(*found) : kCuda;
}
#endif

}  // namespace

int select_backend(const c10::Device& device) {
  return choose_backend(device, [&] {
#ifdef PAGED_OPS_WITH_CUDA
    if (cuda_kernels_run_on(device.has_index() ? device.index() : 0)) return int(kCuda);
#endif
    return int(kTriton);
  });
}

int select_attention_backend(const c10::Device& device, const AttentionShape& shape) {
  return choose_backend(device, [&] {
#ifdef PAGED_OPS_WITH_CUDA
    const int index = device.has_index() ? device.index() : 0;
    if (cuda_kernels_run_on(index)) {
      return tuned_or_cuda([&](tuning::Key& key) {
        const bool decode = shape.max_seqlen_q == nullptr;
        const int64_t max_seqlen_q = decode ? 0 : shape.max_seqlen_q->guard_int(__FILE__, __LINE__);
        return tuning::call_key(shape.query, shape.key_cache, shape.block_tables, max_seqlen_q, decode,
                                num_sms_of(index), key);
      });
    }
#else
    (void)shape;
#endif
    return int(kTriton);
  });
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

// A Python sequence of ints as int64s (what the key / backend-choice hooks take).
bool int_list(PyObject* seq, std::vector<int64_t>& out, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(fast, i);
    if (!PyLong_Check(item)) {
      PyErr_Format(PyExc_TypeError, "%s: item %zd is not an int", what, i);
      Py_DECREF(fast);
      return false;
    }
    out[size_t(i)] = PyLong_AsLongLong(item);
    if (out[size_t(i)] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

#ifndef PAGED_OPS_WITH_CUDA
PyObject* no_cuda_backend(const char* what) {
  PyErr_Format(PyExc_RuntimeError, "%s: this build has no cuda backend (no tuned backend choice)", what);
  return nullptr;
}
#endif

// _set_backend_choices(keys, names, replace): n keys (flat, n * 11 ints of csrc/cuda/tuning.h's
// Key) and n backend names ('cuda' or 'triton'), installed as the tuned choices of those buckets
// (replace: the only ones). All are checked before any is installed (ValueError).
PyObject* py_set_backend_choices(PyObject*, PyObject* args) {
  PyObject *keys_obj, *names_obj;
  int replace = 0;
  if (!PyArg_ParseTuple(args, "OOp", &keys_obj, &names_obj, &replace)) return nullptr;
#ifdef PAGED_OPS_WITH_CUDA
  std::vector<int64_t> keys;
  if (!int_list(keys_obj, keys, "_set_backend_choices keys")) return nullptr;
  PyObject* names = PySequence_Fast(names_obj, "_set_backend_choices names");
  if (names == nullptr) return nullptr;
  std::vector<int8_t> chosen;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(names); ++i) {
    const char* name = PyUnicode_Check(PySequence_Fast_GET_ITEM(names, i))
                           ? PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(names, i)) : nullptr;
    if (name == nullptr || (std::strcmp(name, kTable[kCuda].name) != 0 && std::strcmp(name, kTable[kTriton].name) != 0)) {
      Py_DECREF(names);
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "_set_backend_choices: names[%zd] must be 'cuda' or 'triton'", i);
      return nullptr;
    }
    chosen.push_back(int8_t(std::strcmp(name, kTable[kCuda].name) == 0 ? kCuda : kTriton));
  }
  Py_DECREF(names);
  return translate([&]() -> PyObject* {
    TORCH_CHECK_VALUE(keys.size() == chosen.size() * tuning::kKeyFields, "_set_backend_choices: n keys of ",
                      int(tuning::kKeyFields), " integers and n names, got ", keys.size(), " integers and ",
                      chosen.size(), " names");
    std::vector<ChoiceTable::Entry> entries;
    for (size_t i = 0; i < chosen.size(); ++i)
      entries.push_back({tuning::key_from_list(at::IntArrayRef(keys).slice(i * tuning::kKeyFields, tuning::kKeyFields),
                                               "_set_backend_choices"),
                         chosen[i]});
    tuning::install_into(g_choices, choices_mutex(), entries, replace != 0);
    Py_RETURN_NONE;
  });
#else
  (void)keys_obj, (void)names_obj;
  return no_cuda_backend("_set_backend_choices");
#endif
}

// _backend_choices() -> ((key, name), ...): the installed choices (key a tuple of 11 ints).
PyObject* py_backend_choices(PyObject*, PyObject*) {
#ifdef PAGED_OPS_WITH_CUDA
  const ChoiceTable* table = g_choices.load(std::memory_order_acquire);
  const size_t n = table ? table->entries().size() : 0;
  PyObject* out = PyTuple_New(Py_ssize_t(n));
  for (size_t i = 0; i < n; ++i) {
    const ChoiceTable::Entry& e = table->entries()[i];
    PyObject* key = PyTuple_New(tuning::kKeyFields);
    for (int f = 0; f < tuning::kKeyFields; ++f) PyTuple_SET_ITEM(key, f, PyLong_FromLong(e.key[size_t(f)]));
    PyTuple_SET_ITEM(out, Py_ssize_t(i), Py_BuildValue("(Ns)", key, kTable[e.value].name));
  }
  return out;
#else
  return PyTuple_New(0);
#endif
}

// _resolve_backend(device, key, cuda_kernels_run) -> name: what an attention call on `device`
// ("cpu", "cuda", "cuda:1") of bucket `key` (11 ints; None: no key, as the other ops) resolves to,
// the per-call path's own resolution (forcing included), with whether the cuda kernels run on the
// device given instead of asked of it: the test hook of the tuned choice on a machine without a GPU.
PyObject* py_resolve_backend(PyObject*, PyObject* args) {
  const char* text = nullptr;
  PyObject* key_obj = nullptr;
  int cuda_kernels_run = 0;
  if (!PyArg_ParseTuple(args, "sOp", &text, &key_obj, &cuda_kernels_run)) return nullptr;
  std::vector<int64_t> key;
  if (key_obj != Py_None && !int_list(key_obj, key, "_resolve_backend key")) return nullptr;
  return translate([&] {
    const int backend = choose_backend(c10::Device(std::string(text)), [&]() -> int {
      if (!cuda_kernels_run) return kTriton;
#ifdef PAGED_OPS_WITH_CUDA
      if (key_obj == Py_None) return kCuda;
      const tuning::Key k = tuning::key_from_list(key, "_resolve_backend");
      return tuned_or_cuda([&](tuning::Key& out) { return out = k, true; });
#else
      return kTriton;  // no cuda backend in this build
#endif
    });
    return PyUnicode_FromString(kTable[backend].name);
  });
}

PyMethodDef g_methods[] = {
    {"_set_backend_choices", py_set_backend_choices, METH_VARARGS, "install tuned backend choices per bucket"},
    {"_backend_choices", py_backend_choices, METH_NOARGS, "the installed tuned backend choices"},
    {"_resolve_backend", py_resolve_backend, METH_VARARGS,
     "the backend an attention call on a device and bucket resolves to (test hook)"},
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

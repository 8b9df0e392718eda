// Which backend a public op runs on: forced (paged_ops.backend(name), paged_ops.use_backend(name),
// PAGED_OPS_BACKEND), else by device (CPU -> cpu; CUDA -> cuda where built with a kernel image for
// the device, else triton). Plus the few functions paged_ops/backends.py calls through paged_ops._C.
#pragma once
#include <Python.h>
#include <c10/core/Device.h>

#include "backends.h"

namespace paged::api {

using namespace paged::backends;  // the table: kCpu, ..., kNumBackends, kTable

inline const char* backend_name(int backend) { return kTable[backend].name; }     // "cpu", ...
inline const char* backend_namespace(int backend) { return kTable[backend].ns; }  // "paged_cpu", ...

// The backend for a call on tensors of `device`. Throws c10::ValueError for an unknown
// PAGED_OPS_BACKEND, c10::Error when the forced backend does not run on the device.
int select_backend(const c10::Device& device);

// The batch-invariant mode of one attention call: its own batch_invariant argument, else the
// innermost paged_ops.batch_invariant(enabled) block open in the caller's context (a ContextVar:
// this thread and this asyncio task), else PAGED_OPS_BATCH_INVARIANT=1 (read per call).
bool batch_invariant_mode(bool requested);

// The methods of the paged_ops._C Python module (NULL-terminated).
PyMethodDef* python_methods();

}  // namespace paged::api

// Which backend a public op runs on: forced (paged_ops.backend(name), paged_ops.use_backend(name),
// PAGED_OPS_BACKEND), else by device (CPU -> cpu; CUDA -> cuda where built with a kernel image for
// the device, else triton), where for an attention call on CUDA tensors the tuner's choice for the
// call's shape bucket (paged_ops.tuning.tune_backend) replaces "cuda". Plus the few functions
// paged_ops/backends.py and paged_ops/tuning.py call through paged_ops._C.
#pragma once
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/SymInt.h>

#include "backends.h"

namespace paged::api {

using namespace paged::backends;  // the table: kCpu, ..., kNumBackends, kTable

inline const char* backend_name(int backend) { return kTable[backend].name; }     // "cpu", ...
inline const char* backend_namespace(int backend) { return kTable[backend].ns; }  // "paged_cpu", ...

// The backend for a call on tensors of `device`. Throws c10::ValueError for an unknown
// PAGED_OPS_BACKEND, c10::Error when the forced backend does not run on the device.
int select_backend(const c10::Device& device);

// What an attention call's tuned backend is looked up by: its tensors' sizes, strides and dtypes
// and max_seqlen_q (null: a decode call); never their contents (csrc/cuda/tuning.h call_key).
struct AttentionShape {
  const at::Tensor& query;         // [num_tokens, num_heads, head_size]
  const at::Tensor& key_cache;     // [num_blocks, block_size, num_kv_heads, head_size]
  const at::Tensor& block_tables;  // [num_seqs, max_blocks_per_seq]
  const c10::SymInt* max_seqlen_q;
};

// select_backend for decode_attention / prefill_attention: the same, except that where nothing
// forces a backend and the cuda kernels run on the device, the tuned choice of the call's bucket
// (cuda or triton) decides; no entry: cuda. With no entry installed it costs one atomic load more.
int select_attention_backend(const c10::Device& device, const AttentionShape& shape);

// The batch-invariant mode of one attention call: its own batch_invariant argument, else the
// innermost paged_ops.batch_invariant(enabled) block open in the caller's context (a ContextVar:
// this thread and this asyncio task), else PAGED_OPS_BATCH_INVARIANT=1 (read per call).
bool batch_invariant_mode(bool requested);

// The methods of the paged_ops._C Python module (NULL-terminated).
PyMethodDef* python_methods();

}  // namespace paged::api

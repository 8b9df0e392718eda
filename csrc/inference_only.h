// The ops are inference-only: none has a backward. Without an Autograd kernel, torch would run
// them on a query that requires grad and hand back an output with no grad_fn, and the failure
// would surface far away, in backward(). This boxed kernel, registered at the Autograd key of
// every namespace's ops, refuses such a call up front with an error naming the op and the
// argument, and otherwise goes on below autograd as torch's own fallback would (one boxed call,
// like that fallback), bumping the version counter of every argument the op writes (as an
// in-place aten op does, so autograd notices a saved tensor that was overwritten).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops.h"

namespace paged::inference_only {

inline bool any_requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined() && t.requires_grad()) return true;
    }
  }
  return false;
}

inline void bump_version(const c10::IValue& v) {
  // Inference tensors (made under torch.inference_mode()) carry no version counter.
  auto bump = [](const at::Tensor& t) {
    if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
  };
  if (v.isTensor()) bump(v.toTensor());
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) bump(t);
  }
}

inline void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < args.size(); ++i) {
      TORCH_CHECK_NOT_IMPLEMENTED(
          !any_requires_grad((*stack)[first + i]), op.schema().name(),
          " is inference-only (it has no backward), but argument '", args[i].name(),
          "' requires grad: call it under torch.no_grad() or torch.inference_mode(), or pass ",
          args[i].name(), ".detach()");
    }
  }
  // The op returns nothing, so its arguments are still on the stack only until the redispatch
  // pops them: keep the written ones (a refcount each) to bump their versions afterwards.
  c10::SmallVector<c10::IValue, 4> written;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) written.push_back((*stack)[first + i]);
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const c10::IValue& v : written) bump_version(v);
}

}  // namespace paged::inference_only

#define PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, name) \
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&::paged::inference_only::kernel>())
#define PAGED_OPS_IMPL_INFERENCE_ONLY(m)                               \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "reshape_and_cache");           \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "decode_attention");            \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "prefill_attention");           \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "merge_attention_states");      \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "merge_states");                \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "quantize_fp8");                \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "dequantize_fp8");              \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "copy_blocks");                 \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "swap_blocks");                 \
  PAGED_OPS_IMPL_INFERENCE_ONLY_ONE(m, "concat_and_cache_mla")

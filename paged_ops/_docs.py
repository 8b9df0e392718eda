"""The API reference ``help(torch.ops.paged.X)`` and ``help(paged_ops.X)`` show, put together
from the specification rather than written a second time: the op's schema, its function's
docstring in ``paged_ops.reference`` (shapes, semantics), the variants' definition
(``reference.attention``) for the attention ops, the rules every op shares (dtypes, layouts,
fp8 scales: the reference module's docstring) and the errors."""
from __future__ import annotations

import inspect

import torch

from . import reference

_ATTENTION_OPS = ("decode_attention", "prefill_attention")

_ERRORS = """\
Errors: a bad argument (shape, dtype, layout, device, value; the rules above) raises ValueError
naming it, before any kernel runs. The ops are inference-only: they have no backward, and a call
with grad mode on and an argument that requires grad raises NotImplementedError naming the op and
the argument (use torch.no_grad() / torch.inference_mode(), or detach the input).

Backends: the call runs on the backend paged_ops.selected_backend(device) names (cpu, cuda,
triton, cuda_emu; see paged_ops.use_backend); every backend computes the same contract."""


def _shared_rules() -> str:
    doc = inspect.getdoc(reference) or ""
    start = doc.find("Rules shared by every op")
    return doc[start:].strip() if start >= 0 else ""


def op_doc(op: str) -> str:
    """The reference text of op ``op``: schema, specification, variants, shared rules, errors."""
    schema = getattr(torch.ops.paged, op).default._schema
    signature = str(schema)[len(schema.name):]  # "(Tensor(a!) out, ...) -> ()"
    parts = [f"torch.ops.paged.{op}{signature}",
             "Writes into its mutable (!) arguments and returns None. Specification: "
             f"paged_ops.reference.{op} (float64, runnable).",
             inspect.getdoc(getattr(reference, op))]
    if op in _ATTENTION_OPS:
        parts.append("The keyword-only variants, defined on one sequence's q, k, v by reference.attention:\n\n"
                     + inspect.getdoc(reference.attention))
    parts += [_shared_rules(), _ERRORS]
    return "\n\n".join(p for p in parts if p)


def document(wrappers: dict) -> None:
    """Give ``torch.ops.paged.X`` (the op packet and its overload) and the wrapper ``paged_ops.X``
    the reference text of each op in ``wrappers`` (name -> function)."""
    for op, wrapper in wrappers.items():
        text = op_doc(op)
        packet = getattr(torch.ops.paged, op)
        packet.__doc__ = text
        packet.default.__doc__ = text
        wrapper.__doc__ = text

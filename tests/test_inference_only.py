"""The ops are inference-only (csrc/inference_only.h): with grad mode on, an argument that requires
grad is refused up front, naming the op and the argument, on the public op and on every backend's
namespace, and nothing is written; without grad (or with nothing requiring it) the call runs and
bumps the version counter of what it writes, as an in-place aten op does."""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops.backends import _NAMESPACES
from tests.test_contract import decode_case, op_samples


def _float_tensors(args):
    """(position, index in a list or None, tensor) of every floating-point tensor argument."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype.itemsize > 1:
            yield i, None, a
        elif isinstance(a, (list, tuple)):
            yield from ((i, j, t) for j, t in enumerate(a) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _with_requires_grad(args, i, j):
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
    if j is None:
        args[i] = args[i].detach().clone().requires_grad_()
    else:
        args[i][j] = args[i][j].detach().clone().requires_grad_()
    return args


def _namespaces():
    """The public namespace and every backend namespace this build defined (the check runs
    before any kernel, so triton's needs no interpreter and cuda's no GPU)."""
    def defined(ns):
        try:
            getattr(getattr(torch.ops, ns), "decode_attention")
            return True
        except (AttributeError, RuntimeError):
            return False
    return ["paged", *(ns for ns in _NAMESPACES.values() if defined(ns))]


@pytest.mark.parametrize("namespace", _namespaces())
@pytest.mark.parametrize("op", paged_ops.OPS)
def test_argument_requiring_grad_is_refused_naming_op_and_argument(op, namespace):
    args = op_samples()[op][0]
    schema_args = getattr(torch.ops.paged, op).default._schema.arguments
    checked = 0
    for i, j, _ in _float_tensors(args):
        call_args = _with_requires_grad(args, i, j)
        before = [t.detach().clone() for _, _, t in _float_tensors(call_args)]
        with pytest.raises(NotImplementedError, match=rf"{namespace}::{op} is inference-only .*'{schema_args[i].name}'"):
            getattr(getattr(torch.ops, namespace), op)(*call_args)
        after = [t.detach() for _, _, t in _float_tensors(call_args)]
        # Refused before any kernel ran: nothing written (NaN-poisoned outputs stay NaN).
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("op", paged_ops.OPS)
def test_wrapper_refuses_too_and_runs_without_grad(op):
    args = op_samples()[op][0]
    i, j, _ = next(_float_tensors(args))
    call_args = _with_requires_grad(args, i, j)
    with pytest.raises(NotImplementedError, match=f"paged::{op} is inference-only"):
        getattr(paged_ops, op)(*call_args)
    with torch.no_grad():
        getattr(paged_ops, op)(*call_args)  # the same call runs without grad
    with torch.inference_mode():
        getattr(paged_ops, op)(*call_args)


@pytest.mark.parametrize("op", paged_ops.OPS)
def test_written_arguments_get_a_new_version(op):
    args = op_samples()[op][0]
    schema_args = getattr(torch.ops.paged, op).default._schema.arguments
    written = [(a.name, args[k]) for k, a in enumerate(schema_args)
               if k < len(args) and a.alias_info is not None and a.alias_info.is_write and args[k] is not None]
    tensors = [(name, t) for name, v in written for t in (v if isinstance(v, (list, tuple)) else [v])]
    versions = [t._version for _, t in tensors]
    getattr(torch.ops.paged, op)(*args)  # grad mode on, nothing requires grad: runs
    for (name, t), v in zip(tensors, versions):
        assert t._version == v + 1, f"{op}: {name} written without a version bump"


def test_no_output_without_grad_fn_from_a_query_requiring_grad():
    """The complaint this guards: an output with no grad_fn, and backward() failing far away."""
    case = decode_case()
    out = torch.full_like(case.query, float("nan"))
    query = case.query.clone().requires_grad_()
    args = list(case.decode_args(out))
    args[1] = query
    with pytest.raises(NotImplementedError, match="'query' requires grad"):
        torch.ops.paged.decode_attention(*args)
    assert torch.isnan(out).all()


"""help(torch.ops.paged.X) and help(paged_ops.X) are a reference a user can read: the schema, the
specification's own text (paged_ops.reference, not a second copy), the variants for the attention
ops, the shared rules (dtypes, layouts), the errors and that the ops are inference-only."""
from __future__ import annotations

import inspect
import pydoc

import pytest
import torch

import paged_ops
from paged_ops import reference


@pytest.mark.parametrize("op", paged_ops.OPS)
def test_op_and_wrapper_document_the_contract(op):
    schema = getattr(torch.ops.paged, op).default._schema
    for doc in (getattr(torch.ops.paged, op).__doc__, getattr(torch.ops.paged, op).default.__doc__,
                getattr(paged_ops, op).__doc__):
        assert doc, f"{op}: no docstring"
        assert all(a.name in doc for a in schema.arguments), f"{op}: an argument is missing"
        assert inspect.getdoc(getattr(reference, op)) in doc  # the specification's own words
        assert "Rules shared by every op" in doc and "float8_e4m3fn" in doc  # dtypes, layouts
        assert "ValueError" in doc and "inference-only" in doc and "NotImplementedError" in doc
        if op in ("decode_attention", "prefill_attention"):
            assert inspect.getdoc(reference.attention) in doc  # what softcap, window, sinks, ALiBi mean
    assert f"paged_ops.reference.{op}" in pydoc.render_doc(getattr(torch.ops.paged, op))

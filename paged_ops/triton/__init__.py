"""Triton backend of paged-ops.

Exports one function per ``paged`` op with the op's signature (inputs are validated by the
router before they get here), ``DEVICES`` and ``is_available()``. Under the Triton
interpreter (``TRITON_INTERPRET=1``, set before triton is imported) the kernels also run on
CPU tensors, which is how the test-suite exercises them without a GPU.
"""
from __future__ import annotations

import os



def _interpreter_works() -> bool:
    """TRITON_INTERPRET=1 is set *and* took effect.

    Triton decorates its own library functions (tl.zeros, tl.sum...) when it is first
    imported; if that happened before the variable was set (e.g. torch imported triton
    first), interpreted kernels fail on every library call. Then the backend must not
    claim CPU tensors.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl.zeros, InterpretedFunction)


DEVICES = ("cuda", "cpu") if _interpreter_works() else ("cuda",)


_IMPORT_ERROR: ImportError | None = None
try:
    from .autotune import last_config
    from .cache import copy_blocks, reshape_and_cache, swap_blocks
    from .decode import decode_attention
    from .fp8 import dequantize_fp8, quantize_fp8
    from .merge import merge_attention_states
    from .prefill import prefill_attention
except ImportError as e:  # triton missing or too old: the router sees is_available() == False
    _IMPORT_ERROR = e


def config_for(op: str, *args) -> dict:
    """The kernel config ``op`` would use for these op arguments (tuned and stored, else the
    default), without running it: ``config_for("decode_attention", out, query, ...)``.
    ``last_config(op)`` reports what the latest call actually used."""
    from . import decode, prefill
    return {"decode_attention": decode.config_for, "prefill_attention": prefill.config_for}[op](*args)


def is_available() -> bool:
    """Kernels importable (triton present), and a CUDA device or the interpreter to run them on."""
    if _IMPORT_ERROR is not None:
        return False
    import torch
    return torch.cuda.is_available() or "cpu" in DEVICES

__all__ = ["DEVICES", "is_available", "last_config", "config_for", "reshape_and_cache", "decode_attention",
           "prefill_attention", "merge_attention_states", "quantize_fp8", "dequantize_fp8", "copy_blocks", "swap_blocks"]

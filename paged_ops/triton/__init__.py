"""Triton backend of paged-ops.

Exports one function per ``paged`` op with the op's signature (inputs are validated by the
router before they get here), ``DEVICES`` and ``is_available()``. Under the Triton
interpreter (``TRITON_INTERPRET=1``, set before triton is imported) the kernels also run on
CPU tensors, which is how the test-suite exercises them without a GPU.
"""
from __future__ import annotations

import os

DEVICES = ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def is_available() -> bool:
    """Triton importable, and a CUDA device or the interpreter to run its kernels on."""
    try:
        import triton  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


try:
    from .autotune import last_config
    from .cache import copy_blocks, reshape_and_cache, swap_blocks
    from .decode import decode_attention
    from .fp8 import dequantize_fp8, quantize_fp8
    from .prefill import prefill_attention
except ImportError:  # triton missing: the router sees is_available() == False
    pass

__all__ = ["DEVICES", "is_available", "last_config", "reshape_and_cache", "decode_attention",
           "prefill_attention", "quantize_fp8", "dequantize_fp8", "copy_blocks", "swap_blocks"]

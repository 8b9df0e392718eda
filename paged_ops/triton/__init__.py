"""Triton backend of paged-ops.

Exports one function per ``paged`` op with the op's signature (inputs are validated by the
router before they get here), ``DEVICES`` and ``is_available()``. Under the Triton
interpreter (``TRITON_INTERPRET=1``, set before triton is imported) the kernels also run on
CPU tensors, which is how the test-suite exercises them without a GPU.

Threads: compiled (GPU) launches from several Python threads run concurrently, without a lock.
Triton's interpreter is not thread-safe (a launch patches ``triton.language`` for its duration and
keeps its state in globals; two threads at once raise ``InterpreterError`` or compute wrong
values), so under ``TRITON_INTERPRET=1`` every op entry point here takes one process-wide lock:
concurrent calls are correct, one at a time.
"""
from __future__ import annotations

import functools
import os
import threading

# Read once, as triton itself does when it decorates the kernels at their modules' import (below).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Re-entrant: an entry point may call another on the same thread.
_INTERPRETER_LOCK = threading.RLock()


def _serialized(fn):
    """``fn`` itself where kernels are compiled; under the interpreter, ``fn`` holding the
    interpreter lock (one launch at a time in the process)."""
    if not INTERPRETED:
        return fn

    @functools.wraps(fn)
    def one_at_a_time(*args, **kwargs):
        with _INTERPRETER_LOCK:
            return fn(*args, **kwargs)

    return one_at_a_time


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
    from .cache import concat_and_cache_mla, copy_blocks, reshape_and_cache, swap_blocks
    from .decode import decode_attention
    from .fp8 import dequantize_fp8, quantize_fp8
    from .merge import merge_attention_states, merge_states
    from .prefill import prefill_attention
except ImportError as e:  # triton missing or too old: the router sees is_available() == False
    _IMPORT_ERROR = e
else:
    (reshape_and_cache, decode_attention, prefill_attention, merge_attention_states, quantize_fp8, dequantize_fp8,
     copy_blocks, swap_blocks) = map(_serialized, (reshape_and_cache, decode_attention, prefill_attention,
                                                   merge_attention_states, quantize_fp8, dequantize_fp8,
                                                   copy_blocks, swap_blocks))
    merge_states = _serialized(merge_states)
    concat_and_cache_mla = _serialized(concat_and_cache_mla)


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
           "prefill_attention", "merge_attention_states", "merge_states", "quantize_fp8", "dequantize_fp8", "copy_blocks", "swap_blocks",
           "concat_and_cache_mla"]

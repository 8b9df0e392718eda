"""Backends and backend selection of the public ``torch.ops.paged.*``.

A backend is one implementation of the whole op contract, registered as its own namespace of
the same schemas (``torch.ops.paged_cpu.*``, ``paged_cuda``, ``paged_cuda_emu``, ``paged_triton``).
``torch.ops.paged.*`` itself is C++ (``csrc/public/``): it validates the inputs, picks a backend
and calls that namespace through the dispatcher:

- the backend of ``backend(name).op(...)`` for that call;
- else one forced with ``use_backend(name)`` (innermost wins; follows asyncio tasks and threads
  like any ``contextvars.ContextVar``), else ``PAGED_OPS_BACKEND=name`` (read per call);
- else by device: CPU tensors -> ``cpu``; CUDA tensors -> ``cuda`` where built for the device,
  else ``triton``; for ``decode_attention`` / ``prefill_attention`` on a device ``cuda`` runs on,
  the backend ``paged_ops.tuning.tune_backend`` found faster for the call's shape bucket, where
  one is stored (chosen in C++ per call: a table lookup, no Python).

This module holds the Python side of that: availability, the ``use_backend`` context variable,
the Triton backend's kernels (Python, registered with ``torch.library`` and importing
``paged_ops.triton`` on first use so ``import paged_ops`` stays fast) and the fake (meta)
implementations used under tracing.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from . import _C

OPS = ("reshape_and_cache", "decode_attention", "prefill_attention", "merge_attention_states",
       "merge_states", "quantize_fp8", "dequantize_fp8", "copy_blocks", "swap_blocks", "concat_and_cache_mla")

# The one table of backends (csrc/backends.h), in index order: name, torch.library namespace, the
# devices its kernels take, and the Python module of a Python backend ("" for C++).
_TABLE: tuple[tuple[str, str, tuple[str, ...], str], ...] = _C._backends()
_NAMES: tuple[str, ...] = tuple(row[0] for row in _TABLE)
_NAMESPACES: dict[str, str] = {row[0]: row[1] for row in _TABLE}
_DEVICES: dict[str, tuple[str, ...]] = {row[0]: row[2] for row in _TABLE}
_MODULES: dict[str, str] = {row[0]: row[3] for row in _TABLE if row[3]}
_INDEX = {name: i for i, name in enumerate(_NAMES)}

# use_backend's forced backend (index into _NAMES, or None). The C++ op reads it only while
# some use_backend block is open (_C._add_override counts them).
_FORCED: contextvars.ContextVar[int | None] = contextvars.ContextVar("paged_ops_forced_backend", default=None)
_C._set_backend_var(_FORCED)


def _module(name: str):
    """The module of Python backend ``name`` (imported on first use: ``import paged_ops`` stays fast)."""
    return importlib.import_module(_MODULES[name])


def _namespace_registered(namespace: str) -> bool:
    return all(hasattr(getattr(torch.ops, namespace), op) for op in OPS)


@functools.cache
def _is_available(name: str) -> bool:
    # What a process can run does not change while it runs.
    if name in _MODULES:  # a Python backend says itself
        try:
            return bool(_module(name).is_available())
        except (ImportError, AttributeError):  # e.g. triton missing, or too old for the kernels
            return False
    if _DEVICES[name] == ("cuda",) and not torch.cuda.is_available():
        return False
    return _namespace_registered(_NAMESPACES[name])


def available_backends() -> list[str]:
    """Names of the backends usable on this machine."""
    return [name for name in _NAMES if _is_available(name)]


class Backend:
    """One implementation of every op; methods validate their inputs (the public op's checks),
    then run this backend's kernels. They take the ops' arguments, keywords included."""

    def __init__(self, name: str):
        self.name = name
        self._index = _INDEX[name]

    @property
    def devices(self) -> tuple[str, ...]:
        if self.name in _MODULES:  # where it runs in this process (triton on CPU: the interpreter)
            return tuple(_module(self.name).DEVICES)
        return _DEVICES[self.name]

    def __repr__(self) -> str:
        return f"paged_ops.backend({self.name!r})"

    def unchecked(self, op: str) -> Callable:
        """The raw kernel entry point of ``op``, without input validation (for benchmarks that
        validated their arguments once and time many calls). Bad input here is undefined."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; ops: {OPS}")
        if self.name in _MODULES:
            return getattr(_module(self.name), op)
        return getattr(getattr(torch.ops, _NAMESPACES[self.name]), op).default

    def __getattr__(self, op: str):
        if op not in OPS:
            raise AttributeError(op)
        public = getattr(torch.ops.paged, op).default
        index, swap = self._index, _C._swap_call_backend

        # The public op, with this backend forced for exactly this call on this thread: same
        # validation, same empty-call handling, same errors.
        def call(*args, **kwargs):
            previous = swap(index)
            try:
                public(*args, **kwargs)
            finally:
                swap(previous)

        call.__name__ = op
        call.__doc__ = f"{op} on the {self.name!r} backend (validated; see paged_ops.reference.{op})."
        setattr(self, op, call)  # later lookups skip __getattr__
        return call


def backend(name: str) -> Backend:
    """The backend ``name`` ('cpu', 'triton', 'cuda', 'cuda_emu') as an object with the ops."""
    if name not in _INDEX:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(_INDEX)}")
    if not _is_available(name):
        raise RuntimeError(f"backend {name!r} is not available here; available: {available_backends()}")
    return Backend(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Route ``torch.ops.paged.*`` to backend ``name`` inside the block: this thread, and this
    asyncio task (a ``contextvars`` variable: tasks started inside inherit it, others don't)."""
    backend(name)  # fail early on an unknown or unavailable name
    token = _FORCED.set(_INDEX[name])
    _C._add_override(1)
    try:
        yield
    finally:
        _C._add_override(-1)
        _FORCED.reset(token)


# batch_invariant's blocks: the innermost open in this context, as a node [state, parent] (state 1
# on, 0 off, -1 once the block has closed; parent: the node around it, or None). Like _FORCED, the
# C++ op reads it only while some batch_invariant block is open (counted by
# _C._add_batch_invariant_blocks), so with none open the op path runs no Python; it walks out to
# the first node still open, so a task started inside a block (it inherits the node) follows the
# block's mode while the block is open and the blocks around it after that.
_BATCH_INVARIANT: contextvars.ContextVar[list | None] = contextvars.ContextVar("paged_ops_batch_invariant",
                                                                              default=None)
_C._set_batch_invariant_var(_BATCH_INVARIANT)


def batch_invariant(enabled: bool = True):
    """Inside the block, this thread's and this asyncio task's ``decode_attention`` /
    ``prefill_attention`` calls run in the batch-invariant mode (``enabled=False``: out of it,
    even with ``PAGED_OPS_BATCH_INVARIANT=1``): every row's ``out`` and ``lse`` are bitwise the
    same whatever else is in the batch, whatever the thread count, and whether the row comes from
    a decode or from a prefill of any q_len (``paged_ops.reference.prefill_attention``). Blocks
    nest (the innermost wins); a call's own ``batch_invariant=True`` always turns it on.
    ``enabled`` must be a ``bool`` (``TypeError`` otherwise, before the block opens).

    The mode is a ``contextvars.ContextVar``, like ``use_backend``'s: it holds for the whole
    block on this thread and in this asyncio task; other tasks on the thread do not see it,
    tasks started inside (and ``asyncio.to_thread`` calls) follow it while the block is open,
    and threads started meanwhile never see it. Compiled code
    called inside the block runs in the mode (it is read when the op runs); the block itself
    cannot be inside a function ``torch.compile`` traces (a graph break; pass
    ``batch_invariant=True`` to the op there)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"paged_ops.batch_invariant(enabled): enabled must be a bool (True / False), "
                        f"got {type(enabled).__name__}")
    return _batch_invariant_block(1 if enabled else 0)


@contextlib.contextmanager
def _batch_invariant_block(state: int):
    node = [state, _BATCH_INVARIANT.get()]
    token = _BATCH_INVARIANT.set(node)
    _C._add_batch_invariant_blocks(1)
    try:
        yield
    finally:
        node[0] = -1  # closed, also for the tasks started inside that still hold it
        _C._add_batch_invariant_blocks(-1)
        _BATCH_INVARIANT.reset(token)


def selected_backend(device_type: str) -> str:
    """The backend ``torch.ops.paged.*`` uses for tensors on ``device_type`` right now
    ('cpu', 'cuda' or 'cuda:1'). Raises like the op would for a bad PAGED_OPS_BACKEND. An
    attention call on CUDA tensors may instead take its bucket's tuned backend
    (``paged_ops.tuning.tune_backend``), which depends on its shapes, not only the device."""
    return _C._selected_backend(str(device_type))


# ---- the Python backends' kernels (triton) ------------------------------------------------------------


def _device_of(op: str, args) -> torch.device:
    if op == "copy_blocks":
        return args[0][0].device
    if op == "swap_blocks":  # a GPU<->CPU swap belongs to the GPU's side
        return args[1].device if args[0].device.type == "cpu" else args[0].device
    return (args[0].device if op in ("reshape_and_cache", "merge_attention_states", "merge_states", "concat_and_cache_mla")
            else args[1].device)


def _python_kernel(name: str, op: str) -> Callable:
    """The kernel of ``op`` in Python backend ``name``: its module's function of the same name,
    imported on the first call (so ``import paged_ops`` does not import triton)."""
    schema_args = getattr(torch.ops.paged, op).default._schema.arguments

    def kernel(*args, **kwargs):
        # The dispatcher leaves out trailing arguments equal to their defaults; the Python
        # functions take every argument.
        args = (*args, *(kwargs.get(a.name, a.default_value) for a in schema_args[len(args):]))
        module = _module(name)
        if not _is_available(name):
            raise RuntimeError(f"backend {name!r} is not available here ({name} missing or too old); "
                               f"available: {available_backends()}")
        device = _device_of(op, args).type
        if device not in module.DEVICES:
            raise RuntimeError(f"backend {name!r} does not run on {device} tensors here"
                               + (" (set TRITON_INTERPRET=1 before triton is first imported)"
                                  if name == "triton" and device == "cpu" else ""))
        getattr(module, op)(*args)

    kernel.__name__ = f"{_NAMESPACES[name]}_{op}"
    return kernel


# ---- fake (meta) implementations -----------------------------------------------------------


def _named_tensors(op: str, args):
    names = [a.name for a in getattr(torch.ops.paged, op).default._schema.arguments]
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            yield from ((f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor))


def _check_fake_devices(op: str, args) -> None:
    """The device rules of the contract, for the fake: a real ``meta`` tensor mixed with tensors
    elsewhere must not pass silently (a CPU ``out`` would never be written), and under tracing
    the fake tensors' devices follow the same rules as the real op's."""
    tensors = list(_named_tensors(op, args))
    if not tensors:
        return
    if op == "swap_blocks":  # src and dst may be on different devices (GPU<->CPU), not meta and real
        metas = [nt for nt in tensors if nt[1].device.type == "meta"]
        if metas and len(metas) < len(tensors):
            real = next(nt for nt in tensors if nt[1].device.type != "meta")
            raise ValueError(f"{metas[0][0]} is on meta but {real[0]} is on {real[1].device}: "
                             "meta tensors cannot be mixed with tensors on a device")
        return
    ref_name, ref = tensors[0]
    for name, t in tensors[1:]:
        if t.device == ref.device:
            continue
        if op == "copy_blocks" and name == "block_mapping" and t.device.type == "cpu" and ref.device.type != "meta":
            continue  # the mapping may stay on the CPU
        raise ValueError(f"{name} is on {t.device} but must be on {ref.device} (like {ref_name})")


def _fake(op: str) -> Callable:
    # Every op writes into its arguments and returns nothing, so tracing needs no shapes.
    names = [a.name for a in getattr(torch.ops.paged, op).default._schema.arguments]

    def fake(*args, **kwargs):
        # Keyword-only arguments (the attention variants: sinks, alibi_slopes, lse) arrive as
        # kwargs: checked in schema order with the rest.
        _check_fake_devices(op, (*args, *(kwargs.get(n) for n in names[len(args):])))

    return fake


def _register() -> None:
    for name in _MODULES:
        for op in OPS:
            torch.library.impl(f"{_NAMESPACES[name]}::{op}", _DEVICES[name])(_python_kernel(name, op))
    for namespace in ("paged", *_NAMESPACES.values()):
        if not _namespace_registered(namespace):
            continue
        for op in OPS:
            torch.library.register_fake(f"{namespace}::{op}")(_fake(op))

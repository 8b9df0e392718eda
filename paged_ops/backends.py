"""Backends, backend selection, and the implementation of the public ``torch.ops.paged.*``.

A backend is one implementation of the whole op contract. ``backend(name)`` returns it as an
object whose methods have the ops' signatures and validate their inputs; ``torch.ops.paged.*``
validates, picks a backend for the tensors' device and calls it:

- a backend forced with ``use_backend(name)`` (innermost wins) or ``PAGED_OPS_BACKEND=name``;
- else the first available of ``DEFAULT_ORDER[device]``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from . import _validate

OPS = ("reshape_and_cache", "decode_attention", "prefill_attention", "quantize_fp8",
       "dequantize_fp8", "copy_blocks", "swap_blocks")

# The hand-written CUDA kernels first, where they were built: they are tuned per shape on disk.
DEFAULT_ORDER = {"cpu": ("cpu",), "cuda": ("cuda", "triton")}


@dataclass(frozen=True)
class _CppBackend:
    """A backend compiled into paged_ops._C, registered as torch.ops.<namespace>.*."""

    namespace: str
    devices: tuple[str, ...]
    needs_gpu: bool = False

    def is_available(self) -> bool:
        if self.needs_gpu and not torch.cuda.is_available():
            return False
        return all(hasattr(getattr(torch.ops, self.namespace), op) for op in OPS)

    def function(self, op: str) -> Callable:
        return getattr(getattr(torch.ops, self.namespace), op)


@dataclass(frozen=True)
class _PythonBackend:
    """A backend written in Python (a module exporting DEVICES, is_available() and the ops)."""

    module: str

    def _load(self):
        return importlib.import_module(self.module)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self._load().DEVICES)

    def is_available(self) -> bool:
        try:
            return bool(self._load().is_available())
        except (ImportError, AttributeError):  # triton missing, or too old for the kernels
            return False

    def function(self, op: str) -> Callable:
        return getattr(self._load(), op)


_REGISTRY = {
    "cpu": _CppBackend("paged_cpu", ("cpu",)),
    "triton": _PythonBackend("paged_ops.triton"),
    "cuda": _CppBackend("paged_cuda", ("cuda",), needs_gpu=True),
    "cuda_emu": _CppBackend("paged_cuda_emu", ("cpu",)),
}


class Backend:
    """One implementation of every op; methods validate their inputs, then run the kernels."""

    def __init__(self, name: str):
        self.name = name
        self._impl = _REGISTRY[name]

    @property
    def devices(self) -> tuple[str, ...]:
        return self._impl.devices

    def __repr__(self) -> str:
        return f"paged_ops.backend({self.name!r})"

    def unchecked(self, op: str) -> Callable:
        """The raw kernel entry point of ``op``, without input validation (for benchmarks that
        validated their arguments once and time many calls). Bad input here is undefined."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; ops: {OPS}")
        return self._impl.function(op)

    def __getattr__(self, op: str):
        if op not in OPS:
            raise AttributeError(op)
        check = getattr(_validate, op)
        run = self._impl.function(op)

        def call(*args):
            check(*args)
            _call_backend(self.name, run, op, args)

        call.__name__ = op
        call.__doc__ = f"{op} on the {self.name!r} backend (validated; see paged_ops.reference.{op})."
        return call


@functools.cache
def _is_available(name: str) -> bool:
    # What a process can run does not change while it runs; torch.ops.paged.* asks on every call.
    return _REGISTRY[name].is_available()


def available_backends() -> list[str]:
    """Names of the backends usable on this machine."""
    return [name for name in _REGISTRY if _is_available(name)]


def backend(name: str) -> Backend:
    """The backend ``name`` ('cpu', 'triton', 'cuda', 'cuda_emu') as an object with the ops."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(_REGISTRY)}")
    if not _is_available(name):
        raise RuntimeError(f"backend {name!r} is not available here; available: {available_backends()}")
    return Backend(name)


_forced = threading.local()


@contextlib.contextmanager
def use_backend(name: str):
    """Route ``torch.ops.paged.*`` to backend ``name`` inside the block (this thread only)."""
    backend(name)  # fail early on an unknown or unavailable name
    stack = _forced.__dict__.setdefault("stack", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def selected_backend(device_type: str) -> str:
    """The backend ``torch.ops.paged.*`` uses for tensors on ``device_type`` right now."""
    stack = getattr(_forced, "stack", None)
    name = stack[-1] if stack else os.environ.get("PAGED_OPS_BACKEND") or None
    if name is not None:
        if device_type not in _REGISTRY[name].devices:
            raise RuntimeError(f"backend {name!r} (forced) does not run on {device_type} tensors")
        return name
    for candidate in DEFAULT_ORDER.get(device_type, ()):
        if _is_available(candidate):
            return candidate
    raise RuntimeError(f"no paged_ops backend runs on {device_type} tensors; available: {available_backends()}")


def _device_of(op: str, args) -> torch.device:
    if op == "copy_blocks":
        return args[0][0].device
    if op == "swap_blocks":  # a GPU<->CPU swap belongs to the GPU's backend
        return args[1].device if args[0].device.type == "cpu" else args[0].device
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def _is_empty(op: str, args) -> bool:
    if op in ("copy_blocks", "swap_blocks"):
        return args[2].shape[0] == 0
    if op == "reshape_and_cache":
        return args[0].shape[0] == 0
    return args[1].numel() == 0  # the query / input


def _call_backend(name: str, run: Callable, op: str, args) -> None:
    if _is_empty(op, args):
        return
    if op == "copy_blocks":  # backends get the mapping on the caches' device
        args = (*args[:2], args[2].to(args[0][0].device))
    run(*args)


def _route(op: str) -> Callable:
    check = getattr(_validate, op)

    def routed(*args):
        check(*args)
        name = selected_backend(_device_of(op, args).type)
        _call_backend(name, _REGISTRY[name].function(op), op, args)

    return routed


def _register() -> None:
    # torch.ops.paged.* on CPU and CUDA tensors: validation and backend choice live here, once.
    for op in OPS:
        torch.library.impl(f"paged::{op}", ("cpu", "cuda"))(_route(op))
    # Every op writes into its arguments and returns nothing, so tracing needs no shapes from
    # the fake implementation: it only has to exist.
    for namespace in ["paged"] + [b.namespace for b in _REGISTRY.values() if isinstance(b, _CppBackend)]:
        if not hasattr(torch.ops, namespace) or not hasattr(getattr(torch.ops, namespace), OPS[0]):
            continue
        for op in OPS:
            torch.library.register_fake(f"{namespace}::{op}")(lambda *args, **kwargs: None)

"""Is there a built extension, and can it load into this torch? Asked before ``_C`` is imported.

Without a build (``import paged_ops`` from a source checkout) Python would report a "partially
initialized module"; with another torch than the one the extension was compiled against, the
dynamic loader would report an undefined C++ symbol. Both become an ImportError that says what to
do. The build writes ``_build_info.py`` (CMakeLists.txt) next to ``_C``.
"""
from __future__ import annotations

import torch

_HOW_TO_BUILD = ("build it first: `make build` in the repository (makes .venv), or in your own venv "
                 "`pip install --no-build-isolation -e .` (needs torch, cmake>=3.26, scikit-build-core, "
                 "ninja; see README.md 'Use it from your project')")


def release(version: str) -> str:
    """'2.14.1+cu130' -> '2.14.1': the part that fixes libtorch's C++ ABI."""
    return version.split("+")[0]


def build_info():
    """The build's record, or an ImportError that says how to build."""
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(f"paged_ops has no compiled extension here (imported from {__file__.rsplit('/', 2)[0]}); "
                          + _HOW_TO_BUILD) from None
    return _build_info


def check(info=None) -> None:
    """Raise ImportError when the running torch cannot load the extension that was built."""
    info = info or build_info()
    built, running = info.TORCH_VERSION, torch.__version__
    if release(built) != release(running):
        raise ImportError(f"paged_ops was built against torch {built}, but this Python has torch {running}: "
                          f"install torch=={release(built)}, or rebuild paged_ops against this torch "
                          f"(`pip install --no-build-isolation -e .` / `make build`)")
    if info.WITH_CUDA and not torch.version.cuda:
        raise ImportError(f"paged_ops was built with its CUDA backend against torch {built} (CUDA "
                          f"{info.TORCH_CUDA_VERSION}), but this torch ({running}) is a CPU-only build: install "
                          f"the CUDA build of torch {release(built)}, or rebuild with PAGED_OPS_CUDA=off")


def version() -> str:
    return build_info().VERSION or "0+unknown"

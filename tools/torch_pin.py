"""Build-time metadata: the wheel requires the torch it is being built against.

The extension links against libtorch's C++ ABI, which changes between torch releases; a wheel
that merely said ``torch>=2.11`` would install next to any torch and die with an undefined
symbol. Pinning the release (``torch==X.Y.Z``, any local build tag such as +cpu / +cu130)
makes pip refuse a mismatched torch instead. Loaded by scikit-build-core from pyproject.toml's
``[[tool.dynamic-metadata]]``; imports the same torch that CMake builds against.
"""
from __future__ import annotations


def torch_release() -> str:
    import torch

    return torch.__version__.split("+")[0]


def dynamic_metadata(settings, project) -> dict:
    return {"dependencies": [f"torch=={torch_release()}", "numpy"]}

"""pytest plugin: turn on the Triton interpreter before anything imports triton.

Triton decorates its own ``tl.*`` helpers when it is first imported, so TRITON_INTERPRET must
be set before that (torch may import triton lazily, e.g. from torch.testing internals). Loaded
early, this lets the Triton backend run on CPU tensors in a whole-suite run, so the contract
tests cover it and tests/test_triton.py runs in-process. Register it with
``addopts = "-p tests.conftest_triton_interpreter"`` (pyproject) or
``pytest_plugins = ["tests.conftest_triton_interpreter"]`` in a rootdir conftest.py.
Without a registration, tests/test_triton.py reruns itself in a fresh process instead.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

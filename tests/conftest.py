"""Turn on the Triton interpreter (no GPU here) before anything imports triton.

Triton decorates its own ``tl.*`` helpers when it is first imported, so TRITON_INTERPRET must
be set before that (torch may import triton lazily). conftest.py is imported before any test
module, so the Triton backend runs on CPU tensors everywhere in the suite.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

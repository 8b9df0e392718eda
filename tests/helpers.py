"""The tests' names for ``paged_ops.testing`` (random paged batches, NaN poisoning, the error
budget): kept so that ``from tests.helpers import make_case, ...`` keeps working. New code
imports ``paged_ops.testing`` directly.
"""
from __future__ import annotations

from paged_ops.testing import (  # noqa: F401  (re-exported)
    FP8_DTYPES,
    GARBAGE_BLOCK_ID,
    TOLERANCE,
    PagedCase,
    assert_bits_equal,
    assert_close,
    bits,
    empty_cache,
    fp8_scales,
    make_case,
    nan_like,
    poison,
    ragged_lens,
    rel_err,
)

FP8 = FP8_DTYPES

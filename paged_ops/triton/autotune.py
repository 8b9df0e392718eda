"""The Triton backend's view of the one tuner (``paged_ops.tuning``).

Why not ``triton.autotune``: the split count of flash-decoding changes the grid, the scratch
buffers and whether a second (reduce) kernel runs, which a per-kernel autotuner cannot express;
and the key is a coarse bucket (layout, head counts, head size, block size, length bucket,
dtypes) rather than every distinct argument value.

Choices persist in ``paged_ops.tuning``'s one file, keyed by op, GPU name and the Triton
sources' hash. Under the interpreter nothing is timed: every op uses its fixed default config.
"""
from __future__ import annotations

from typing import Callable

from .. import tuning
from ..tuning import cache_layout, cache_path, tuning_enabled  # noqa: F401  (used by the kernels' callers)


class Tuner(tuning.Tuner):
    """The tuner of one Triton op."""

    def __init__(self, op: str):
        super().__init__("triton", op)


TUNERS = {op: tuning.tuner("triton", op) for op in ("decode_attention", "prefill_attention")}


def benchmark_ms(fn: Callable[[], None]) -> float:
    """Device time of one ``fn()`` in ms, many launches between one pair of events (GPU only)."""
    return tuning.time_gpu_ms(fn, iters=20, warmup=2)


def last_config(op: str) -> dict | None:
    """``{"key", "config", "source"}`` of the most recent Triton call of ``op`` in this process."""
    return tuning.last_config("triton", op)

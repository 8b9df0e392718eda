"""A small persistent tuner for the attention kernels.

Why not ``triton.autotune``: the split count of flash-decoding changes the grid, the scratch
buffers and whether a second (reduce) kernel runs, which a per-kernel autotuner cannot
express; and we want the key to be a coarse bucket (block size, head size, group size,
length bucket, dtypes) rather than every distinct argument value.

Choices persist in a JSON file (``$PAGED_OPS_CACHE_DIR`` or ``~/.cache/paged_ops``,
``triton_autotune.json``) keyed by op, GPU name and Triton version, so a new process reuses
them without benchmarking. ``last_config(op)`` tells which config the last call used.
Under the interpreter nothing is benchmarked: every op uses its fixed default config.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable

import triton

from ._common import INTERPRET

_FILE_NAME = "triton_autotune.json"
_lock = threading.Lock()
_last: dict[str, dict] = {}


def cache_path() -> Path:
    root = os.environ.get("PAGED_OPS_CACHE_DIR") or os.path.join(Path.home(), ".cache", "paged_ops")
    return Path(root) / _FILE_NAME


def tuning_enabled() -> bool:
    """Benchmark unseen shapes? Never under the interpreter, never while a CUDA graph is being
    captured (benchmarking would launch and synchronize inside the capture); opt out with
    PAGED_OPS_TRITON_AUTOTUNE=0."""
    if INTERPRET or os.environ.get("PAGED_OPS_TRITON_AUTOTUNE", "1") == "0":
        return False
    import torch
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _read_file(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data.get("entries", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or corrupt cache: retune rather than fail


def _write_entry(path: Path, entry_key: str, config: dict) -> None:
    # Merge with what other processes may have written since we read, then replace atomically.
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read_file(path)
    entries[entry_key] = config
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class Tuner:
    """Per-op config choice: in-memory memo -> persisted JSON -> benchmark -> default."""

    def __init__(self, op: str):
        self.op = op
        self._memo: dict[str, dict] = {}
        self._loaded_from: Path | None = None
        self._persisted: dict[str, dict] = {}

    def entry_key(self, device: str, key: Iterable) -> str:
        return "|".join([self.op, device, triton.__version__, *map(str, key)])

    def _persisted_entries(self) -> dict:
        path = cache_path()
        if self._loaded_from != path:  # first use, or the cache dir changed (tests)
            self._persisted = _read_file(path)
            self._loaded_from = path
            self._memo.clear()
        return self._persisted

    def lookup(self, device: str, key: Iterable) -> dict | None:
        """The stored config for a key, without benchmarking (None if never tuned)."""
        entry = self.entry_key(device, key)
        with _lock:
            return self._memo.get(entry) or self._persisted_entries().get(entry)

    def choose(self, device: str, key: tuple, default: dict, candidates: list[dict],
               bench: Callable[[dict], float] | None, force: bool = False) -> dict:
        """Pick the config for ``key`` and record it as this op's last config.

        bench(config) -> milliseconds (may raise: the candidate is then discarded).
        ``force`` tunes even where tuning is disabled (used by tests of the cache mechanism).
        """
        entry = self.entry_key(device, key)
        with _lock:
            persisted = self._persisted_entries()
            config, source = self._memo.get(entry), "memo"
            if config is None and entry in persisted:
                config, source = persisted[entry], "cache"
        if config is None:
            if bench is not None and (force or tuning_enabled()) and candidates:
                config, source = _fastest(candidates, bench, default), "tuned"
                with _lock:
                    self._persisted[entry] = config
                    _write_entry(cache_path(), entry, config)
            else:
                config, source = default, "default"
            with _lock:
                self._memo[entry] = config
        _last[self.op] = {"key": list(key), "config": dict(config), "source": source}
        return config


def _fastest(candidates: list[dict], bench: Callable[[dict], float], default: dict) -> dict:
    best, best_ms = default, float("inf")
    for config in candidates:
        try:
            ms = bench(config)
        except Exception:  # e.g. out of shared memory for this tile size on this GPU
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    return dict(best)


def benchmark_ms(fn: Callable[[], None]) -> float:
    """Median GPU time of ``fn`` in ms (short runs: tuning happens on the first call of a shape)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median")


TUNERS = {op: Tuner(op) for op in ("decode_attention", "prefill_attention")}


def last_config(op: str) -> dict | None:
    """``{"key", "config", "source"}`` of the most recent call of ``op`` in this process.

    source is "default" (fixed config: interpreter or tuning disabled), "tuned" (benchmarked
    now), "cache" (read from the JSON file) or "memo" (reused in this process).
    """
    info = _last.get(op)
    return None if info is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in info.items()}

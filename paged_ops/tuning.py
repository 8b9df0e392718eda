"""The one tuning store of the attention kernels of the ``triton`` and ``cuda`` backends.

Both backends choose a launch configuration per *shape key*. This module times candidate
configurations of either backend, keeps the fastest per key in memory and persists it in one JSON
file, ``$PAGED_OPS_CACHE_DIR/tuning.json`` (default ``~/.cache/paged_ops``): the only file of
tuning state, written and read here only.

The file is ``{"format": 3, "entries": {identity: entry}}``, each entry
``{"backend", "op", "version", "device", "key", "config", "ms"}``, filed under the identity
``entry_identity`` makes of its own fields:

- ``version``: the package version plus a hash of the kernel code that runs (the Triton sources
  for ``triton``; the built extension for ``cuda``), so a code change never reuses a configuration
  measured for other code.
- ``key``: the backend's shape key. ``cuda``: the extension's own key, integers in the order of
  csrc/cuda/tuning.h ``KeyField`` (op, SM count, dtypes, head size, group, KV heads, block size,
  cache layout, log2 buckets of batch and length), computed by the extension
  (``torch.ops.paged_cuda.tuning_key``): the key the kernels' call path looks up. It holds the SM
  count, so a ``cuda`` entry is not per device name (``device`` only notes where it was measured).
  ``triton``: the Triton module's ``tuning_key`` as strings, per device name.
- ``config``: ``triton``: ``BLOCK_N``, ``num_warps``, ...; ``cuda``: kernels/params.h
  ``LaunchConfig`` by its field names (``cuda_config_fields()``: threads, partition_size, kv_tile,
  force_split, tensor_cores); every list of a config is in that order.

The CUDA kernels read their configuration from the extension's table (csrc/cuda/tuning.h), which
holds what this module pushed: ``load()`` installs this build's stored ``cuda`` entries (at
``import paged_ops`` where a GPU is present), and the tuner installs each entry it chooses. The
candidates it times are the extension's (csrc/cuda/tuning_candidates.h).

The same file holds the **default backend of CUDA tensors per shape bucket**: ``tune_backend``
times the ``cuda`` backend against ``triton`` on one call (the same inputs for both: CUDA events,
warm-ups, the median of a few rounds, within a time budget) and files the winner with both times
as an entry of backend ``"backend_choice"``: ``key`` the ``cuda`` key of the call (so its bucket is
the kernels' config bucket, SM count included), ``config`` ``{"backend": "cuda" | "triton"}``,
``ms`` the winner's, ``times_ms`` both, ``version`` the ``cuda`` and ``triton`` code versions
joined (``choice_version``): a change of either kernel code, of triton or of the package makes an
entry stale. ``load()`` installs the current entries into the extension's choice table
(csrc/public/select.cpp), which the C++ op reads per call with no Python: for
``decode_attention`` / ``prefill_attention`` on CUDA tensors, where nothing forces a backend
(``backend(name)``, ``use_backend``, ``PAGED_OPS_BACKEND`` always win) and the ``cuda`` kernels
run on the device, the bucket's choice replaces ``cuda``; no entry (or a stale or corrupt one,
never installed): ``cuda``, as without tuning.

The cache file is input from disk and is never trusted: a file that is not JSON, or JSON of the
wrong shape, or an entry whose key or config is not a valid one of its backend and op (``{}``,
``BLOCK_N: 0``, ``threads: 33``) is ignored with one warning, and the shape is tuned again. Nothing
here can make ``import paged_ops`` or an op call fail. Entries of a backend this build cannot check
(``cuda`` without the CUDA backend) are kept in the file untouched and unused.

GPU timing (``time_gpu_ms``) runs many launches between one pair of CUDA events, so host launch
overhead is amortized instead of timed. Tests drive the same logic on CPU with a ``timer``
argument (the interpreter / emulator run the candidates, a fake clock orders them); the
measurement itself is GPU-only.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

FILE_NAME = "tuning.json"
FORMAT = 3  # version of the file layout; a file of another format is ignored

_lock = threading.Lock()
_last: dict[tuple[str, str], dict] = {}
_warned: set[str] = set()


# ---- where and what -------------------------------------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("PAGED_OPS_CACHE_DIR") or Path.home() / ".cache" / "paged_ops")


def cache_path() -> Path:
    return cache_dir() / FILE_NAME


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _package_version() -> str:
    try:
        from . import __version__
        return str(__version__)
    except ImportError:
        return "0"


_code_versions: dict[str, str] = {}


def _hash_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def code_version(backend: str) -> str:
    """Package version + a hash of the code the backend's kernels are built from."""
    if backend not in _code_versions:
        if backend == "triton":
            import triton
            src = _hash_files((Path(__file__).parent / "triton").glob("*.py"))
            _code_versions[backend] = f"{_package_version()}+triton{triton.__version__}+{src}"
        else:  # cuda / cuda_emu: the kernels are in the built extension; its bytes are the code
            from . import _C
            _code_versions[backend] = f"{_package_version()}+{_hash_files([Path(_C.__file__)])}"
    return _code_versions[backend]


def cache_layout(key_cache: torch.Tensor) -> str:
    """NHD (token-major) or HND (head-major) storage of a [blocks, block_size, kv_heads, head] cache."""
    return "HND" if key_cache.dim() == 4 and key_cache.stride(2) > key_cache.stride(1) else "NHD"


# ---- what a valid config is -----------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2_in(v, lo: int, hi: int) -> bool:
    return _is_int(v) and lo <= v <= hi and v & (v - 1) == 0


_WARPS = (1, 2, 4, 8, 16)
_TRITON_SCHEMAS: dict[str, dict[str, Callable[[object], bool]]] = {
    "decode_attention": {
        "BLOCK_N": lambda v: _pow2_in(v, 16, 256),
        "num_warps": lambda v: v in _WARPS and _is_int(v),
        "num_stages": lambda v: _is_int(v) and 1 <= v <= 8,
        "split_scale": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and 0 < v <= 64,
    },
    "prefill_attention": {
        "BLOCK_M": lambda v: _pow2_in(v, 16, 256),
        "BLOCK_N": lambda v: _pow2_in(v, 16, 256),
        "num_warps": lambda v: v in _WARPS and _is_int(v),
        "num_stages": lambda v: _is_int(v) and 1 <= v <= 8,
    },
}
# The extension checks cuda keys and configs itself (csrc/cuda/tuning.h key_problem, config_problem);
# cuda_emu: the same kernels on the emulator (tests of the tuner).
_CUDA_BACKENDS = ("cuda", "cuda_emu")
_TUNED_OPS = ("decode_attention", "prefill_attention")
# The default backend's choice per bucket (tune_backend): keyed like cuda's entries.
CHOICE = "backend_choice"
CHOICES = ("cuda", "triton")
_INT_KEYED = (*_CUDA_BACKENDS, CHOICE)
_INT32 = 1 << 31


def _cuda_ops():
    return torch.ops.paged_cuda


def cuda_available() -> bool:
    """The extension was built with the CUDA backend (its tuning ops exist)."""
    try:
        _cuda_ops().tuning_key  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


_config_fields: tuple[str, ...] = ()


def cuda_config_fields() -> tuple[str, ...]:
    """kernels/params.h ``LaunchConfig``'s field names in its order (the extension's list)."""
    global _config_fields
    if not _config_fields:
        _config_fields = tuple(_cuda_ops().launch_config_fields())
    return _config_fields


def _fields_problem(config, names: Iterable[str], optional: Iterable[str] = ()) -> str | None:
    if not isinstance(config, dict):
        return f"config is {type(config).__name__}, not an object"
    missing = set(names) - set(optional) - set(config)
    if missing:
        return f"missing {sorted(missing)}"
    unknown = set(config) - set(names)
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    return None


def config_problem(backend: str, op: str, config) -> str | None:
    """Why ``config`` is not a valid launch config of this backend and op (None: it is)."""
    if op not in _TUNED_OPS or backend not in ("triton", *_INT_KEYED):
        return f"no tuner for {backend}.{op}"
    if backend == CHOICE:
        problem = _fields_problem(config, ("backend",))
        if problem:
            return problem
        return None if config["backend"] in CHOICES else f"backend={config['backend']!r} is not one of {CHOICES}"
    if backend == "triton":
        schema = _TRITON_SCHEMAS[op]
        problem = _fields_problem(config, schema, optional=("split_scale",))
        if problem:
            return problem
        for name, ok in schema.items():
            if name in config and not ok(config[name]):
                return f"{name}={config[name]!r} is out of range"
        return None
    if not cuda_available():
        return "this build has no CUDA backend to check it"
    fields = cuda_config_fields()
    problem = _fields_problem(config, fields)
    if problem:
        return problem
    for name in fields:
        if not (_is_int(config[name]) and -_INT32 <= config[name] < _INT32):
            return f"{name}={config[name]!r} is not a 32-bit integer"
    problem = _cuda_ops().launch_config_problem(_config_list(config))
    return f"{problem}: " + ", ".join(f"{k}={config[k]}" for k in fields) if problem else None


def _config_list(config: dict) -> list[int]:
    return [config[name] for name in cuda_config_fields()]


# ---- the file -------------------------------------------------------------------------------

def _stored_key(backend: str, key: Iterable) -> list:
    """A shape key as the file holds it: the extension's integers (cuda), else strings."""
    return [int(k) for k in key] if backend in _INT_KEYED else [str(k) for k in key]


def entry_identity(backend: str, op: str, version: str, device: str, key: Iterable) -> str:
    """What an entry is filed under: its backend, op, code version, device name (not for cuda,
    whose key holds the SM count) and shape key."""
    per_device = [] if backend in _INT_KEYED else [device]
    return json.dumps([backend, op, version, *per_device, *_stored_key(backend, key)])


MAX_FILE_BYTES = 64 << 20  # a tuning file is a few kB; anything near this is not one


def _short(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to ``limit`` characters (a bad file's key may be megabytes)."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _read_text(path: Path) -> str | None:
    """The file's text, or None (missing, or not a readable UTF-8 regular file: warned once).

    Opened non-blocking and checked to be a regular file first: a FIFO (or a device) in the
    file's place would otherwise block the first op call forever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _warn_once(f"paged_ops tuning cache {path} unreadable ({e}); ignored, shapes are tuned again")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _warn_once(f"paged_ops tuning cache {path} is not a regular file; ignored, shapes are tuned again")
            return None
        if st.st_size > MAX_FILE_BYTES:
            _warn_once(f"paged_ops tuning cache {path} is {st.st_size} bytes, over {MAX_FILE_BYTES}; ignored, "
                       "shapes are tuned again")
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        _warn_once(f"paged_ops tuning cache {path} unreadable ({e}); ignored, shapes are tuned again")
        return None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        _warn_once(f"paged_ops tuning cache {path} is not UTF-8 text ({e.reason} at byte {e.start}); ignored, "
                   "shapes are tuned again")
        return None


def _read_file(path: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(valid entries, entries this build cannot check) of the cache file; anything malformed is
    dropped with one warning per file.

    Never raises: not a regular file, not UTF-8, not JSON, nested too deeply for the parser, of
    the wrong shape, or entries that are not valid for their backend all read as "nothing stored".
    """
    text = _read_text(path)
    if text is None:
        return {}, {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError, MemoryError):  # RecursionError: "[[[[..." nested deeper than the parser goes
        _warn_once(f"paged_ops tuning cache {path} is not JSON (or nested too deeply); ignored, shapes are "
                   "tuned again")
        return {}, {}
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
        _warn_once(f"paged_ops tuning cache {path} is not a format-{FORMAT} tuning file; ignored, "
                   "shapes are tuned again")
        return {}, {}
    entries, foreign, bad = {}, {}, []
    cuda = cuda_available()
    for key, entry in data["entries"].items():
        if isinstance(entry, dict) and entry.get("backend") in _INT_KEYED and not cuda:
            foreign[key] = entry  # another build's (a home directory shared with a GPU machine)
            continue
        problem = _entry_problem(key, entry)
        if problem:
            bad.append((key, problem))
        else:
            entries[key] = entry
    if bad:
        key, problem = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        _warn_once(f"paged_ops tuning cache {path}: entry {_short(key)} ignored ({problem}){more}; "
                   "tuned again")
    return entries, foreign


def _read_entries(path: Path) -> dict[str, dict]:
    """The valid entries of the cache file (see ``_read_file``)."""
    return _read_file(path)[0]


def _entry_problem(identity, entry) -> str | None:
    if not isinstance(entry, dict):
        return "not an object"
    backend, op, version, device = (entry.get(k) for k in ("backend", "op", "version", "device"))
    if not all(isinstance(v, str) for v in (backend, op, version, device)):
        return "no backend/op/version/device"
    key = entry.get("key")
    if backend in _INT_KEYED:
        if not (isinstance(key, list) and all(_is_int(k) and 0 <= k < _INT32 for k in key)):
            return f"its shape key {_short(str(key))} is not a list of the extension's integers"
        if op in _TUNED_OPS:
            problem = _cuda_ops().tuning_key_problem(key, op)
            if problem:
                return f"its shape key {_short(str(key))}: {problem}"
    elif not (isinstance(key, list) and all(isinstance(k, str) for k in key)):
        return "its shape key is not a list of strings"
    problem = config_problem(backend, op, entry.get("config"))
    if problem:
        return problem
    if identity != entry_identity(backend, op, version, device, key):
        return "filed under another identity than its fields'"
    return None


def _write_entry(path: Path, key: str, entry: dict) -> None:
    # Merge with what other processes wrote since, then replace atomically (readers never see
    # half a file).
    path.parent.mkdir(parents=True, exist_ok=True)
    entries, foreign = _read_file(path)
    entries = {**foreign, **entries, key: entry}
    _replace(path, json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True), ".json")


def _remember(store, entry: str, record: dict) -> None:
    """A tuned record into ``store``'s entries and tuning.json; on a read-only home it holds for this
    process only (one warning)."""
    with _lock:
        store._entries()[entry] = record
        try:
            _write_entry(cache_path(), entry, record)
        except (OSError, ValueError) as e:
            _warn_once(f"paged_ops tuning cache {cache_path()} not writable ({e})")


def _replace(path: Path, text: str, suffix: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=suffix)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---- timing ---------------------------------------------------------------------------------

def time_gpu_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 2) -> float:
    """Mean device time of one ``fn()`` in ms: ``iters`` launches between ONE pair of CUDA events.

    One event pair per launch would time the host's launch latency as much as the kernel; a
    batch of back-to-back launches measures the device's throughput. GPU-only.
    """
    for _ in range(warmup):
        fn()  # compiles / lazy module load, outside the timed region
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def tuning_enabled() -> bool:
    """Time unseen shapes? Not under the Triton interpreter, not while a CUDA graph is being
    captured (timing launches and synchronizes), not with PAGED_OPS_AUTOTUNE=0 (or the older
    PAGED_OPS_TRITON_AUTOTUNE=0)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if "0" in (os.environ.get("PAGED_OPS_AUTOTUNE"), os.environ.get("PAGED_OPS_TRITON_AUTOTUNE")):
        return False
    return torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


# ---- the tuner ------------------------------------------------------------------------------

class Tuner:
    """Per (backend, op): in-memory memo -> persisted entry of this code version -> timing -> default."""

    def __init__(self, backend: str, op: str):
        self.backend, self.op = backend, op
        self._memo: dict[str, dict] = {}
        self._loaded_from: Path | None = None
        self._persisted: dict[str, dict] = {}

    def entry_key(self, device: str, key: Iterable) -> str:
        """The identity of this op's entry for ``key`` on ``device`` (see ``entry_identity``)."""
        return entry_identity(self.backend, self.op, code_version(self.backend), device, key)

    def _entries(self) -> dict[str, dict]:
        path = cache_path()
        if self._loaded_from != path:  # first use, or the cache dir moved (tests)
            self._persisted = _read_entries(path)
            self._loaded_from = path
            self._memo.clear()
        return self._persisted

    def _stored(self, entry: str) -> dict | None:
        found = self._entries().get(entry)
        return None if found is None else dict(found["config"])

    def lookup(self, device: str, key: Iterable) -> dict | None:
        """The stored config for a key, without timing anything (None if never tuned)."""
        entry = self.entry_key(device, key)
        with _lock:
            self._entries()  # first: a moved cache dir drops the memo
            found = self._memo.get(entry) or self._stored(entry)
            return None if found is None else dict(found)

    def choose(self, device: str, key: tuple, default: dict, candidates: list[dict],
               bench: Callable[[dict], float] | None, force: bool = False) -> dict:
        """The config for ``key``; records it as this op's last config.

        ``bench(config) -> ms`` (may raise: that candidate is dropped). Times only where
        ``tuning_enabled()`` or ``force`` (tests of the mechanism on CPU).
        """
        entry = self.entry_key(device, key)
        with _lock:
            self._entries()  # first: a moved cache dir drops the memo
            config, source = self._memo.get(entry), "memo"
            if config is None:
                config, source = self._stored(entry), "cache"
        if config is None:
            if bench is not None and candidates and (force or tuning_enabled()):
                config, ms = fastest(candidates, bench, default)
                source = "tuned"
                record = {"backend": self.backend, "op": self.op, "version": code_version(self.backend),
                          "device": device, "key": _stored_key(self.backend, key), "config": config,
                          "ms": None if ms is None else round(ms, 6)}
                _remember(self, entry, record)
            else:
                config, source = dict(default), "default"
            with _lock:
                self._memo[entry] = config
        _last[(self.backend, self.op)] = {"key": list(key), "config": dict(config), "source": source}
        return dict(config)


def fastest(candidates: list[dict], bench: Callable[[dict], float], default: dict) -> tuple[dict, float | None]:
    """(fastest candidate, its ms); the default (None) when no candidate ran."""
    best, best_ms = dict(default), None
    for config in candidates:
        try:
            ms = float(bench(config))
        except Exception:  # e.g. out of shared memory / registers for this tile on this GPU
            continue
        if math.isfinite(ms) and (best_ms is None or ms < best_ms):
            best, best_ms = dict(config), ms
    return best, best_ms


_TUNERS: dict[tuple[str, str], Tuner] = {}


def tuner(backend: str, op: str) -> Tuner:
    with _lock:
        if (backend, op) not in _TUNERS:
            _TUNERS[(backend, op)] = Tuner(backend, op)
        return _TUNERS[(backend, op)]


def last_config(backend: str, op: str) -> dict | None:
    """``{"key", "config", "source"}`` of the latest ``choose`` of (backend, op) in this process.

    source: "default" (no tuning: interpreter, disabled, nothing ran), "tuned" (timed now),
    "cache" (read from the file) or "memo" (reused in this process).
    """
    info = _last.get((backend, op))
    return None if info is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in info.items()}


# ---- the cuda backend -----------------------------------------------------------------------

def cuda_key(query, key_cache, block_tables, max_seqlen_q: int | None = None) -> tuple[int, ...]:
    """The extension's key of a decode (``max_seqlen_q`` None) or prefill call with these tensors:
    the key the kernels look their config up by."""
    decode = max_seqlen_q is None
    return tuple(_cuda_ops().tuning_key(query, key_cache, block_tables, 0 if decode else int(max_seqlen_q), decode))


def cuda_default() -> dict:
    """The kernels' own defaults (every field 0)."""
    return dict.fromkeys(cuda_config_fields(), 0)


def cuda_candidates(key: Iterable[int]) -> list[dict]:
    """The configs the tuner times for this key (csrc/cuda/tuning_candidates.h)."""
    fields = cuda_config_fields()
    flat = _cuda_ops().tuning_candidates(list(key))
    return [dict(zip(fields, flat[i:i + len(fields)])) for i in range(0, len(flat), len(fields))]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type  # cpu: the emulator / interpreter (tests)


def _cuda_tune(op: str, query, key_cache, block_tables, max_seqlen_q, run_with, backend: str, timer, reps: int,
               force: bool) -> dict:
    key = cuda_key(query, key_cache, block_tables, max_seqlen_q)
    measure = timer or (lambda fn: time_gpu_ms(fn, iters=reps))
    bench = lambda cfg: measure(lambda: run_with(_config_list(cfg)))  # noqa: E731
    cfg = tuner(backend, op).choose(device_name(query.device), key, cuda_default(), cuda_candidates(key), bench,
                                    force=force or timer is not None)
    if backend == "cuda" and _last[(backend, op)]["source"] != "default":
        _cuda_ops().set_tuned_configs(list(key), _config_list(cfg))
    return cfg


def tune_cuda_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=None,
                     v_scale=None, *, backend: str = "cuda", timer=None, reps: int = 20, force: bool = False) -> dict:
    """Choose the decode launch config for this shape (timing the candidates unless stored) and
    install it; ``out`` is overwritten. Times only where ``tuning_enabled()``, or with ``force``.

    ``backend="cuda_emu"`` runs the candidates on the emulator (tests; a ``timer(fn) -> ms`` must
    then order them).
    """
    ns = getattr(torch.ops, "paged_cuda_test" if backend == "cuda" else "paged_cuda_emu_test")
    run_with = lambda c: ns.decode_attention_config(out, query, key_cache, value_cache, block_tables,  # noqa: E731
                                                    seq_lens, scale, k_scale, v_scale, c)
    return _cuda_tune("decode_attention", query, key_cache, block_tables, None, run_with, backend, timer, reps, force)


def tune_cuda_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                      scale, causal, k_scale=None, v_scale=None, *, backend: str = "cuda", timer=None,
                      reps: int = 10, force: bool = False) -> dict:
    """Choose the prefill launch config for this shape (timing the candidates unless stored) and install it."""
    ns = getattr(torch.ops, "paged_cuda_test" if backend == "cuda" else "paged_cuda_emu_test")
    run_with = lambda c: ns.prefill_attention_config(out, query, key_cache, value_cache, block_tables,  # noqa: E731
                                                     cu_seqlens_q, seq_lens, max_seqlen_q, scale, causal,
                                                     k_scale, v_scale, c)
    return _cuda_tune("prefill_attention", query, key_cache, block_tables, max_seqlen_q, run_with, backend, timer,
                      reps, force)


def load() -> int:
    """Make the extension's tables hold exactly this build's stored ``cuda`` configs and current
    backend choices (``tune_backend``); returns how many entries it installed.

    Called at ``import paged_ops`` where a GPU is present (a new process uses earlier tuning
    without the tuner), and again by whoever moves ``PAGED_OPS_CACHE_DIR``. Never raises on a bad
    cache file (it is ignored with a warning); a stale entry (another version) stays in the file,
    not installed.
    """
    if not cuda_available():
        return 0
    stored = list(_read_entries(cache_path()).values())
    entries = [e for e in stored if e["backend"] == "cuda"]
    choices = [e for e in stored if e["backend"] == CHOICE]
    from . import _C
    try:
        if entries:  # hashing the extension costs a read of it: only when there is something to match
            version = code_version("cuda")
            entries = [e for e in entries if e["version"] == version]
        keys = [k for e in entries for k in e["key"]]
        configs = [v for e in entries for v in _config_list(e["config"])]
        _cuda_ops().set_tuned_configs(keys, configs, True)
        if choices:
            version = choice_version()
            choices = [e for e in choices if e["version"] == version]
        _C._set_backend_choices([k for e in choices for k in e["key"]], [e["config"]["backend"] for e in choices],
                                True)
    except ImportError:  # triton is gone: no choice can name it; the configs are in
        _C._set_backend_choices([], [], True)
        return len(entries)
    except (OSError, RuntimeError, ValueError) as e:  # the entries were checked: only an unreadable build
        _warn_once(f"paged_ops tuning cache {cache_path()}: not installed ({e})")
        return 0
    return len(entries) + len(choices)


# ---- the default backend of CUDA tensors: cuda or triton, per bucket -------------------------

def choice_version() -> str:
    """The code a backend choice was measured on: the ``cuda`` build's version (``code_version``)
    and the triton kernels' (triton's release and a hash of paged_ops/triton's sources), read
    without importing triton, so a GPU machine's ``import paged_ops`` stays fast. Raises
    ImportError without triton."""
    if "choice" not in _code_versions:
        try:
            release = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:  # installed under another distribution name
            import triton
            release = triton.__version__
        src = _hash_files((Path(__file__).parent / "triton").glob("*.py"))
        _code_versions["choice"] = f"{code_version('cuda')}|{_package_version()}+triton{release}+{src}"
    return _code_versions["choice"]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _bound_arguments(op: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by the schema's names (positional and keyword, as the op takes them)."""
    names = [a.name for a in getattr(torch.ops.paged, op).default._schema.arguments]
    if len(args) > len(names):
        raise TypeError(f"{op} takes at most {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names or name in bound:
            raise TypeError(f"{op}: unexpected or repeated argument {name!r}")
        bound[name] = value
    return bound


def tune_backend(op: str, *args, timer: Callable[[Callable[[], object]], float] | None = None, rounds: int = 7,
                 warmup: int = 3, iters: int = 10, budget_s: float = 10.0, cuda_backend: str = "cuda",
                 force: bool = False, clock: Callable[[], float] = time.perf_counter, **kwargs) -> dict:
    """Make the faster of ``cuda`` and ``triton`` the default backend of CUDA calls in this call's
    shape bucket (the ``cuda`` key: ``cuda_key``), timing both on this call unless a current entry
    is stored; returns ``{"backend", "times_ms", "source"}``.

    ``op`` is ``"decode_attention"`` or ``"prefill_attention"``, ``args`` / ``kwargs`` its
    arguments as ``torch.ops.paged.<op>`` takes them; each backend runs them validated
    (``paged_ops.backend(name)``), so ``out`` (and ``lse``) are overwritten. Timing: ``warmup``
    calls of each, then rounds, each backend once per round (their order alternating), each
    measurement ``timer(fn)`` in ms (default: ``time_gpu_ms`` of ``iters`` launches between one
    pair of CUDA events); a backend's time is the median of its rounds. ``rounds`` at most, and no
    round begins once ``budget_s`` seconds (by ``clock``, warm-ups included) have passed since the
    start: at least one always runs. A backend that raises is out (its time None). The winner (on
    a tie: cuda, the built-in default) is filed in tuning.json with both times and installed in the
    extension's choice table, which ``torch.ops.paged.<op>`` reads per call.

    Times only where ``tuning_enabled()``, with ``force``, or with a ``timer`` (tests, on CPU:
    ``cuda_backend="cuda_emu"`` runs the cuda kernels on the emulator in cuda's place; ``fn.backend``
    tells the timer which side it is timing). ``source``: "cache" (a stored entry, nothing timed),
    "tuned", or "default" (nothing timed, or neither ran: no entry, ``backend`` the built-in cuda).
    """
    if op not in _TUNED_OPS:
        raise ValueError(f"tune_backend: op must be one of {_TUNED_OPS}, got {op!r}")
    if not cuda_available():
        raise RuntimeError("tune_backend: this build has no cuda backend to time against triton")
    if not (_is_int(rounds) and rounds >= 1 and _is_int(warmup) and warmup >= 0):
        raise ValueError(f"tune_backend: rounds >= 1 and warmup >= 0, got {rounds}, {warmup}")
    from . import _C
    from .backends import backend as backend_of

    bound = _bound_arguments(op, args, kwargs)
    decode = op == "decode_attention"
    key = cuda_key(bound["query"], bound["key_cache"], bound["block_tables"],
                   None if decode else int(bound["max_seqlen_q"]))
    device = device_name(bound["query"].device)
    version = choice_version()
    identity = entry_identity(CHOICE, op, version, device, key)
    store = tuner(CHOICE, op)
    with _lock:
        stored = None if force else store._entries().get(identity)
    if stored is not None:
        _C._set_backend_choices(list(key), [stored["config"]["backend"]], False)
        times = stored.get("times_ms")  # informational: not checked with the entry
        return {"backend": stored["config"]["backend"], "times_ms": dict(times) if isinstance(times, dict) else {},
                "source": "cache"}
    if not (force or timer is not None or tuning_enabled()):
        return {"backend": "cuda", "times_ms": {}, "source": "default"}

    measure = timer or (lambda fn: time_gpu_ms(fn, iters=iters, warmup=0))
    runs: dict[str, Callable[[], object]] = {}
    for choice, name in (("cuda", cuda_backend), ("triton", "triton")):
        try:
            call = getattr(backend_of(name), op)
        except (RuntimeError, ValueError):  # not available here
            continue
        run = lambda call=call: call(*args, **kwargs)  # noqa: E731
        run.backend = choice
        runs[choice] = run

    start = clock()
    samples: dict[str, list[float]] = {choice: [] for choice in runs}
    for choice, run in list(runs.items()):
        try:
            for _ in range(warmup):
                run()  # compiles, lazy loads, caches: outside the timed rounds
        except Exception:  # e.g. a shape one backend does not take on this GPU
            del runs[choice]
    for r in range(rounds):
        if r and clock() - start >= budget_s:
            break
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for choice in order:
            try:
                ms = float(measure(runs[choice]))
            except Exception:
                ms = math.nan
            if math.isfinite(ms):
                samples[choice].append(ms)
    times = {choice: (round(_median(samples[choice]), 6) if samples.get(choice) else None) for choice in CHOICES}
    ran = [choice for choice in CHOICES if times[choice] is not None]
    if not ran:
        return {"backend": "cuda", "times_ms": times, "source": "default"}
    winner = min(ran, key=lambda c: (times[c], c != "cuda"))
    record = {"backend": CHOICE, "op": op, "version": version, "device": device, "key": _stored_key(CHOICE, key),
              "config": {"backend": winner}, "ms": times[winner], "times_ms": times,
              "rounds": min(len(samples[c]) for c in ran)}
    _remember(store, identity, record)
    _C._set_backend_choices(list(key), [winner], False)
    return {"backend": winner, "times_ms": times, "source": "tuned"}


def tuned_backends() -> dict[tuple[int, ...], str]:
    """The extension's installed backend choices: ``cuda`` key -> "cuda" / "triton"."""
    from . import _C
    return {tuple(key): name for key, name in _C._backend_choices()}


def cuda_tuned_config(query, key_cache, block_tables, max_seqlen_q: int | None = None) -> dict | None:
    """What the CUDA kernels will use for this shape: the table's config, or None (defaults)."""
    *config, tuned = _cuda_ops().tuned_config(list(cuda_key(query, key_cache, block_tables, max_seqlen_q)))
    return dict(zip(cuda_config_fields(), config)) if tuned else None

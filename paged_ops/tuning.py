"""One launch tuner for the attention kernels of the ``triton`` and ``cuda`` backends.

Both backends choose a launch configuration per *shape key*; this module times candidate
configurations of either backend, keeps the fastest per key in memory and persists it in one JSON
file, ``$PAGED_OPS_CACHE_DIR/tuning.json`` (default ``~/.cache/paged_ops``).

Every stored entry is keyed by backend, op, device name, a *code version* and the backend's
shape key. The code version is the package version plus a hash of the kernel code that runs (the
Triton sources for ``triton``; the built extension for ``cuda``), so a code change never reuses a
configuration measured for other code. Shape keys hold the dtypes, the cache layout (NHD / HND),
head counts, head size, block size and power-of-two length buckets.

The cache file is input from disk and is never trusted: a file that is not JSON, or JSON of the
wrong shape, or an entry whose config is not a valid config of its backend and op (``{}``,
``BLOCK_N: 0``, ``BLOCK_N: 3``) is ignored with one warning, and the shape is tuned again. Nothing
here can make ``import paged_ops`` or an op call fail.

GPU timing (``time_gpu_ms``) runs many launches between one pair of CUDA events, so host launch
overhead is amortized instead of timed. Tests drive the same logic on CPU with a ``timer``
argument (the interpreter / emulator run the candidates, a fake clock orders them); the
measurement itself is GPU-only.

The CUDA kernels read their configuration from the extension's registry
(``torch.ops.paged_cuda.set_tuned_config`` / ``tuned_config``), keyed by the extension's own
``tuning_key``; ``load()`` pushes the entries stored for this build into it, and the registry's
flat ``cuda_tuning.tsv`` (read by the extension at its first lookup) is rewritten from the valid
entries of this build only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

FILE_NAME = "tuning.json"
FORMAT = 2  # version of the file layout; a file of another format is ignored
TSV_NAME = "cuda_tuning.tsv"

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


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---- what a valid config is -----------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2_in(v, lo: int, hi: int) -> bool:
    return _is_int(v) and lo <= v <= hi and v & (v - 1) == 0


_WARPS = (1, 2, 4, 8, 16)
_SCHEMAS: dict[tuple[str, str], dict[str, Callable[[object], bool]]] = {
    ("triton", "decode_attention"): {
        "BLOCK_N": lambda v: _pow2_in(v, 16, 256),
        "num_warps": lambda v: v in _WARPS and _is_int(v),
        "num_stages": lambda v: _is_int(v) and 1 <= v <= 8,
        "split_scale": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and 0 < v <= 64,
    },
    ("triton", "prefill_attention"): {
        "BLOCK_M": lambda v: _pow2_in(v, 16, 256),
        "BLOCK_N": lambda v: _pow2_in(v, 16, 256),
        "num_warps": lambda v: v in _WARPS and _is_int(v),
        "num_stages": lambda v: _is_int(v) and 1 <= v <= 8,
    },
}
# CUDA: kernels/params.h LaunchConfig; 0 = the kernels' own default for that field.
_CUDA_SCHEMA = {
    "threads": lambda v: _is_int(v) and (v == 0 or (32 <= v <= 1024 and v % 32 == 0)),
    "partition": lambda v: _is_int(v) and (v in (-1, 0) or (16 <= v <= 1 << 20 and v % 16 == 0)),
    "kv_tile": lambda v: _is_int(v) and (v == 0 or _pow2_in(v, 8, 256)),
    "tc": lambda v: _is_int(v) and v in (-1, 0, 1),
}
for _op in ("decode_attention", "prefill_attention"):
    _SCHEMAS[("cuda", _op)] = _SCHEMAS[("cuda_emu", _op)] = _CUDA_SCHEMA


def config_problem(backend: str, op: str, config) -> str | None:
    """Why ``config`` is not a valid launch config of this backend and op (None: it is)."""
    schema = _SCHEMAS.get((backend, op))
    if schema is None:
        return f"no tuner for {backend}.{op}"
    if not isinstance(config, dict):
        return f"config is {type(config).__name__}, not an object"
    required = set(schema) - ({"split_scale"} if backend == "triton" else set())
    missing = required - set(config)
    if missing:
        return f"missing {sorted(missing)}"
    unknown = set(config) - set(schema)
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    for name, ok in schema.items():
        if name in config and not ok(config[name]):
            return f"{name}={config[name]!r} is out of range"
    return None


# ---- the file -------------------------------------------------------------------------------

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


def _read_entries(path: Path) -> dict[str, dict]:
    """Valid entries of the cache file; anything malformed is dropped with one warning per file.

    Never raises: not a regular file, not UTF-8, not JSON, nested too deeply for the parser, of
    the wrong shape, or entries that are not valid for their backend all read as "nothing stored".
    """
    text = _read_text(path)
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError, MemoryError):  # RecursionError: "[[[[..." nested deeper than the parser goes
        _warn_once(f"paged_ops tuning cache {path} is not JSON (or nested too deeply); ignored, shapes are "
                   "tuned again")
        return {}
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
        _warn_once(f"paged_ops tuning cache {path} is not a format-{FORMAT} tuning file; ignored, "
                   "shapes are tuned again")
        return {}
    entries, bad = {}, []
    for key, entry in data["entries"].items():
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
    return entries


# A key the CUDA registry stores: one whitespace-free token of printable ASCII (cuda_tuning.tsv is
# "key threads partition kv_tile tc" lines; csrc/cuda/tuning.h reads it).
_REGISTRY_KEY = re.compile(r"[!-~]{1,512}")


def _entry_problem(key, entry) -> str | None:
    if not isinstance(entry, dict):
        return "not an object"
    backend, op = entry.get("backend"), entry.get("op")
    if not isinstance(backend, str) or not isinstance(op, str):
        return "no backend/op"
    shape = entry.get("key")
    if not (isinstance(shape, list) and all(isinstance(k, str) for k in shape)):
        return "its shape key is not a list of strings"
    if backend in ("cuda", "cuda_emu") and not (shape and _REGISTRY_KEY.fullmatch(shape[0])):
        return f"its registry key {_short(shape[0]) if shape else '(none)'} is not one printable token"
    return config_problem(backend, op, entry.get("config"))


def _write_entry(path: Path, key: str, entry: dict) -> None:
    # Merge with what other processes wrote since, then replace atomically (readers never see
    # half a file).
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read_entries(path)
    entries[key] = entry
    _replace(path, json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True), ".json")


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
        return "|".join([self.backend, self.op, device, code_version(self.backend), *map(str, key)])

    def _entries(self) -> dict[str, dict]:
        path = cache_path()
        if self._loaded_from != path:  # first use, or the cache dir moved (tests)
            self._persisted = _read_entries(path)
            self._loaded_from = path
            self._memo.clear()
        return self._persisted

    def _stored(self, entry: str) -> dict | None:
        found = self._entries().get(entry)
        if found is None or found.get("backend") != self.backend or found.get("op") != self.op:
            return None
        return dict(found["config"])

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
                record = {"backend": self.backend, "op": self.op, "device": device, "key": list(map(str, key)),
                          "config": config, "ms": None if ms is None else round(ms, 6)}
                with _lock:
                    self._entries()[entry] = record
                    try:
                        _write_entry(cache_path(), entry, record)
                    except (OSError, ValueError) as e:  # read-only home: keep the choice for this process
                        _warn_once(f"paged_ops tuning cache {cache_path()} not writable ({e})")
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

# threads per block x split-KV partition size (tokens); partition -1 = one-pass kernel only.
CUDA_DECODE_CANDIDATES = [dict(threads=t, partition=p, kv_tile=0, tc=0)
                          for t in (64, 128, 256) for p in (256, 512, 1024, -1)]
# KV tokens per shared-memory staging step of the decode kernel for query groups > 8.
CUDA_DECODE_SHARED_KV_TILES = (32, 64)
# The tensor-core kernel (fixed 128 threads; fp16/bf16 only), then the CUDA-core kernel's threads
# per block x KV tokens per shared-memory tile.
CUDA_PREFILL_CANDIDATES = [dict(threads=0, partition=0, kv_tile=0, tc=1)] + [
    dict(threads=t, partition=0, kv_tile=k, tc=-1) for t in (64, 128, 256) for k in (16, 32, 64)]
CUDA_DEFAULT = dict(threads=0, partition=0, kv_tile=0, tc=0)


def _cuda_ops():
    return torch.ops.paged_cuda


def cuda_available() -> bool:
    """The extension was built with the CUDA backend (its registry ops exist)."""
    try:
        _cuda_ops().tuning_key  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def cuda_registry_key(query, key_cache, block_tables, max_seqlen_q: int | None) -> str:
    """The key the CUDA kernels look their config up by (computed by the extension itself)."""
    decode = max_seqlen_q is None
    return _cuda_ops().tuning_key(query, key_cache, block_tables, 0 if decode else int(max_seqlen_q), decode)


def cuda_shape_key(query, key_cache, block_tables, max_seqlen_q: int | None) -> tuple:
    """The registry key plus what it leaves out: head counts and the cache layout."""
    return (cuda_registry_key(query, key_cache, block_tables, max_seqlen_q), f"h{query.shape[1]}",
            f"kvh{key_cache.shape[2]}", cache_layout(key_cache))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type  # cpu: the emulator / interpreter (tests)


def _config_list(cfg: dict) -> list[int]:
    # paged_cuda_test.*_config: [threads, partition_size, kv_tile, force_split, tensor_cores]
    return [cfg["threads"], cfg["partition"], cfg["kv_tile"], 0, cfg["tc"]]


def _set_registry(registry_key: str, cfg: dict) -> None:
    _cuda_ops().set_tuned_config(registry_key, cfg["threads"], cfg["partition"], cfg["kv_tile"], cfg["tc"])


def _cuda_tune(op: str, query, key_cache, block_tables, max_seqlen_q, candidates, run_with,
               backend: str, timer, reps: int, force: bool) -> dict:
    tn = tuner(backend, op)
    device = device_name(query.device)
    key = cuda_shape_key(query, key_cache, block_tables, max_seqlen_q)
    measure = timer or (lambda fn: time_gpu_ms(fn, iters=reps))
    bench = lambda cfg: measure(lambda: run_with(_config_list(cfg)))  # noqa: E731
    cfg = tn.choose(device, key, CUDA_DEFAULT, candidates, bench, force=force or timer is not None)
    if backend == "cuda":
        _set_registry(key[0], cfg)
        _sync_tsv()
    return cfg


def tune_cuda_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=None,
                     v_scale=None, *, backend: str = "cuda", timer=None, reps: int = 20, force: bool = False) -> dict:
    """Choose the decode launch config for this shape (timing candidates unless stored) and install it.

    ``out`` is overwritten. ``backend="cuda_emu"`` runs the candidates on the emulator (tests; a
    ``timer(fn) -> ms`` must then order them).
    """
    ns = getattr(torch.ops, "paged_cuda_test" if backend == "cuda" else "paged_cuda_emu_test")
    run_with = lambda c: ns.decode_attention_config(out, query, key_cache, value_cache, block_tables,  # noqa: E731
                                                    seq_lens, scale, k_scale, v_scale, c)
    candidates = CUDA_DECODE_CANDIDATES
    if query.size(1) // key_cache.size(2) > 8:
        # Groups > 8 run the shared-KV kernel, whose staging chunk trades shared memory (blocks
        # per SM) against barriers per token.
        candidates = [dict(c, kv_tile=k) for c in candidates for k in CUDA_DECODE_SHARED_KV_TILES]
    return _cuda_tune("decode_attention", query, key_cache, block_tables, None, candidates, run_with,
                      backend, timer, reps, force)


def tune_cuda_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                      scale, causal, k_scale=None, v_scale=None, *, backend: str = "cuda", timer=None,
                      reps: int = 10, force: bool = False) -> dict:
    """Choose the prefill launch config for this shape (timing candidates unless stored) and install it."""
    ns = getattr(torch.ops, "paged_cuda_test" if backend == "cuda" else "paged_cuda_emu_test")
    run_with = lambda c: ns.prefill_attention_config(out, query, key_cache, value_cache, block_tables,  # noqa: E731
                                                     cu_seqlens_q, seq_lens, max_seqlen_q, scale, causal,
                                                     k_scale, v_scale, c)
    return _cuda_tune("prefill_attention", query, key_cache, block_tables, max_seqlen_q, CUDA_PREFILL_CANDIDATES,
                      run_with, backend, timer, reps, force)


def _sync_tsv() -> None:
    """Rewrite the registry's flat file from this build's valid entries only (stale and invalid
    entries never reach the extension's loader)."""
    path = cache_dir() / TSV_NAME
    version = code_version("cuda")
    lines = []
    for k, entry in sorted(_read_entries(cache_path()).items()):
        if entry["backend"] != "cuda" or f"|{version}|" not in k:
            continue
        c = entry["config"]
        lines.append(f"{entry['key'][0]} {c['threads']} {c['partition']} {c['kv_tile']} {c['tc']}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace(path, "".join(line + "\n" for line in lines), ".tsv")
    except OSError as e:
        _warn_once(f"paged_ops: cannot write {path} ({e})")


def load() -> int:
    """Install this build's stored CUDA configs into the extension's registry; returns how many.

    Never raises on a bad cache file (it is ignored with a warning).
    """
    if not cuda_available():
        return 0
    version = code_version("cuda")
    n = 0
    for k, entry in _read_entries(cache_path()).items():
        # _read_entries checked the entry: key[0] is one printable token, the config is valid.
        if entry["backend"] == "cuda" and f"|{version}|" in k:
            try:
                _set_registry(entry["key"][0], entry["config"])
            except (RuntimeError, ValueError, TypeError) as e:
                _warn_once(f"paged_ops tuning cache {cache_path()}: entry {_short(k)} not installed ({e})")
                continue
            n += 1
    _sync_tsv()
    return n


def cuda_tuned_config(query, key_cache, block_tables, max_seqlen_q: int | None = None) -> dict | None:
    """What the CUDA kernels will use for this shape: the registry's config, or None (defaults)."""
    threads, partition, kv_tile, tc, tuned = _cuda_ops().tuned_config(
        cuda_registry_key(query, key_cache, block_tables, max_seqlen_q))
    return dict(threads=threads, partition=partition, kv_tile=kv_tile, tc=tc) if tuned else None

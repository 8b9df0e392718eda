"""Shared pieces of the measurement suite: machine identity, the results file, peaks, plots, tables.

Everything here is a small pure function (or a thin writer) so the benchmarks and the smoke test
call the same code. Numbers are only ever compared with a peak measured in the same process:
the development machine is shared, so absolute numbers drift between runs, ratios much less.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import socket
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

RESULTS_DIR = Path(os.environ.get("PAGED_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))

# Backends that run the kernels on this machine but are correctness tools, never timed:
# the CUDA emulator runs CUDA kernels on fibers on the CPU, the Triton interpreter runs
# Triton kernels in numpy.
CORRECTNESS_ONLY = {
    "cuda_emu": "CUDA emulator on CPU (correctness only)",
    "triton-interpreter": "TRITON_INTERPRET=1 runs kernels in numpy (correctness only)",
}

STREAM_NOTE = ("copy bandwidth = (bytes read + bytes written) / time of a large dst.copy_(src), "
               "the STREAM 'Copy' convention")


# ---------------------------------------------------------------- machine identity

def cpu_name() -> str:
    """Model name of the CPU from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """The GPU's name where one is visible, else the CPU's."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()


def slug(text: str) -> str:
    """Lower-case, dash-separated, filesystem-safe."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_id() -> str:
    """hostname + device name, e.g. 'vm-amd-epyc' or 'node1-nvidia-h200'."""
    return f"{slug(socket.gethostname().split('.')[0])}-{slug(device_name())}"


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


# When this process (one benchmark run) started: every file the run writes carries it, so a second
# run never overwrites the first, and a run's JSON and plots share one name.
RUN_STARTED = _dt.datetime.now(_dt.timezone.utc)


def run_stamp() -> str:
    return RUN_STARTED.strftime("%Y%m%dT%H%M%SZ")


def commit_tag(state: dict | None = None) -> str:
    """The short commit, '-dirty' when the working tree's tracked files differed from it."""
    state = git_state() if state is None else state
    commit = (state.get("commit") or "nogit")[:10]
    return commit + ("-dirty" if state.get("modified_files") else "")


def cpu_isa() -> str:
    """The cpu backend's active instruction set (csrc/cpu/isa.h), or 'n/a' without the extension."""
    try:
        import paged_ops  # noqa: F401  (loads the extension)
        return str(torch.ops.paged_cpu.isa())
    except (ImportError, AttributeError, RuntimeError):
        return "n/a"


def bench_threads() -> int | None:
    """PAGED_BENCH_THREADS, if set: the CPU thread count for the session (torch and the OpenMP
    kernels). On the shared 2-core machine a 2-thread OpenMP region waits for a time slice
    whenever another process holds the second core; one thread measures the kernel, not that."""
    n = os.environ.get("PAGED_BENCH_THREADS")
    return int(n) if n else None


def results_path(suffix: str = ".json") -> Path:
    """bench/results/<machine>-<run start, UTC>-<commit>[-dirty][-<n>threads]<suffix>: one file
    per run (the thread count only when PAGED_BENCH_THREADS is set; the directory overridable by
    PAGED_BENCH_RESULTS)."""
    threads = f"-{bench_threads()}threads" if bench_threads() else ""
    return RESULTS_DIR / f"{machine_id()}-{run_stamp()}-{commit_tag()}{threads}{suffix}"


def machine_info() -> dict:
    """What a reader needs to reproduce or discount a number."""
    info = {"machine": machine_id(), "hostname": socket.gethostname(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_started_utc": RUN_STARTED.isoformat(timespec="seconds"), "cpu_isa": cpu_isa(),
            "llc_bytes": last_level_cache_bytes("cpu"),
            # the dev machine is shared: the load when the file was written says how quiet it was
            "loadavg_1m_5m_15m": os.getloadavg(), "git": git_state()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpu_memory_bytes": p.total_memory, "gpu_l2_bytes": last_level_cache_bytes("cuda")}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def git_state() -> dict:
    """The commit the numbers come from, and whether the (shared) working tree differed from it."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.split("\n")
        return {"commit": head, "modified_files": [line[3:] for line in dirty if line.strip()]}
    except OSError:
        return {}


def last_level_cache_bytes(device: str) -> int:
    """Size of the cache the rotating inputs must overflow: the GPU's L2, or the CPU's largest
    cache level in sysfs (32 MiB if sysfs says nothing: a conservative modern L3)."""
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20))
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]])
    return max(sizes, default=32 << 20)


# ---------------------------------------------------------------- timing helpers

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rotation_count(set_bytes: int, device: str, min_sets: int = 2, max_sets: int = 64,
                   budget_bytes: int | None = None) -> int:
    """How many input sets to cycle so that together they are >= 4x the last-level cache (a set
    is then evicted before it comes round again; 4x rather than 2x because a VM's sysfs may
    understate the host's cache), within a memory budget."""
    need = math.ceil(4 * last_level_cache_bytes(device) / max(set_bytes, 1))
    n = max(min_sets, min(max_sets, need))
    if budget_bytes:
        n = max(1, min(n, budget_bytes // max(set_bytes, 1)))
    return n


def cycling(items: list) -> Callable[[], object]:
    """A zero-argument function returning the items round-robin (the rotating inputs)."""
    state = {"i": -1}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]
    return nxt


def interleaved_best(calls: dict[str, tuple[Callable, list]], rounds: int, device: str = "cpu") -> dict[str, float]:
    """Seconds of the fastest round of each named call, the calls taken in turn round by round
    (A, B, C, A, B, C...), each round on the next of its rotating input sets (calls[name] = (fn,
    sets), fn(*set)); one untimed warm-up round first. Interleaving gives every call the same
    shared machine; a round that lost the CPU is only ever slower, so the fastest is the call's
    own cost. device "cuda": each round synchronizes before and after, so it times the kernels."""
    nexts = {name: cycling(sets) for name, (_, sets) in calls.items()}
    for name, (fn, _) in calls.items():
        fn(*nexts[name]())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, (fn, _) in calls.items():
            args = nexts[name]()
            sync(device)
            t = time.perf_counter()
            fn(*args)
            sync(device)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def rounds_for(one_call_s: float, target_s: float, lo: int = 3, hi: int = 30) -> int:
    """Rounds for about target_s seconds of one call's timing, within [lo, hi]."""
    return int(min(hi, max(lo, target_s / max(one_call_s, 1e-6))))


def copy_peak_gbps(nbytes: int = 512 << 20, rounds: int = 10) -> float:
    """STREAM-style copy bandwidth of the CPU, (read + write bytes) / fastest dst.copy_(src) of
    nbytes (>> the last-level cache), as bench/test_kernels.py's peak (STREAM_NOTE)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = interleaved_best({"copy": (lambda s, d: d.copy_(s), [(src, dst), (dst, src)])}, rounds)["copy"]
    return 2 * nbytes / best / 1e9


def matmul_peak_tflops(n: int = 2048, rounds: int = 5) -> float:
    """bf16 torch.mm TFLOP/s (2 n^3 / fastest call) on the CPU, as bench/test_kernels.py's peak."""
    g = torch.Generator().manual_seed(0)
    sets = [(torch.randn(n, n, generator=g).bfloat16(), torch.randn(n, n, generator=g).bfloat16()) for _ in range(2)]
    out = torch.empty(n, n, dtype=torch.bfloat16)
    best = interleaved_best({"mm": (lambda a, b: torch.mm(a, b, out=out), sets)}, rounds)["mm"]
    return 2 * n ** 3 / best / 1e12


def markdown_table(header: list[str], rows: Iterable[list]) -> str:
    """A Markdown table (floats by fmt), for output pasted into bench/README.md."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- results file

def load_results(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_section(name: str, payload, path: Path | None = None) -> Path:
    """Write one section (kernels / engine / kv_waste) into this run's results file (sections
    written earlier in the same run are kept; another run writes its own file)."""
    path = path or results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_results(path)
    data["machine_info"] = machine_info()
    data[name] = payload
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


# ---------------------------------------------------------------- tables and plots

def fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)


def table(rows: Iterable[dict], columns: list[str]) -> str:
    """A plain-text table (fixed-width columns) of the given keys of rows."""
    rows = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(x.rjust(w) for x, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows])


# What each op's rate counts, one plot panel per kind: rates with different accounting never share an axis.
RATE_KINDS = {
    "decode_attention": ("gbps", "decode: GB/s of KV cache read"),
    "reshape_and_cache": ("gbps", "cache ops: GB/s read + written"),
    "copy_blocks": ("gbps", "cache ops: GB/s read + written"),
    "swap_blocks": ("gbps", "cache ops: GB/s read + written"),
    "quantize_fp8": ("gbps", "cache ops: GB/s read + written"),
    "dequantize_fp8": ("gbps", "cache ops: GB/s read + written"),
    "merge_attention_states": ("gbps", "cache ops: GB/s read + written"),
    "prefill_attention": ("tflops", "prefill: TFLOP/s (causal attention)"),
}


def shape_text(r: dict) -> str:
    """A sweep's fixed shape, e.g. '16 seqs x 2048 tok, 32/8 heads, d128, bfloat16 (fp8_e4m3 cache)'."""
    cache = f" ({r['cache_dtype']} cache)" if r.get("cache_dtype") else ""
    layers = f", {r['num_layers']} layers" if r.get("num_layers", 1) > 1 else ""
    return (f"{r['num_seqs']} seqs x {r['context_len']} tok, {r['num_heads']}/{r['num_kv_heads']} heads, "
            f"d{r['head_size']}, {r['dtype']}{cache}{layers}")


def plot_title(info: dict) -> str:
    """Machine, threads, the cpu ISA, commit and run start: what makes two plots comparable."""
    return (f"{info.get('machine', machine_id())}, {info.get('torch_threads', torch.get_num_threads())} threads, "
            f"cpu ISA {info.get('cpu_isa', 'n/a')}, commit {commit_tag(info.get('git') or {})}, "
            f"run {info.get('run_started_utc', RUN_STARTED.isoformat(timespec='seconds'))}")


def plot_block_sweeps(records: list[dict], peak_gbps: float | None, path: Path,
                      info: dict | None = None) -> Path | None:
    """Achieved rate against block size, one line per (op, backend, shape) block sweep, one panel
    per kind of rate (RATE_KINDS), y axes from 0; the copy bandwidth as a dashed line on the GB/s
    panels. info: the run's machine_info (default: this process's). Returns the PNG path (None if
    there was no sweep). Re-plot a results file: ``python -m bench.common bench/results/X.json``."""
    panels: dict[str, dict[tuple, list]] = {}
    for r in records:
        if r.get("sweep") != "block_size" or r["backend"].startswith("torch-") or r["op"] not in RATE_KINDS:
            continue
        key, kind = RATE_KINDS[r["op"]]
        panels.setdefault(kind, {}).setdefault((r["op"], r["backend"], shape_text(r)), []).append(
            (r["block_size"], r[key]))
    if not panels:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 3.6 * len(panels)), squeeze=False)
    for ax, (kind, sweeps) in zip(axes[:, 0], sorted(panels.items())):
        shapes = {shape for _, _, shape in sweeps}
        for (op, backend, shape), pts in sorted(sweeps.items()):
            pts.sort()
            label = f"{op} [{backend}]" + (f" {shape}" if len(shapes) > 1 else "")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if peak_gbps and "GB/s" in kind:
            ax.axhline(peak_gbps, ls="--", color="gray", label=f"copy {peak_gbps:.1f} GB/s (read+write)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(kind.split(": ", 1)[1])
        ax.set_title(kind + (f" - {next(iter(shapes))}" if len(shapes) == 1 else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(plot_title(info or machine_info()), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # re-plot a results file (same function as the session end)
    import sys
    src = Path(sys.argv[1])
    data = json.loads(src.read_text())
    k = data["kernels"]
    peak = (k["peaks"].get("cuda") or k["peaks"].get("cpu") or {}).get("copy_gbps")
    print(plot_block_sweeps(k["rows"], peak, src.with_name(src.stem + "-bandwidth.png"), data.get("machine_info")))

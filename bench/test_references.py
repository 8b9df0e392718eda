"""Torch's own attention on the kernel benchmarks' shapes (bench.references), recorded in the
same session table as backends named torch-*: prefill vs SDPA flash (contiguous), decode vs
FlexAttention paged decode (GPU). Only block-size-16 cases: the references do not page by our blocks."""
from __future__ import annotations

import time

import pytest
import torch

from bench import kernels as K
from bench import references as R
from bench.test_kernels import CASES, DEVICES, _pedantic, _rounds, seconds

PREFILL = [c for c in CASES if c.op == "prefill_attention" and c.block_size == 16]
DECODE = [c for c in CASES if c.op == "decode_attention" and c.sweep == "block_size" and c.block_size == 16]


def _time_reference(benchmark, bench_results, name, case, device, build):
    runs = [build(case, device, seed=i) for i in range(2)]
    sets = [(r,) for r in runs]
    t = time.perf_counter()
    runs[0]()  # compiles where it compiles; also the first-touch warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    rounds = _rounds(time.perf_counter() - t)
    _pedantic(benchmark, lambda run: run(), sets, device, rounds)
    if benchmark.stats:
        row = K.record(case, name, seconds(benchmark), rounds, len(sets)) | {"device": device,
                                                                              "median_s": benchmark.stats.stats.median}
        bench_results["kernels"].append(row)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", PREFILL, ids=lambda c: c.id)
def test_sdpa_flash_prefill(benchmark, bench_results, case, device):
    if case.cache_dtype:
        pytest.skip("SDPA has no fp8 KV")
    _time_reference(benchmark, bench_results, "torch-sdpa-flash", case, device, R.sdpa_flash_prefill)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention paged decode is timed on the GPU only")
@pytest.mark.parametrize("case", DECODE, ids=lambda c: c.id)
def test_flex_paged_decode(benchmark, bench_results, case):
    try:
        import torch.nn.attention.experimental._paged_attention  # noqa: F401
    except ImportError as e:
        pytest.skip(f"FlexAttention paged attention not importable: {e}")
    _time_reference(benchmark, bench_results, "torch-flex-paged", case, "cuda", R.flex_paged_decode)

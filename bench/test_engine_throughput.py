"""Engine vs transformers generate throughput (bench.engine_throughput), as part of `make bench`.

Skipped unless benchmarks are enabled (--benchmark-enable): it takes minutes on 2 cores.
"""
from __future__ import annotations

import pytest

from bench import engine_throughput as E


def _enabled(config) -> bool:
    return config.getoption("benchmark_enable") or not config.getoption("benchmark_disable")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, request):
    if not _enabled(request.config):
        pytest.skip("engine throughput runs with --benchmark-enable (make bench)")
    return E.make_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("variant", list(E.VARIANTS))
def test_engine_throughput(model_dir, bench_results, variant):
    row = E.compare(model_dir, variant)
    rows = bench_results["sections"].get("engine", ({"rows": []}, ""))[0]["rows"] + [row]
    payload = {"rows": rows, "model": E.MODEL, "hf_batch": E.HF_BATCH,
               "command": "make bench  (or: python -m bench.engine_throughput --save)"}
    bench_results["sections"]["engine"] = (payload, E.summary(rows))
    assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0
    if variant == "shared-prefix":
        assert row["prefix_hit_rate"] > 0.5, "a shared 192-token prefix should mostly hit the prefix cache"

"""KV memory waste sweep (bench.kv_waste): static reservation vs the engine's block manager."""
from __future__ import annotations

from bench import kv_waste as W


def test_kv_waste(bench_results):
    rows = W.sweep(W.make_trace(256))
    payload = {"rows": rows, "max_model_len": W.MAX_MODEL_LEN, "requests": 256,
               "command": "make bench  (or: python -m bench.kv_waste --save)"}
    bench_results["sections"]["kv_waste"] = (payload, W.summary(rows))
    for r in rows:  # even 256-token blocks waste less than reserving max_model_len per request
        assert r["paged_util"] > r["static-max_util"]

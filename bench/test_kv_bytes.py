"""KV bytes per token (bench.kv_bytes): DeepSeek-V3's latent cache against its per-head cache."""
from __future__ import annotations

from bench import kv_bytes as K


def test_kv_bytes(bench_results):
    rows = K.rows()
    bench_results["sections"]["kv_bytes"] = ({"rows": rows, "command": "python -m bench.kv_bytes --save"},
                                             K.summary(rows))
    latent, per_head, latent_fp8, per_head_fp8 = rows
    assert [r["dtype"] for r in rows] == ["bfloat16"] * 2 + ["float8_e4m3fn"] * 2
    # bf16: one 512 + 64 row per token and layer, against 128 heads x (128 + 64 keys + 128 values)
    assert latent["bytes/token/layer"] == (512 + 64) * 2
    assert per_head["bytes/token/layer"] == 128 * (128 + 64 + 128) * 2
    assert per_head["x latent"] > 70
    assert latent["KiB/token (all layers)"] == 61 * 576 * 2 / 1024
    assert latent_fp8["bytes/token/layer"] == 576 and per_head_fp8["bytes/token/layer"] == 128 * 320

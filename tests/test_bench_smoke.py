"""Smoke test of the measurement suite (bench/): every benchmark's code path once, at tiny sizes,
so a broken benchmark fails CI rather than the next `make bench`. About 30-40 s on 2 cores."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paged_ops
from bench import engine_throughput as E
from bench import kv_waste as W

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_benchmarks_write_results(tmp_path):
    """The pytest-benchmark session at the smoke profile: every op timed on every timing backend,
    peaks measured, JSON + PNG written, correctness-only backends excluded."""
    env = os.environ | {"PAGED_BENCH_PROFILE": "smoke", "PAGED_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "bench/test_kernels.py", "bench/test_references.py", "--benchmark-enable",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "paged-ops bench: kernel microbenchmarks" in proc.stdout  # the summary table was printed
    [result] = tmp_path.glob("*.json")
    assert list(tmp_path.glob("*-bandwidth.png")), "no plot written"
    k = json.loads(result.read_text())["kernels"]
    timed = {r["backend"] for r in k["rows"]}
    assert timed and not timed & {"cuda_emu"}, timed
    assert "cuda_emu" not in paged_ops.available_backends() or "cuda_emu" in k["excluded_backends"]
    assert k["peaks"]["cpu"]["copy_gbps"] > 0
    assert {r["op"] for r in k["rows"]} == set(paged_ops.OPS)
    assert {r["block_size"] for r in k["rows"] if r["sweep"] == "block_size"} == {1, 16}
    for r in k["rows"]:
        assert r["seconds"] > 0 and math.isfinite(r["gbps"]) and r["gbps"] > 0, r
        assert math.isfinite(r["share_of_peak"]), r


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return E.make_checkpoint(str(tmp_path_factory.mktemp("smoke-llama")), model=E.SMOKE_MODEL)


@pytest.mark.parametrize("variant", list(E.VARIANTS))
def test_engine_throughput_runs(tiny_model, variant):
    """Both systems generate exactly the requested tokens (run_engine asserts it for the engine);
    in float32 greedy on the same weights they must agree on the first token of every request."""
    row = E.compare(tiny_model, variant, dtype="float32", scale=0.1, vocab=E.SMOKE_MODEL["vocab_size"], repeats=1)
    assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["ratio"] > 0
    assert row["first_token_agreement"] == 1.0, row
    assert row["preemptions"] == 0
    if variant == "shared-prefix":
        assert row["prefix_hit_rate"] > 0.3, row
    else:
        assert row["prefix_hit_rate"] == 0.0, row  # random prompts share nothing
    assert "ratio" in E.summary([row])


def test_kv_waste_orders_policies():
    """Block size 1 wastes nothing; bigger blocks waste more; static policies rank max < pow2 < oracle."""
    rows = W.sweep(W.make_trace(32, seed=3), block_sizes=(1, 16, 256))
    assert rows[0]["paged_util"] == 1.0
    utils = [r["paged_util"] for r in rows]
    assert utils == sorted(utils, reverse=True) and utils[-1] < 1.0
    for r in rows:
        assert 0 < r["static-max_util"] < r["static-pow2_util"] <= r["static-oracle_util"] <= 1.0, r
    assert "paged_util" in W.summary(rows)


def test_flex_reference_is_paged_decode():
    """The FlexAttention reference the GPU decode is compared with computes paged decode: its
    output matches softmax(q K^T / sqrt(d)) V over each sequence's pages (CPU, compiled, ~10 s)."""
    import torch
    from bench.kernels import Case
    from bench.references import flex_paged_decode
    c = Case("decode_attention", "base", num_seqs=3, context_len=200, num_heads=4, num_kv_heads=2,
             head_size=64, dtype="float32")
    run = flex_paged_decode(c, "cpu", seed=0)
    out, i = run(), run.inputs
    pos = torch.arange(c.context_len)
    for b in range(c.num_seqs):
        phys = i["page_table"][b, pos // i["page_size"]] * i["page_size"] + pos % i["page_size"]
        k = i["k_cache"][0][:, phys].repeat_interleave(c.group, 0)
        v = i["v_cache"][0][:, phys].repeat_interleave(c.group, 0)
        w = torch.softmax(torch.einsum("hd,hld->hl", i["q"][b, :, 0], k) * c.head_size ** -0.5, -1)
        torch.testing.assert_close(out[b, :, 0], torch.einsum("hl,hld->hd", w, v), rtol=1e-4, atol=1e-5)


def test_device_check_script_parses():
    """bench/device_check.sh is valid bash (its GPU path only runs on a GPU machine)."""
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "device_check.sh")], check=True)


def _run_bench_module(module: str, tmp_path, *args) -> dict:
    """python -m <module> --smoke --save in a fresh process (its thread count and results file
    stay out of this one); the saved results file's JSON."""
    env = os.environ | {"PAGED_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", module, "--smoke", "--save", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [result] = tmp_path.glob("*.json")
    return json.loads(result.read_text())


def test_variants_benchmark_runs(tmp_path):
    """bench.variants (issue #13): the window benchmark times cpu and cuda_emu with and without a
    window (and itself asserts that the window changed the output where L > W), the batch-invariant
    benchmark times decode and prefill in and out of the mode; rows and ratios are written."""
    v = _run_bench_module("bench.variants", tmp_path)["variants"]
    window = [r for r in v["window"] if r["backend"] == "cpu"]
    assert [r["context_len"] for r in window] == [64, 256]
    for r in window + [r for r in v["window"] if r["backend"] == "cuda_emu"]:
        assert r["status"] == "ok", r
        assert r["seconds_full"] > 0 and r["seconds_window"] > 0 and r["window_vs_first"] > 0, r
        assert r["seconds_window_blocks_alone"] > 0 and r["window_vs_alone"] > 0, r  # the control ran
    assert {r["op"] for r in v["batch_invariant"]} == {"decode_attention", "prefill_attention"}
    for r in v["batch_invariant"]:
        assert r["status"] == "ok" and r["seconds_in"] > 0 and r["seconds_out"] > 0 and r["cost"] > 0, r


def test_variants_tables_say_what_is_missing():
    """A backend without an argument yet gets a row saying so instead of a time."""
    from bench import variants as V
    row = {"backend": "x", "num_seqs": 1, "num_heads": 4, "num_kv_heads": 2, "head_size": 32, "dtype": "bfloat16",
           "block_size": 16, "context_len": 64, "window": 32, "status": "not implemented: window_left"}
    assert "not implemented: window_left" in V.window_table([row])
    assert "not implemented: window_left" in V.batch_invariant_table([row | {"op": "decode_attention"}])


def test_vllm_kernels_benchmark_runs(tmp_path):
    """bench.vllm_kernels (issue #14 item 3): our rows always; vLLM's (checked against the float64
    reference before timing) where vllm imports, else the run says it does not."""
    k = _run_bench_module("bench.vllm_kernels", tmp_path)["vllm_kernels"]
    assert {r["op"] for r in k["rows"]} == {"decode_attention", "prefill_attention"}
    for r in k["rows"]:
        assert r["rate_paged_ops"] > 0 and r["paged_ops_isa"] not in ("", "n/a"), r
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert k["vllm"].startswith("vllm not importable"), k["vllm"]
    else:
        for r in k["rows"]:
            assert r["rate_vllm"] > 0 and r["ratio"] > 0 and r["vllm_check_rel_err"] <= 1e-2, r


def test_vllm_mla_benchmark_runs(tmp_path):
    """bench.vllm_mla (issue #24 item 3): the absorbed MLA decode, our rows always (checked against the
    float64 reference before timing); vLLM's where it imports, else the run says it does not."""
    m = _run_bench_module("bench.vllm_mla", tmp_path, "--threads", "1")["vllm_mla"]
    assert {r["block_size"] for r in m["rows"]} == {16, 64}
    for r in m["rows"]:
        assert r["gbps_paged_ops"] > 0 and r["paged_ops_check_rel_err"] <= 1e-2, r
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert m["vllm"].startswith("vllm not importable"), m["vllm"]

"""Smoke test of bench.vllm_mla (issue #24 item 3) at tiny shapes: our rows always, checked
against the float64 reference before timing; vLLM's where it imports (block 16 only for its
CPU_MLA kernel, whose refusal of block 64 is recorded), else the result says it does not."""
from __future__ import annotations

from bench import vllm_mla as M


def test_vllm_mla_benchmark_runs(bench_results):
    result = M.main(["--smoke", "--threads", "1"])
    bench_results["sections"]["vllm_mla"] = (result, M.header(result) + "\n" + M.table(result))
    assert {r["block_size"] for r in result["rows"]} == {16, 64}
    for r in result["rows"]:
        assert r["gbps_paged_ops"] > 0 and r["paged_ops_check_rel_err"] <= 1e-2, r
        assert r["latent_bytes"] == r["num_seqs"] * r["context_len"] * 576 * 2
        # the compute roof: the bf16 matmul peak's multiply-adds over each token's heads x (576 + 512)
        macs_per_s = result["peaks"]["matmul_tflops"] * 1e12 / 2
        assert abs(r["compute_roof_gbps"] - macs_per_s / (r["num_heads"] * 1088) * 1152 / 1e9) < 1e-9 * r["compute_roof_gbps"]
        assert r["roof_gbps"] == min(result["peaks"]["copy_gbps"], r["compute_roof_gbps"])
        assert r["paged_ops_share_of_roof"] == r["gbps_paged_ops"] / r["roof_gbps"]
    if M.vllm_missing() is not None:
        assert result["vllm"].startswith("vllm not importable"), result["vllm"]
        assert not any("gbps_vllm" in r for r in result["rows"])
    else:
        for r in result["rows"]:
            if r["block_size"] == 16:
                assert r["gbps_vllm"] > 0 and r["vllm_check_rel_err"] <= 1e-2, r
            else:
                assert "Unsupported block size" in r["vllm_refused"], r
            if M.amx_available():
                assert r["gbps_vllm_amx"] > 0 and r["vllm_amx_check_rel_err"] <= 1e-2, r

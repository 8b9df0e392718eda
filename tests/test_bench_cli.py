"""The benchmark command lines a user runs (#25 item 1): ``python -m bench.paged_attention`` on a
shape of one's own, re-plotting a results file (``python -m bench.common``), ``bench.decode_table
--help``. Each runs in a subprocess, as a user runs it, on tiny shapes with the cpu backend; results
go to a temporary directory. Speed is measured by these commands, never asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench_results"
# bench/results/: a tracked kernels-only results file, next to its tracked plot
TRACKED_KERNELS = ROOT / "bench" / "results" / "vm-amd-epyc-2026-11-30-1threads.json"
TINY = ["--num-seqs", "2", "--seq-len", "40", "--num-query-heads", "4", "--num-kv-heads", "2", "--head-size", "64",
        "--block-size", "1", "16", "--backend", "cpu", "--iters", "3", "--peak-copy-mib", "16"]


def run(module: str, *args, results_dir: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """python -m module args, from the repository root, results under results_dir."""
    env = dict(os.environ)
    env.pop("PAGED_BENCH_RESULTS", None)
    if results_dir is not None:
        env["PAGED_BENCH_RESULTS"] = str(results_dir)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def tracked_results_state() -> str:
    """git's view of bench/results/: what a benchmark command must leave as it found it."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "bench/results"], cwd=ROOT,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    """A decode sweep over blocks 1 and 16 with --plot: (process, results dir)."""
    out = tmp_path_factory.mktemp("decode")
    before = tracked_results_state()
    proc = run("bench.paged_attention", *TINY, "--plot", results_dir=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert tracked_results_state() == before, "the run changed bench/results"
    return proc, out


def only_results_file(directory: Path) -> dict:
    [path] = directory.glob("*-paged-attention.json")
    return json.loads(path.read_text())


def test_decode_table_and_json(decode_run):
    proc, out = decode_run
    text = proc.stdout
    assert "decode, 2 seqs x 40 tokens, 4/2 heads, head 64, bfloat16" in text, text
    assert "load average (1/5/15 min):" in text and "at the start" in text and "at the end" in text, text
    for column in ("backend", "block", "median_ms", "min_ms", "GB/s", "of_copy", "rel_err"):
        assert column in text, (column, text)
    section = only_results_file(out)["paged_attention"]
    rows = section["rows"]
    assert [(r["backend"], r["block_size"]) for r in rows] == [("cpu", 1), ("cpu", 16)]
    for r in rows:
        assert r["status"] == "ok" and r["rel_err"] <= r["tolerance"] == 1e-2, r
        assert 0 < r["seconds"] <= r["seconds_median"] and r["iters"] == 3, r
        # K+V of 40 tokens x 2 KV heads x 64 bf16, both sequences, plus the query and the output
        assert r["kv_bytes"] == 2 * 2 * 40 * 2 * 64 * 2 and r["bytes"] == r["kv_bytes"] + 2 * (2 * 4 * 64 * 2), r
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9), r
        assert r["share_of_copy"] == pytest.approx(r["gbps"] / section["peaks"]["cpu"]["copy_gbps"]), r
    assert len(section["loadavg_start"]) == 3 and len(section["loadavg_end"]) == 3
    assert section["args"]["block_size"] == [1, 16]


def test_plot_block_axis_reads_plain_numbers(decode_run):
    """--plot wrote the PNG next to the JSON; the figure's block-size ticks read 1, 16 (not 2^0, 2^4)."""
    _, out = decode_run
    [png] = out.glob("*-paged-attention-bandwidth.png")
    assert png.stat().st_size > 0
    from bench import common
    data = only_results_file(out)
    fig = common.block_sweep_figure(data["paged_attention"]["rows"], 10.0, data["machine_info"],
                                    common.ATTENTION_GBPS_KINDS)
    fig.canvas.draw()
    [ax] = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "16"]
    assert ax.get_xscale() == "log"
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_prefill_with_variants(tmp_path):
    """Prefill of the last 16 of 40 tokens, window + soft-cap + ALiBi + sinks, half (vLLM's spelling),
    an fp8 cache: checked against the reference, then timed."""
    proc = run("bench.paged_attention", *TINY, "--op", "prefill", "--query-len", "16", "--window", "8",
               "--softcap", "30", "--alibi", "--sinks", "--dtype", "half", "--kv-cache-dtype", "fp8",
               results_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prefill (causal), 2 seqs x 16 query of 40 tokens" in proc.stdout, proc.stdout
    assert "fp8_e4m3 cache, window 8, softcap 30, alibi, sinks" in proc.stdout, proc.stdout
    rows = only_results_file(tmp_path)["paged_attention"]["rows"]
    for r in rows:
        assert r["op"] == "prefill_attention" and r["dtype"] == "float16" and r["cache_dtype"] == "fp8_e4m3", r
        assert r["status"] == "ok" and r["rel_err"] <= 3e-2 and r["seconds"] > 0, r
        # the query rows are tokens 24..39, each seeing itself and 8 keys before it: tokens 16..39 are read
        assert r["kv_bytes"] == 2 * 2 * (40 - 16) * 2 * 64 * 1, r


def test_default_results_dir_is_outside_the_tracked_tree():
    """Without PAGED_BENCH_RESULTS, a run's files go to build/bench-results/, which git ignores."""
    proc = subprocess.run([sys.executable, "-c", "from bench import common; print(common.results_path()); "
                           "print(common.inside_tracked_tree(common.results_path()))"], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "PAGED_BENCH_RESULTS"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    path, tracked = proc.stdout.split()
    assert Path(path).parent == ROOT / "build" / "bench-results" and tracked == "False", proc.stdout
    from bench import common
    assert common.inside_tracked_tree(TRACKED_KERNELS)


@pytest.mark.parametrize("source, written", [
    (FIXTURES / "vllm_kernels_only.json", "vllm_kernels_only-vllm-kernels.png"),
    (TRACKED_KERNELS, TRACKED_KERNELS.stem + "-bandwidth.png"),
])
def test_replot_any_results_file(tmp_path, source, written):
    """A vllm_kernels-only file (used to raise KeyError 'kernels') and a kernels file both re-plot,
    into the results directory, never over the tracked PNG beside the source."""
    before = tracked_results_state()
    proc = run("bench.common", str(source), results_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / written).stat().st_size > 0, proc.stdout
    assert tracked_results_state() == before, "re-plotting changed bench/results"
    assert not (FIXTURES / written).exists()


def test_replot_a_paged_attention_file(decode_run, tmp_path):
    _, out = decode_run
    [src] = out.glob("*-paged-attention.json")
    proc = run("bench.common", str(src), "--out", str(tmp_path / "again.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "again.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--num-query-heads", "3", "--num-kv-heads", "2"], "--num-query-heads 3 is not a multiple of --num-kv-heads 2"),
    (["--head-size", "7"], "--head-size"),
    (["--op", "prefill", "--seq-len", "8", "--query-len", "9"], "--query-len 9 is more than --seq-len 8"),
    (["--dtype", "float64"], "--dtype"),
])
def test_bad_arguments_name_the_flag(args, message):
    proc = run("bench.paged_attention", "--num-seqs", "1", "--seq-len", "8", "--backend", "cpu", *args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error:" in last and message in last, proc.stderr


def test_decode_table_help_exits_at_once():
    proc = run("bench.decode_table", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m bench.decode_table" in proc.stdout and "bench.paged_attention" in proc.stdout
    assert "==" not in proc.stdout  # no table: nothing was measured

"""Session plumbing of the benchmarks: a results collector, and at the end of the session the
JSON file (build/bench-results/ or $PAGED_BENCH_RESULTS: bench.common.results_path), the PNG plot
and the summary tables.

Each benchmark module puts its rows in ``bench_results[section]``; sections are finalized here
so that a single ``pytest bench --benchmark-enable`` run writes one file and prints one summary.
"""
from __future__ import annotations

import pytest

from bench import common

_RESULTS: dict = {"kernels": [], "peaks": {}, "excluded": {}, "sections": {}}


@pytest.fixture(scope="session")
def bench_results() -> dict:
    """Where the tests put their rows: "kernels" (rows), "peaks" ({device: {...}}), "excluded"
    ({backend: why}) and "sections" ({name: (payload, summary text)}) for the other benchmarks."""
    return _RESULTS


PROFILES = ("cpu", "gpu", "smoke", "cpu-small", "device-check")


def pytest_addoption(parser):
    parser.addoption(
        "--bench-profile", choices=PROFILES, default=None,
        help="the kernel benchmarks' case matrix (sets PAGED_BENCH_PROFILE, which it defaults to): cpu (make bench "
             "without a GPU: one-factor sweeps around the headline shapes), gpu (the default where CUDA is visible), "
             "smoke (tiny shapes, seconds: tests/test_bench_smoke.py), cpu-small (device_check.sh without a GPU), "
             "device-check (the GPU headline shapes). A shape of your own: python -m bench.paged_attention --help")


def pytest_configure(config):
    profile = config.getoption("--bench-profile", None)
    if profile:
        import os
        os.environ["PAGED_BENCH_PROFILE"] = profile
    if common.bench_threads():
        import torch
        torch.set_num_threads(common.bench_threads())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from bench.kernels import kernel_summary
    write = terminalreporter.write_line
    texts = []
    if _RESULTS["kernels"] or _RESULTS["peaks"]:
        payload, text = kernel_summary(_RESULTS["kernels"], _RESULTS["peaks"], _RESULTS["excluded"])
        png = common.plot_block_sweeps(_RESULTS["kernels"], _RESULTS["peaks"].get("cpu", {}).get("copy_gbps")
                                       if "cuda" not in _RESULTS["peaks"] else
                                       _RESULTS["peaks"]["cuda"].get("copy_gbps"),
                                       common.results_path("-bandwidth.png"))
        payload["plot"] = png.name if png else None
        path = common.save_section("kernels", payload)
        texts.append(("kernel microbenchmarks", text + f"\nwritten: {path}" + (f"\nplot: {png}" if png else "")))
    for name, (payload, text) in _RESULTS["sections"].items():
        path = common.save_section(name, payload)
        texts.append((name, text + f"\nwritten: {path}"))
    for title, text in texts:
        terminalreporter.write_sep("=", f"paged-ops bench: {title}")
        for line in text.splitlines():
            write(line)

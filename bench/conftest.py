"""Session plumbing of the benchmarks: a results collector, and at the end of the session the
JSON file (bench/results/<machine>-<date>.json), the PNG plot and the summary tables.

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


def pytest_configure(config):
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

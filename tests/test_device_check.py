"""bench/device_check.sh's mechanics, without a GPU: its budgets, what reaches $OUT when a step times
out, the preflight's time limit and the headline table.

The script runs here against a fake Python and fake tools (written per test under tmp_path): the
fake answers the preflight as an H200 machine would, "builds" and "benchmarks" by writing the
committed sample results (tests/fixtures/device_check_results), and hangs in the step named by
FAKE_HANG, so the GPU path's bookkeeping is what is tested, in seconds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"
FIXTURES = ROOT / "tests" / "fixtures" / "device_check_results"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")

# The fake interpreter. The preflight's probe, pip, pytest and bench.variants are faked; the
# headline render runs for real (it needs no torch). DEVICE_CHECK_STEP is set by the script.
FAKE_PYTHON = r'''#!{python}
import os, shutil, subprocess, sys, time
args = sys.argv[1:]
step = os.environ.get("DEVICE_CHECK_STEP", "")
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(step + "\t" + " ".join(args) + "\n")
if step == os.environ.get("FAKE_HANG"):  # deaf to SIGINT, as a process stuck in a CUDA call
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print("fake: hanging in", step, flush=True)
    time.sleep(60)
if args[:1] == ["-c"] and "importlib.metadata" in args[1]:  # the preflight's probe
    print("python 3.12.3 /opt/torch/.venv/bin/python3")
    for dist in ("triton", "pytest", "pytest-benchmark", "hypothesis", "transformers", "pytest-xdist",
                 "scikit-build-core", "matplotlib"):
        print("pkg", dist, "-" if dist == os.environ.get("FAKE_MISSING_DIST") else "1.0")
    print("torch 2.11.0+cu130 cuda 13.0 gpus", os.environ.get("FAKE_GPUS", "1"))
elif args[:2] == ["-m", "bench.headline"]:
    sys.exit(subprocess.run([{python!r}, *args]).returncode)
elif args[:2] == ["-m", "pytest"] and any(a.startswith("bench/test_") for a in args):
    name = "sample-kernels.json" if "bench/test_kernels.py" in args else "sample-references.json"
    shutil.copy(os.path.join({fixtures!r}, name), os.path.join(os.environ["PAGED_BENCH_RESULTS"], name))
    print("fake benchmark wrote", name)
print("fake ok:", step, *args[:3])
'''


def _fake_tool(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def _make_fake(tmp_path: Path):
    """(env, out dir, calls file): PATH with fake GPU tools, PY the fake interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    py = bin_dir / "python"
    py.write_text(FAKE_PYTHON.format(python=sys.executable, fixtures=str(FIXTURES)))
    py.chmod(0o755)
    _fake_tool(bin_dir / "nvcc", 'echo "nvcc: NVIDIA (R) Cuda compiler driver"; echo "Cuda compilation tools, release 13.0, V13.0.48"')
    _fake_tool(bin_dir / "cmake", 'echo "cmake version 3.31.0"')
    _fake_tool(bin_dir / "ninja", 'echo "1.13.0"')
    _fake_tool(bin_dir / "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"')
    _fake_tool(bin_dir / "cuobjdump", 'echo "cuobjdump: NVIDIA (R) CUDA Object Utility"; echo "Cuda compilation tools, release 13.0"')
    _fake_tool(bin_dir / "compute-sanitizer", 'if [ "$1" = --version ]; then echo "Version 2025.3.0"; exit 0; fi\n'
               'while [ "${1#--}" != "$1" ]; do case $1 in --tool|--error-exitcode|--target-processes) shift 2;; *) shift;; esac; done\n'
               'exec "$@"')
    out = tmp_path / "out"
    calls = tmp_path / "calls.txt"
    calls.touch()
    # shortened budgets: every step 4 s, a 1-second grace
    env = {k: v for k, v in os.environ.items() if not k.endswith("_S")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PY": str(py), "OUT": str(out),
            "FAKE_CALLS": str(calls), "KILL_GRACE_S": "1", "PROBE_S": "3.5"}
    env |= {v: "4" for v in ("BUILD_S", "BENCH_KERNELS_S", "GPU_TESTS_S", "BENCH_REFERENCES_S", "GPU_CONTRACT_S",
                             "MEMCHECK_S", "RACECHECK_S", "SYNCCHECK_S", "VARIANTS_BENCH_S", "HEADLINE_S",
                             "BENCH_CPU_S", "PREFLIGHT_S")}
    return env, out, calls


@pytest.fixture
def fake(tmp_path):
    return _make_fake(tmp_path)


def _run(env, *args, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(autouse=True)
def _results_dirs_removed():
    """The script writes bench/results/device-check-<stamp>/; the ones these tests made go."""
    before = set((ROOT / "bench" / "results").glob("device-check-*"))
    yield
    for d in set((ROOT / "bench" / "results").glob("device-check-*")) - before:
        shutil.rmtree(d, ignore_errors=True)


def _plan(name: str) -> dict[str, tuple[str, int]]:
    """{step: (override variable, default seconds)} of GPU_PLAN or CPU_PLAN, parsed from the script."""
    text = SCRIPT.read_text()
    body = re.search(rf'^{name}="(.*?)"', text, re.S | re.M).group(1)
    return {m[0]: (m[1], int(m[2])) for m in re.findall(r"([\w-]+):\$\{(\w+):-(\d+)\}", body)}


def test_budgets_fit_480_s_with_kill_grace():
    text = SCRIPT.read_text()
    grace = int(re.search(r"^KILL_GRACE_S=\$\{KILL_GRACE_S:-(\d+)\}", text, re.M).group(1))
    assert int(re.search(r"^TOTAL_BUDGET_S=(\d+)", text, re.M).group(1)) <= 480
    for name in ("GPU_PLAN", "CPU_PLAN"):
        plan = _plan(name)
        assert "preflight" in plan and plan["preflight"][1] <= 5, plan
        assert "headline" in plan and list(plan)[-1] == "headline", "the table is the last step"
        total = sum(s + grace for _, s in plan.values() if s > 0)  # a 0 s step is skipped
        assert total <= 480, f"{name}: {total} s"
    gpu = _plan("GPU_PLAN")
    # every step the GPU path runs has its budget in the plan (step/run_gpu/skip NAME)
    used = set(re.findall(r"^\s*(?:step|run_gpu) ([\w-]+) ", text, re.M)) | {"racecheck", "synccheck"}
    assert used - {"$tool"} <= set(gpu) | set(_plan("CPU_PLAN")), used - set(gpu)


def test_over_budget_refuses_to_start(fake):
    env, out, calls = fake
    env |= {"BUILD_S": "470"}
    r = _run(env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to start" in r.stderr and "GPU_PLAN" in r.stderr
    assert calls.read_text() == "" and not out.exists()  # nothing ran
    env |= {"BUILD_S": "4", "GPU_TESTS_S": "4s"}
    r = _run(env)
    assert r.returncode == 2 and "not whole seconds" in r.stderr


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """One run of the GPU path (the slow part of this file, so shared): gpu-tests hangs past its
    limit, hypothesis is missing, and every fake call prints the environment it was started with."""
    tmp = tmp_path_factory.mktemp("gpu_run")
    before = set((ROOT / "bench" / "results").glob("device-check-*"))
    env, out, calls = _make_fake(tmp)
    spy = Path(env["PY"])
    spy.write_text(spy.read_text().replace('print("fake ok:"', 'print("env:", {k: os.environ.get(k) for k in '
                                           '("PAGED_OPS_CUDA", "PAGED_OPS_CUDA_ARCHS", "PAGED_OPS_CUDA_EMU", '
                                           '"PAGED_OPS_AUTOTUNE", "PAGED_BENCH_TUNE_S", "PAGED_BENCH_PROFILE")})\n'
                                           'print("fake ok:"'))
    env |= {"FAKE_HANG": "gpu-tests", "GPU_TESTS_S": "1", "FAKE_MISSING_DIST": "hypothesis", "SYNCCHECK_S": "0"}
    t = time.monotonic()
    r = _run(env)
    took = time.monotonic() - t
    logs = sorted(set((ROOT / "bench" / "results").glob("device-check-*")) - before)
    assert len(logs) == 1, logs
    saved = tmp / "logs"
    shutil.copytree(logs[0], saved)
    shutil.rmtree(logs[0])
    summary = (out / "summary.txt").read_text()
    verdicts = {line.split()[0]: " ".join(line.split()[1:3]) for line in summary.splitlines()[3:]}
    return r, took, out, calls, saved, verdicts


def test_timed_out_step_keeps_the_others(gpu_run):
    r, took, out, calls, logs, verdicts = gpu_run
    log = r.stdout + r.stderr
    assert r.returncode == 1, log  # a timeout is a failure
    assert took < 40, took
    # at most 8 files come back from the device tool, none in sub-folders here
    assert sorted(p.name for p in out.iterdir()) == ["device-check.tar.gz", "headline.json", "headline.txt",
                                                     "steps.log", "summary.txt"]
    assert verdicts["gpu-tests"].startswith("TIMEOUT"), verdicts
    for name in ("build", "bench-kernels", "bench-references", "gpu-contract", "memcheck",
                 "racecheck", "variants-bench", "headline"):
        assert verdicts[name].startswith("ok"), (name, verdicts)
    assert verdicts["synccheck"] == "SKIPPED (limit", verdicts  # its limit 0: not run, no failure
    # the steps after the hung one ran, with their results
    steps = (out / "steps.log").read_text()
    assert "=== gpu-tests: TIMEOUT" in steps and "fake: hanging in gpu-tests" in steps
    assert "=== bench-references: ok" in steps and "=== variants-bench: ok" in steps
    headline = json.loads((out / "headline.json").read_text())
    measured = {(e["shape"], e["backend"]) for e in headline["headline"] if e["measured"]}
    assert ("decode", "torch-flex-paged") in measured and ("prefill", "cuda") in measured
    # the headline table is the last thing printed
    assert r.stdout.rstrip().splitlines()[-1].endswith("pairs measured"), r.stdout[-500:]
    tar = subprocess.run(["tar", "-tzf", str(out / "device-check.tar.gz")], capture_output=True, text=True).stdout
    assert "gpu-tests.log" in tar and "sample-kernels.json" in tar and "summary.txt" in tar


def test_preflight_required_missing_fails_but_the_run_goes_on(gpu_run):
    r, took, out, calls, logs, verdicts = gpu_run
    assert verdicts["preflight"] == "FAILED rc=1", verdicts
    assert "required but missing or broken: hypothesis" in (out / "steps.log").read_text()


def test_step_environment(gpu_run):
    """The build: CUDA on, arch 90, no emulator, baseline cpu kernels only; the tests and the
    variants benchmark tune nothing; the headline benchmark tunes within its budget."""
    r, took, out, calls, logs, verdicts = gpu_run
    build = (logs / "build.log").read_text()
    assert "'PAGED_OPS_CUDA': 'on'" in build and "'PAGED_OPS_CUDA_ARCHS': '90'" in build
    assert "'PAGED_OPS_CUDA_EMU': 'off'" in build
    pip = next(line for line in calls.read_text().splitlines() if line.startswith("build\t-m pip"))
    assert "--config-settings=cmake.define.PAGED_OPS_CPU_ISAS=portable" in pip
    for name in ("gpu-contract", "memcheck", "racecheck", "variants-bench"):
        assert "'PAGED_OPS_AUTOTUNE': '0'" in (logs / f"{name}.log").read_text(), name
    bench = (logs / "bench-kernels.log").read_text()
    assert "'PAGED_BENCH_TUNE_S': '30'" in bench and "'PAGED_BENCH_PROFILE': 'device-check'" in bench


def test_preflight_under_5_s_with_a_hanging_tool(fake):
    """Probes run side by side, each under its own limit: two slow tools and a hanging one still
    end inside 5 s; a missing optional tool is reported and the run goes on."""
    env, out, calls = fake
    bin_dir = Path(env["PY"]).parent
    # four tools of 1.5 s each and one that hangs: 9.5 s one after another, 3.5 s side by side
    _fake_tool(bin_dir / "nvcc", 'sleep 1.5; echo "Cuda compilation tools, release 13.0, V13.0.48"')
    _fake_tool(bin_dir / "cmake", 'sleep 1.5; echo "cmake version 3.31.0"')
    _fake_tool(bin_dir / "ninja", 'sleep 1.5; echo "1.13.0"')
    _fake_tool(bin_dir / "nvidia-smi", 'sleep 1.5; echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"')
    _fake_tool(bin_dir / "compute-sanitizer", "sleep 30")
    (bin_dir / "cuobjdump").unlink()
    env |= {"PATH": f"{bin_dir}:/usr/bin:/bin"}  # no real nvcc / cuobjdump / sanitizer of this machine
    findings = Path(env["OUT"]).parent / "preflight.env"
    t = time.monotonic()
    r = _run(env, "--preflight", str(findings), timeout=20)
    took = time.monotonic() - t
    assert took < 5, (took, r.stdout)
    lines = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("preflight: ")}
    assert "release 13.0" in lines["nvcc"] and "ok" in lines["cmake"] and "ok" in lines["nvidia-smi"]
    assert "TIMEOUT" in lines["compute-sanitizer"] and "optional" in lines["compute-sanitizer"]
    assert "MISSING optional" in lines["cuobjdump"]
    for dist in ("pytest", "pytest-benchmark", "hypothesis", "transformers", "triton", "torch"):
        assert "ok" in lines[dist], lines[dist]
    assert r.returncode == 0, r.stdout  # only optional tools are missing
    found = findings.read_text()
    assert "HAVE_SANITIZER=0" in found and "TORCH_GPUS=1" in found and "HAVE_TRANSFORMERS=1" in found


def test_cpu_path_without_a_gpu(fake):
    env, out, calls = fake
    env |= {"FAKE_GPUS": "0"}
    (Path(env["PY"]).parent / "nvidia-smi").unlink()
    r = _run(env)
    summary = (out / "summary.txt").read_text()
    assert "CPU path" in summary and "kernel-bench-cpu" in summary and "build" not in summary, summary
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(line.startswith("build\t") for line in calls.read_text().splitlines())


def test_headline_renders_from_sample_results(tmp_path):
    from bench import headline
    rows, peaks, info = headline.load(FIXTURES)
    entries = headline.headline_rows(rows, peaks, info["gpu_l2_bytes"])
    table = headline.render(entries, peaks, info)
    assert len(entries) == 3 * len(headline.HEADLINE_SHAPES)  # cuda, triton and the reference each
    by = {(e["shape"], e["backend"]): e for e in entries}
    # decode 64 x 4096, 32/8 heads, d128 bf16: 2 * 262144 tokens * 8 heads * 128 * 2 B over 0.3 ms
    cuda = by[("decode", "cuda")]
    assert cuda["gbps"] == pytest.approx(2 * 64 * 4096 * 8 * 128 * 2 / 300e-6 / 1e9)
    assert cuda["of_copy"] == pytest.approx(cuda["gbps"] / 4320.0)
    assert cuda["vs_reference"] == pytest.approx(500e-6 / 300e-6)  # FlexAttention's time / ours
    pre = by[("prefill", "triton")]
    assert pre["of_matmul"] == pytest.approx(pre["tflops"] / 780.0)
    assert pre["vs_reference"] == pytest.approx(0.8)  # SDPA flash 0.8 ms, triton 1.0 ms
    assert not by[("decode-group8", "triton")]["measured"]
    # FlexAttention's batch-1 time came from 2 input sets of 16 MiB: within 4x the 60 MiB L2
    assert by[("decode-batch1", "torch-flex-paged")]["note"].startswith("L2-warm?")
    assert by[("decode-batch1", "cuda")]["note"] == "" and by[("decode", "cuda")]["note"] == ""
    lines = table.splitlines()
    assert "copy 4320 GB/s" in lines[1] and "matmul 780 TFLOP/s" in lines[1]
    for _, title, _ in headline.HEADLINE_SHAPES:
        assert sum(title in line for line in lines) == 3, title
    assert any("group 8" in line and "triton" in line and "not measured" in line for line in lines)
    assert lines[-1] == "10 of 12 (shape, backend) pairs measured"
    # the CLI writes the same rows as JSON, whole
    assert headline.main([str(FIXTURES), "--json", str(tmp_path / "h.json")]) == 0
    data = json.loads((tmp_path / "h.json").read_text())
    assert len(data["headline"]) == len(entries) and data["peaks"]["cuda"]["copy_gbps"] == 4320.0


def test_headline_shapes_are_the_device_check_profile():
    """bench/kernels.py's device-check profile is HEADLINE_SHAPES, at block 16 in the block sweep
    (so test_references times FlexAttention / SDPA flash on each), and the GPU shapes of issue #23."""
    from bench import headline, kernels
    cases = kernels.cases("device-check")
    assert [c.op for c in cases] == [f["op"] for _, _, f in headline.HEADLINE_SHAPES]
    assert all(c.sweep == "block_size" and c.block_size == 16 for c in cases)
    shapes = {(c.op, c.num_seqs, c.context_len, c.num_heads, c.num_kv_heads) for c in cases}
    assert ("decode_attention", 1, 4096, 32, 8) in shapes  # batch 1: split-KV
    assert ("decode_attention", 64, 4096, 64, 8) in shapes  # group 8


def test_tuning_budget_of_the_benchmark(monkeypatch):
    """bench/kernels.py tune: each backend tunes until it has spent PAGED_BENCH_TUNE_S seconds,
    then its shapes run untuned (triton: PAGED_OPS_AUTOTUNE=0) and the rows say so; the tuner itself
    is faked (no GPU here)."""
    from bench import kernels
    from paged_ops import tuning
    calls = []

    def fake_tune(*args, force):
        calls.append(args)
        time.sleep(0.05)  # a tuning that takes the whole budget

    monkeypatch.setattr(tuning, "tune_cuda_decode", fake_tune)
    monkeypatch.setattr(tuning, "last_config", lambda backend, op: {"key": [], "config": {}, "source": "tuned"})
    monkeypatch.setattr(kernels, "_tuning", {"spent_s": {}, "last": {}})
    monkeypatch.setenv("PAGED_BENCH_TUNE_S", "0.04")
    monkeypatch.setenv("PAGED_OPS_AUTOTUNE", "1")
    case = kernels.device_check_cases()[0]
    kernels.tune("cuda", "decode_attention", ("first",))
    assert calls == [("first",)] and kernels.record(case, "cuda", 1e-3, 3, 2)["tuning"] == "tuned"
    kernels.tune("cuda", "decode_attention", ("second",))  # the budget is spent: not tuned
    assert calls == [("first",)]
    assert kernels.record(case, "cuda", 1e-3, 3, 2)["tuning"] == "not tuned here (tuning budget spent)"
    # triton's budget is its own: spent, it turns the Triton tuner off for the rest of the process
    kernels._tuning["spent_s"]["triton"] = 0.05
    kernels.tune("triton", "decode_attention", ("third",))
    assert os.environ["PAGED_OPS_AUTOTUNE"] == "0" and calls == [("first",)]
    kernels.tune("cpu", "decode_attention", ("cpu",))  # the cpu backend has no tuner: no mark either
    assert "tuning" not in kernels.record(case, "cpu", 1e-3, 3, 2)
    # triton tunes in its first call, only where the tuner is on (a GPU, no interpreter): here no call
    monkeypatch.setattr(kernels, "validated_kernel", lambda *a: pytest.fail("called with the tuner off"))
    monkeypatch.setattr(kernels, "_tuning", {"spent_s": {}, "last": {}})
    kernels.tune("triton", "decode_attention", ("interpreted",))
    assert kernels.record(case, "triton", 1e-3, 3, 2)["tuning"] == "default (tuning off)"

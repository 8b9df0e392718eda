"""Set-up that tells (#25 item 4): the build prints a line per stage (tools/build_progress.py) and
keeps pip's whole output in a log; `make demo` without a visible GPU builds no CUDA and says how to,
while `make test` (CI) builds it as configured."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from build_progress import progress_line  # noqa: E402

PIP_LINES = """\
  *** scikit-build-core 1.1.2 using CMake 4.4.5 (editable)
  *** Configuring CMake...
  -- The CXX compiler identification is GNU 12.2.0
  -- paged_ops: CUDA backend ON (mode auto, archs 80-real;89-real;90)
  [0/2] Re-checking globbed directories...
  [3/57] Building CUDA object CMakeFiles/_C.dir/csrc/cuda/decode.cu.o
  [4/57] Building CXX object CMakeFiles/paged_cpu_avx2.dir/csrc/cpu/kernels/attention.cpp.o
  /usr/local/cuda/bin/nvcc -forward-unknown-to-host-compiler -O3 -c csrc/cuda/decode.cu
  [56/57] Linking CXX shared module _C.cpython-311-x86_64-linux-gnu.so
  *** Installing project into wheel...
Successfully installed paged-ops-0.1.0
"""


def test_progress_lines_are_the_stages_and_steps():
    shown = [s for s in map(progress_line, PIP_LINES.splitlines()) if s]
    assert shown == ["*** scikit-build-core 1.1.2 using CMake 4.4.5 (editable)", "*** Configuring CMake...",
                     "-- paged_ops: CUDA backend ON (mode auto, archs 80-real;89-real;90)",
                     "[3/57] csrc/cuda/decode.cu", "[4/57] csrc/cpu/kernels/attention.cpp (paged_cpu_avx2)", "[56/57] link _C.cpython-311-x86_64-linux-gnu.so",
                     "*** Installing project into wheel...", "Successfully installed paged-ops-0.1.0"]


def _run_progress(tmp_path, script):
    log = tmp_path / "build.log"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_progress.py"), str(log), "--",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return proc, log


def test_progress_keeps_the_log_and_passes_the_exit_status(tmp_path):
    ok, log = _run_progress(tmp_path, "print('  *** Configuring CMake...'); print('cc -O3 x.c')")
    assert ok.returncode == 0 and "Configuring CMake" in ok.stdout and "cc -O3" not in ok.stdout
    assert "cc -O3 x.c" in log.read_text()
    failed, log = _run_progress(tmp_path, "import sys; print('error: x.c:1: boom'); sys.exit(3)")
    assert failed.returncode == 3
    assert "boom" in failed.stderr and "build failed (exit 3)" in failed.stderr  # the log's tail


def _make_dry_run(target, env_extra, tmp_path):
    # A PATH whose nvidia-smi lists no GPU (or one): what the recipe would run, not run.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + env_extra.pop("SMI", "exit 9") + "\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PAGED_OPS_CUDA"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", **env_extra)
    proc = subprocess.run(["make", "-n", target], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(subprocess.run(["which", "make"], capture_output=True).returncode, reason="no make")
def test_demo_skips_cuda_without_a_gpu_and_test_does_not(tmp_path):
    demo = _make_dry_run("demo", {}, tmp_path)
    assert "PAGED_OPS_CUDA=off" in demo and "make demo PAGED_OPS_CUDA=on" in demo
    assert "build_progress.py" in demo
    test = _make_dry_run("test", {}, tmp_path)
    assert "PAGED_OPS_CUDA=off" not in test and "pip install -v" in test
    with_gpu = _make_dry_run("demo", {"SMI": "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'"}, tmp_path)
    assert "PAGED_OPS_CUDA=off" not in with_gpu
    asked = _make_dry_run("demo", {"PAGED_OPS_CUDA": "on"}, tmp_path)
    assert "PAGED_OPS_CUDA=off" not in asked


def test_default_cuda_archs_agree():
    """The default CUDA archs are written twice (pyproject.toml's cmake.define for pip builds,
    CMakeLists.txt's cache default for direct CMake): one list, or a fresh clone builds what the
    docs do not say (it did: pyproject kept 86-real after CMakeLists dropped it)."""
    import re
    import tomllib

    define = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["cmake"]["define"]
    cmake = re.search(r'set\(PAGED_OPS_CUDA_ARCHS "([^"]+)" CACHE', (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert define["PAGED_OPS_CUDA_ARCHS"]["default"] == cmake

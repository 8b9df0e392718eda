"""The cpu backend's runtime ISA dispatch (csrc/cpu/backend.cpp, csrc/cpu/isa.h).

The kernels are compiled once per ISA (portable, avx2, avx512, avx512_bf16, amx and amx_emulated
on x86; portable elsewhere) and one is chosen at the first call: the best this CPU runs, or
PAGED_OPS_CPU_ISA. amx_emulated (the AMX kernels on a model of the tiles, tests/test_cpu_amx.py) runs
wherever avx512_bf16 does and is never the default; amx runs only with AMX and Linux's permission.
tests/test_ops.py and tests/test_cpu_backend.py run the default (best) one over their full grids;
here every other ISA this machine runs gets a representative subset of the same cases, switched
with torch.ops.paged_cpu.set_isa:
  - attention: test_ops' small decode and prefill grids (every dtype, fp8 format and scale kind,
    layout, block size 1..256, group 1..8, head size 16..256), the split-KV decode path;
  - reshape_and_cache: test_ops' configs at block size 3, and every fp8 input of test_cpu_backend;
  - quantize/dequantize: test_ops' round trip for every dtype pair, the NaN inputs, and
    test_cpu_backend's every-16-bit-input (scales 1 and 0.37: the multiply and divide paths),
    fp32 ties and every-byte probes;
  - the fp8 attention probes (every finite value, NaN/inf bytes, all -inf keys).
The full grid on every ISA would multiply the suite's cpu time by the number of ISAs.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paged_ops  # noqa: F401  (loads the extension: torch.ops.paged_cpu)
from paged_ops.testing import FP8_DTYPES
from tests import test_cpu_backend as cpu_cases
from tests import test_ops as op_cases

ops = torch.ops.paged_cpu
ALL_ISAS = ("amx_emulated", "portable", "avx2", "avx512", "avx512_bf16", "amx")
SUPPORTED = list(ops.supported_isas())
ACTIVE = ops.isa()  # the best one, or PAGED_OPS_CPU_ISA's
# The isa fixture's builds (tests/conftest.py): ACTIVE runs the full grids in test_ops / test_cpu_backend.
CPU_ISAS = [i for i in SUPPORTED if i != ACTIVE]


def cpu_flags() -> set[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def expected_isas() -> list[str]:
    """What the dispatch should find on this machine, from /proc/cpuinfo (independent of CPUID
    as the extension reads it)."""
    flags, isas = cpu_flags(), ["portable"]
    if {"avx2", "fma", "f16c"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl"} <= flags:
            isas.append("avx512")
            if "avx512_bf16" in flags:
                isas.append("avx512_bf16")
                isas.insert(0, "amx_emulated")  # the least preferred: never the default
                if {"amx_tile", "amx_bf16"} <= flags:  # Linux lists them only with the tile state enabled
                    isas.append("amx")
    return isas


def run_python(code: str, isa_env: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PAGED_OPS_CPU_ISA"}
    if isa_env is not None:
        env["PAGED_OPS_CPU_ISA"] = isa_env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


# --- the dispatch itself ------------------------------------------------------------------------

def test_supported_isas_match_the_cpu():
    assert SUPPORTED == expected_isas()


def test_default_is_the_best_supported():
    r = run_python("import paged_ops, torch; print(torch.ops.paged_cpu.isa())", None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected_isas()[-1]


@pytest.mark.parametrize("isa", SUPPORTED)
def test_environment_override(isa):
    # The override is read at the first call; the kernels then run on it.
    code = ("import paged_ops, torch; from paged_ops.testing import make_case, nan_like, assert_close\n"
            "print(torch.ops.paged_cpu.isa())\n"
            "c = make_case([5, 40], num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)\n"
            "out = nan_like(c.query); paged_ops.backend('cpu').decode_attention(*c.decode_args(out))\n"
            "assert_close(out, c.reference_decode(), c.dtype)\n")
    r = run_python(code, isa)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == isa


@pytest.mark.parametrize("value", ["sse9", "AVX2", "avx-512"])
def test_environment_override_unknown_is_a_clear_error(value):
    # Every call keeps raising (not only the first): the bad value is never silently replaced.
    code = ("import paged_ops, torch\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        torch.ops.paged_cpu.isa()\n"
            "    except ValueError as e:\n"
            "        print(e)\n"
            "    else:\n"
            "        raise SystemExit('no error')\n")
    r = run_python(code, value)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if "PAGED_OPS_CPU_ISA" in line]
    assert len(lines) == 2, r.stdout
    assert f"PAGED_OPS_CPU_ISA='{value}' is not a CPU ISA" in lines[0]
    assert "valid: " + ", ".join(ALL_ISAS) in lines[0]
    assert "supported on this machine: " + ", ".join(SUPPORTED) in lines[0]


def test_environment_override_unknown_fails_the_kernels_too():
    code = ("import paged_ops, torch\n"
            "x = torch.randn(16); out = torch.empty(16, dtype=torch.float8_e4m3fn)\n"
            "try:\n"
            "    torch.ops.paged_cpu.quantize_fp8(out, x, torch.tensor([1.0]))\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    r = run_python(code, "bogus")
    assert r.returncode == 0, r.stderr
    assert "PAGED_OPS_CPU_ISA='bogus' is not a CPU ISA" in r.stdout


@pytest.mark.parametrize("isa", [i for i in ALL_ISAS if i not in SUPPORTED])
def test_unsupported_isa_is_a_clear_error(isa):
    before = ops.isa()
    with pytest.raises(ValueError, match=f"isa='{isa}'.*supported on this machine: {', '.join(SUPPORTED)}"):
        ops.set_isa(isa)
    assert ops.isa() == before  # a refused switch changes nothing
    r = run_python("import paged_ops, torch; torch.ops.paged_cpu.isa()", isa)
    assert r.returncode != 0 and f"PAGED_OPS_CPU_ISA='{isa}'" in r.stderr, r.stderr


@pytest.mark.skipif("amx" in SUPPORTED, reason="this machine runs AMX")
def test_amx_is_built_and_refused_with_the_reason():
    # The amx build exists (every compiler the project supports takes -mamx-tile -mamx-bf16; CMake
    # says when one does not) and, without AMX, asking for it names what is missing.
    flags = cpu_flags()
    reason = (re.escape("this CPU has no AVX-512 BF16") if "avx512_bf16" not in flags else
              re.escape("this CPU has no AMX-TILE + AMX-BF16 (CPUID)") if not {"amx_tile", "amx_bf16"} <= flags else
              "(the OS has not enabled the AMX tile state|Linux refused the AMX tile permission)")
    with pytest.raises(ValueError, match="isa='amx': " + reason) as e:
        ops.set_isa("amx")
    assert "has no amx kernels" not in str(e.value)


def test_set_isa_returns_the_previous_one():
    before = ops.isa()
    try:
        assert ops.set_isa("portable") == before
        assert ops.isa() == "portable"
    finally:
        assert ops.set_isa(before) == "portable"
    assert ops.isa() == before


# --- the contract on every other ISA this machine runs ------------------------------------------

@pytest.mark.parametrize("case", op_cases.GRIDS["decode"]["small"], ids=lambda c: c.id)
def test_decode_attention(isa, case):
    op_cases.test_decode_attention("cpu", case)


@pytest.mark.parametrize("case", op_cases.GRIDS["prefill"]["small"], ids=lambda c: c.id)
def test_prefill_attention(isa, case):
    op_cases.test_prefill_attention("cpu", case)


def test_decode_split_path(isa):
    cpu_cases.test_decode_split_path(1, 2500, torch.bfloat16)


@pytest.mark.parametrize("cache_dtype,scale_kind,dtype,layout", op_cases.RESHAPE_CONFIGS,
                         ids=lambda v: op_cases._name(v))
def test_reshape_and_cache(isa, cache_dtype, scale_kind, dtype, layout):
    op_cases.test_reshape_and_cache("cpu", cache_dtype, scale_kind, dtype, layout, 3)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=op_cases._name)
@pytest.mark.parametrize("dtype", op_cases.DTYPES, ids=op_cases._name)
def test_quantize_dequantize(isa, dtype, fp8):
    op_cases.test_quantize_dequantize("cpu", dtype, fp8)
    op_cases.test_quantize_fp8_16bit_nan_inputs("cpu", dtype, fp8) if dtype != torch.float32 else \
        op_cases.test_quantize_fp8_float32_nan_inputs("cpu", fp8)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=op_cases._name)
def test_fp8_bit_probes(isa, fp8):
    for dtype in (torch.float16, torch.bfloat16):
        for scale in (1.0, 0.37):
            cpu_cases.test_quantize_fp8_every_16bit_input(fp8, dtype, scale)
    for scale in cpu_cases.QUANT_SCALES:
        cpu_cases.test_quantize_fp8_fp32_ties_and_random(fp8, scale)
    for dtype in op_cases.DTYPES:
        cpu_cases.test_dequantize_fp8_every_byte(fp8, dtype)
        cpu_cases.test_reshape_and_cache_fp8_every_input(fp8, dtype)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=op_cases._name)
def test_attention_fp8_values(isa, fp8):
    cpu_cases.test_attention_reads_every_fp8_value(fp8)
    bytes_ = (0x7F, 0xFF) if fp8 == torch.float8_e4m3fn else (0x7C, 0xFC, 0x7E)
    for byte in bytes_:
        for which in ("k", "v"):
            cpu_cases.test_attention_fp8_nan_and_inf_bytes(fp8, byte, which)


def test_attention_all_minus_inf_keys(isa):
    for seq_len in (40, 600):
        cpu_cases.test_attention_all_minus_inf_keys_give_empty_rows_like_the_reference(seq_len)


# --- aarch64: the portable build compiles there -------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CROSS_CXX = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS_CXX is None, reason="no aarch64 cross compiler: Debian's g++-aarch64-linux-gnu "
                    "(apt-get install -y g++-aarch64-linux-gnu; .ci/run installs it)")
def test_cpu_sources_compile_for_aarch64():
    """Every cpu backend source as aarch64 builds it (the portable ISA only, no x86 intrinsics),
    against this torch's headers. Syntax and semantics (templates instantiated), no code."""
    from torch.utils import cpp_extension
    sources = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("csrc/cpu/*.cpp"), *ROOT.glob("csrc/cpu/kernels/*.cpp")])
    assert any("kernels/attention.cpp" in s for s in sources) and any("cpu/backend.cpp" in s for s in sources)
    flags = ["-std=c++20", "-fsyntax-only", "-fopenmp", "-DPAGED_CPU_ISA_NS=isa_portable",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-Icsrc",
             *(f"-I{d}" for d in cpp_extension.include_paths())]
    procs = {src: subprocess.Popen([CROSS_CXX, *flags, src], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for src in sources}
    failed = {}
    for src, p in procs.items():
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            failed[src] = out[-3000:]
    assert not failed, "\n".join(f"{src}:\n{out}" for src, out in failed.items())


# --- bench results (#14 item 4): one file per run, plots a reader can compare --------------------

def test_bench_results_file_per_run(tmp_path):
    """Two runs on the same day write two files (the name used to be <machine>-<date>.json), named
    with the run's start and the commit."""
    code = "from bench import common; print(common.results_path())"
    env = os.environ | {"PAGED_BENCH_RESULTS": str(tmp_path)}
    names = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        names.append(Path(r.stdout.strip()).name)
        import time
        time.sleep(1.1)
    from bench import common
    assert names[0] != names[1], names
    for name in names:
        assert name.startswith(common.machine_id() + "-") and common.commit_tag() in name, name


def test_bench_plot_panels_titles_and_axes(tmp_path, monkeypatch):
    """One panel per kind of rate (decode's KV-read GB/s, the cache ops' read+write GB/s, prefill's
    TFLOP/s), y from 0, the shape in the panel title, threads / ISA / commit in the figure's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import common
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    shape = dict(num_seqs=16, context_len=2048, num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                 cache_dtype=None, num_layers=1, sweep="block_size", backend="cpu")
    rows = [dict(shape, op=op, block_size=bs, gbps=50.0 + bs, tflops=0.2 + bs / 100)
            for op in ("decode_attention", "reshape_and_cache", "copy_blocks", "prefill_attention") for bs in (1, 16)]
    png = common.plot_block_sweeps(rows, 30.0, tmp_path / "x.png")
    assert png is not None and png.exists()
    [fig] = figures
    titles = sorted(ax.get_title() for ax in fig.axes)
    assert len(titles) == 3, titles
    assert [t.split(":")[0] for t in titles] == ["cache ops", "decode", "prefill"], titles
    assert all("16 seqs x 2048 tok, 32/8 heads, d128, bfloat16" in t for t in titles), titles
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    title = fig._suptitle.get_text()
    assert f"{torch.get_num_threads()} threads" in title and f"cpu ISA {ACTIVE}" in title, title
    assert f"commit {common.commit_tag()}" in title, title

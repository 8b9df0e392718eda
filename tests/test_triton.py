"""What is specific to the Triton backend; the op contract runs for every backend in
tests/test_ops.py (Triton runs its small grid there, on CPU tensors here and CUDA tensors on a GPU).

Without a GPU the kernels run under the Triton interpreter on CPU tensors; the variable must
be set before the kernel modules are imported (Triton decides interpreter vs. compiler when a
``@triton.jit`` function is defined): tests/conftest.py does it.

Here: forced flash-decoding split counts and the split heuristic, small prefill tiles, the
hand-written fp8 decoding, non-contiguous (de)quantization called without the router, the
sm_90 lowering, and config inspection, tuning and its persistence.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from paged_ops import reference
from paged_ops import triton as triton_backend
from paged_ops.testing import assert_bits_equal, assert_close, make_case, nan_like, poison
from paged_ops.triton import autotune, decode, prefill
from paged_ops.triton._common import INTERPRET, fp8_format
from paged_ops.triton._tiles import fp8_bits_to_float
from tests.test_ops import DECODE_SMALL
import triton
import triton.language as tl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

@pytest.fixture(autouse=True)
def _default_configs_from_an_empty_cache(monkeypatch, tmp_path):
    # On a GPU, every new shape would otherwise be benchmarked over all candidates, and a
    # user's stored configs would leak in: tests run the default configs from an empty cache
    # (test_gpu_tuning_picks_and_persists turns tuning back on).
    monkeypatch.setenv("PAGED_OPS_TRITON_AUTOTUNE", "0")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path / "paged_ops_cache"))


def test_interpreter_flag_took_effect():
    # tests/conftest.py sets TRITON_INTERPRET before triton is imported; without it every test
    # below would be running (or failing to run) something else.
    assert INTERPRET == (not torch.cuda.is_available())
    assert triton_backend.is_available() and DEVICE in triton_backend.DEVICES
    assert DEVICE in triton_backend.DEVICES


# ---------------------------------------------------------------------------------------------
# decode: forced flash-decoding splits

# Split counts forced on test_ops' small decode grid (the router's calls take the
# occupancy heuristic, which picks one split for most of these short sequences).
FORCED_SPLITS = {2: 3, 3: 4, 4: 2, 5: 1, 6: 4, 7: 3, 9: 3, 11: 2, 12: 3, 13: 2, 14: 2}


@pytest.mark.parametrize("index,splits", sorted(FORCED_SPLITS.items()),
                         ids=[f"{DECODE_SMALL[i].id}-splits{n}" for i, n in sorted(FORCED_SPLITS.items())])
def test_decode_forced_splits(index, splits):
    case = DECODE_SMALL[index].build(DEVICE)
    out = nan_like(case.query)
    # 16-token tiles so that even these short sequences can be cut into several partitions
    used = decode.run_decode(*case.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=splits)
    assert (used > 1) == (splits > 1), f"asked for {splits} splits, ran {used}"
    assert_close(out, case.reference_decode(), case.dtype)


@pytest.mark.parametrize("block_n,num_splits", [(16, 5), (32, 2)])
def test_decode_split_counts_agree(block_n, num_splits):
    # The split path and the single-program path must agree with each other (LSE merge) and
    # with the reference, including sequences shorter than one partition.
    case = make_case([1, 40, 80, 17], num_heads=4, num_kv_heads=1, head_size=64, block_size=16, seed=3,
                     device=DEVICE)
    args, ref = case.decode_args(nan_like(case.query)), case.reference_decode()
    config = dict(decode.DEFAULT_CONFIG, BLOCK_N=block_n)
    max_len = decode.max_len_bound(case.block_tables, 16)
    _, expected_splits = decode.partition_for(max_len, num_splits, block_n)
    assert expected_splits > 1
    assert decode.run_decode(*args, config, num_splits=num_splits) == expected_splits
    split_out = args[0].clone()
    poison(args[0])
    assert decode.run_decode(*args, config, num_splits=1) == 1
    assert_close(split_out, ref, F32)
    assert_close(args[0], ref, F32)


def test_split_heuristic():
    # Few programs on many SMs: split up to ~2 waves, bounded by whole tiles of the length.
    assert decode.choose_num_splits(1, 1, 4096, 64, sms=132) == 64
    assert decode.choose_num_splits(2, 8, 1 << 20, 64, sms=132) == math.ceil(264 / 16)
    assert decode.choose_num_splits(256, 8, 4096, 64, sms=132) == 1  # already > 2 waves
    assert decode.choose_num_splits(1, 1, 10, 64, sms=132) == 1  # shorter than one tile
    partition, splits = decode.partition_for(100, 3, 16)
    assert partition % 16 == 0 and (splits - 1) * partition < 100 <= splits * partition


# ---------------------------------------------------------------------------------------------
# prefill

def test_prefill_small_tiles_cross_many_kv_tiles():
    # Tiles much smaller than the sequence: many q tiles per sequence, causal tile skipping and
    # the diagonal tile all happen; a 1-query-token tile at the end of a long context too.
    case = make_case([70, 41], [70, 1], num_heads=2, num_kv_heads=1, head_size=64, block_size=3, seed=2,
                     device=DEVICE)
    out = nan_like(case.query)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    prefill.run_prefill(*case.prefill_args(out), config)
    assert_close(out, case.reference_prefill(), F32)


# ---------------------------------------------------------------------------------------------
# fp8

@triton.jit
def _fp8_decode_probe_kernel(out_ptr, in_ptr, FP8_FORMAT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, fp8_bits_to_float(tl.load(in_ptr + offs), FP8_FORMAT))


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_cache_decoding_is_exact(fp8):
    # The attention kernels decode fp8 cache bytes by hand (no Triton fp8 types): every finite
    # code must give torch's value exactly (NaN/inf codes are never produced by the cache writer).
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _fp8_decode_probe_kernel[(1,)](out, codes, FP8_FORMAT=fp8_format(fp8))
    want = codes.view(fp8).float()
    finite = torch.isfinite(want)
    assert torch.equal(out[finite].view(torch.int32), want[finite].view(torch.int32))


def test_quantize_dequantize_non_contiguous_2d():
    # Called on the backend directly: the router wants contiguous tensors, the kernels take strides.
    torch.manual_seed(6)
    x = torch.randn(33, 40, device=DEVICE).t()  # [40, 33], non-contiguous
    scale = torch.tensor([0.05], device=DEVICE)
    out = poison(torch.empty(33, 40, dtype=E4M3, device=DEVICE)).t()
    ref = torch.empty(40, 33, dtype=E4M3, device=DEVICE)
    triton_backend.quantize_fp8(out, x, scale)
    reference.quantize_fp8(ref, x, scale)
    assert_bits_equal(out, ref)
    back = poison(torch.empty(33, 40, dtype=BF16, device=DEVICE)).t()
    ref_back = torch.empty(40, 33, dtype=BF16, device=DEVICE)
    triton_backend.dequantize_fp8(back, ref, scale)
    reference.dequantize_fp8(ref_back, ref, scale)
    assert_bits_equal(back, ref_back)


# ---------------------------------------------------------------------------------------------
# GPU lowering, checked without a GPU

def test_default_configs_compile_for_sm90_without_spills():
    # The interpreter never lowers the kernels: compile them for sm_90 with Triton's bundled
    # ptxas (no GPU needed) and check the untuned default configs fit shared memory and do not
    # spill registers. This is what the first call on an H100/H200 will compile.
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton without its bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "paged_ops.triton.aot", "--arch", "90", "--quick", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["op"] for r in rows} == {"decode", "prefill"} and len(rows) == 6
    for r in rows:
        assert 0 < r["shared"] <= 227 * 1024, r
        assert r["spills"] == 0, r


# ---------------------------------------------------------------------------------------------
# config inspection and persistence

def test_last_config_reports_the_config_used():
    case = make_case([5, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, device=DEVICE)
    args, ref = case.decode_args(nan_like(case.query)), case.reference_decode()
    triton_backend.decode_attention(*args)
    info = triton_backend.last_config("decode_attention")
    assert info["key"] == list(decode.tuning_key(args[1], case.key_cache, case.block_tables))
    # tuning is off here (interpreter, or the fixture on a GPU): the default config
    assert info["source"] == "default" and info["config"] == decode.default_config(64, F16)
    if INTERPRET:
        assert info["config"] == decode.DEFAULT_CONFIG
    assert_close(args[0], ref, F16)
    # Asking beforehand gives the same config, plus the split count the heuristic picks.
    predicted = triton_backend.config_for("decode_attention", *args)
    assert {k: v for k, v in predicted.items() if k != "num_splits"} == info["config"]
    max_len = decode.max_len_bound(case.block_tables, 16)
    assert predicted["num_splits"] == decode.partition_for(max_len, decode.choose_num_splits(
        2, 2, max_len, info["config"]["BLOCK_N"], decode.num_sms(args[1].device)), info["config"]["BLOCK_N"])[1]

    case = make_case([5, 20], [2, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                     device=DEVICE)
    pargs = case.prefill_args(nan_like(case.query))
    predicted = triton_backend.config_for("prefill_attention", *pargs)
    triton_backend.prefill_attention(*pargs)
    assert triton_backend.last_config("prefill_attention")["config"] == predicted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarking needs a GPU")
def test_gpu_tuning_picks_and_persists(monkeypatch, tmp_path):
    # Two candidates only (each one is a compile): the real benchmark path, the JSON entry,
    # and correctness of whichever config won.
    monkeypatch.setenv("PAGED_OPS_TRITON_AUTOTUNE", "1")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    candidates = [decode.default_config(128, F16),
                  {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 2.0}]
    monkeypatch.setattr(decode, "_candidates", lambda head_size, dtype: candidates)
    case = make_case([300, 1000], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=F16, seed=11,
                     device=DEVICE)
    args, ref = case.decode_args(nan_like(case.query)), case.reference_decode()
    triton_backend.decode_attention(*args)
    info = triton_backend.last_config("decode_attention")
    assert info["source"] == "tuned" and info["config"] in candidates
    poison(args[0])
    triton_backend.decode_attention(*args)  # the tuned config, from memory
    assert triton_backend.last_config("decode_attention")["source"] == "memo"
    assert_close(args[0], ref, F16)
    stored = json.loads((tmp_path / "tuning.json").read_text())["entries"]
    assert [e["config"] for e in stored.values()] == [info["config"]]


_TUNE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    if {interpret}:
        os.environ["TRITON_INTERPRET"] = "1"
    from paged_ops.triton import autotune
    mode = sys.argv[1]
    tuner = autotune.TUNERS["decode_attention"]
    candidates = [{{"BLOCK_N": n, "num_warps": 4, "num_stages": 2}} for n in (16, 32, 64)]
    default = {{"BLOCK_N": 256, "num_warps": 1, "num_stages": 2}}
    key = (16, 128, 4, 1024, 8, "torch.float16", "torch.float16")
    if mode == "tune":
        def bench(config):  # fake timings: 32 is fastest, 64 fails to compile
            if config["BLOCK_N"] == 64:
                raise RuntimeError("out of resources")
            return {{16: 2.0, 32: 1.0}}[config["BLOCK_N"]]
    else:
        def bench(config):
            raise AssertionError("a persisted config must not be re-benchmarked")
    chosen = tuner.choose("gpu-x", key, default, candidates, bench, force=(mode == "tune"))
    print(json.dumps({{"chosen": chosen, "last": autotune.last_config("decode_attention")}}))
""")


def test_tuned_config_persists_across_processes(tmp_path):
    script = _TUNE_SCRIPT.format(interpret=INTERPRET)
    env = dict(os.environ, PAGED_OPS_CACHE_DIR=str(tmp_path))
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(mode):
        proc = subprocess.run([sys.executable, "-c", script, mode], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    tuned = run("tune")
    assert tuned["chosen"] == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert tuned["last"]["source"] == "tuned"
    stored = json.loads((tmp_path / "tuning.json").read_text())["entries"]
    assert [e["config"] for e in stored.values()] == [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}]

    reused = run("reuse")  # a fresh process: read from disk, no benchmark
    assert reused["chosen"] == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert reused["last"]["source"] == "cache"


def test_corrupt_tuning_cache_is_ignored(tmp_path, monkeypatch):
    (tmp_path / "tuning.json").write_text("{not json")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    tuner = autotune.Tuner("decode_attention")
    default = {"BLOCK_N": 16}
    assert tuner.choose("gpu-x", (1,), default, [], bench=None) == default
    assert autotune.last_config("decode_attention")["source"] == "default"

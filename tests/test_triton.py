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
from paged_ops.triton._common import INTERPRET, Variants, fp8_format
from paged_ops.triton._tiles import fp8_bits_to_float, tanh
from tests.test_ops import DECODE_SMALL
import triton
import triton.language as tl

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# The default configs from an empty cache (tests/conftest.py); test_gpu_tuning_picks_and_persists
# turns tuning back on.
pytestmark = pytest.mark.usefixtures("untuned_configs")


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
    monkeypatch.setenv("PAGED_OPS_AUTOTUNE", "1")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    candidates = [decode.default_config(128, F16),
                  {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": 2.0}]
    monkeypatch.setattr(decode, "_candidates", lambda head_size, dtype, value_head_size=None: candidates)
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


# ---------------------------------------------------------------------------------------------
# attention variants (issue #13): softcap, window_left, sinks, alibi_slopes, lse — in the split
# and unsplit decode kernels, the reduce, the prefill kernel (small tiles), and the row-wise
# batch-invariant path. The cross-backend contract tests are in tests/test_ops.py.

def _variant_args(spec: str, num_heads: int, seed: int = 0) -> dict:
    """Variant keyword arguments named by ``spec``: '+'-joined softcap, window, sinks, alibi."""
    g = torch.Generator().manual_seed(seed)
    kw = {}
    for part in filter(None, spec.split("+")):
        if part == "softcap":
            kw["softcap"] = 1.5  # small: most scores are capped hard, so a missing cap shows
        elif part.startswith("window"):
            kw["window_left"] = int(part[len("window"):] or 40)
        elif part == "sinks":
            kw["sinks"] = torch.randn(num_heads, generator=g) * 2
        elif part == "alibi":
            kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.5
        else:
            raise ValueError(part)
    return kw


def _on(kw: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _reference(case, kw: dict, decode_op: bool, causal: bool = True):
    """(out, lse) of the float64 reference with the variants, on the CPU."""
    out = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    args = case._on_cpu_in_float64(case.decode_args(out) if decode_op else case.prefill_args(out, causal))
    (reference.decode_attention if decode_op else reference.prefill_attention)(*args, lse=lse, **kw)
    return out, lse


def _nan_lse(case) -> torch.Tensor:
    return torch.full(case.query.shape[:2], float("nan"), dtype=torch.float32, device=case.device)


VARIANT_SPECS = ["softcap", "window", "sinks", "alibi", "softcap+window+sinks+alibi"]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("spec", VARIANT_SPECS)
def test_decode_variants_split_and_unsplit(spec, splits):
    # GQA group 2, 16-token tiles and forced splits: the sink must join once (in the reduce when
    # split), the lse is written by whichever kernel ends the row, and a window plans its splits
    # over the visible keys (3 asked, fewer used when the window is shorter than 3 tiles).
    case = make_case([1, 40, 80, 17, 200], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=3,
                     device=DEVICE)
    kw = _variant_args(spec, 4)
    ref, ref_lse = _reference(case, kw, decode_op=True)
    out, lse = nan_like(case.query), _nan_lse(case)
    variants = Variants(lse=lse, **_on(kw, DEVICE))
    used = decode.run_decode(*case.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=splits,
                             variants=variants)
    assert (used > 1) == (splits > 1)
    assert_close(out, ref, F32)
    assert_close(lse, ref_lse, F32)


@pytest.mark.parametrize("dtype,cache_dtype,layout", [(F16, F16, "HND"), (BF16, E4M3, "NHD"), (F32, E5M2, "HND")])
def test_decode_variants_fp8_and_layouts(dtype, cache_dtype, layout):
    # Every variant at once on 16-bit queries, fp8 caches (k_scale folds into the score scale
    # before the cap) and head-major caches, through the backend's entry point (its heuristic).
    case = make_case([3, 33, 70], num_heads=8, num_kv_heads=2, head_size=40, block_size=8, dtype=dtype,
                     cache_dtype=cache_dtype, layout=layout, scale_kind="head", seed=5, device=DEVICE)
    kw = _variant_args("softcap+window20+sinks+alibi", 8, seed=1)
    ref, ref_lse = _reference(case, kw, decode_op=True)
    out, lse = nan_like(case.query), _nan_lse(case)
    triton_backend.decode_attention(*case.decode_args(out), lse=lse, **_on(kw, DEVICE))
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, F32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("spec", VARIANT_SPECS + ["window2"])
def test_prefill_variants_small_tiles(spec, causal):
    # 16-row query tiles, 16-key tiles, block size 3: chunked prefill over cached context, a
    # decode row, an empty sequence. window2 with 16-row tiles: the tile's last rows see nothing
    # in its first KV tile (their windows start later), the case MAY_BE_EMPTY exists for.
    case = make_case([70, 41, 5, 30], [70, 1, 0, 12], num_heads=4, num_kv_heads=2, head_size=64, block_size=3,
                     seed=2, device=DEVICE)
    kw = _variant_args(spec, 4)
    ref, ref_lse = _reference(case, kw, decode_op=False, causal=causal)
    out, lse = nan_like(case.query), _nan_lse(case)
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    prefill.run_prefill(*case.prefill_args(out, causal), config, Variants(lse=lse, **_on(kw, DEVICE)))
    assert_close(out, ref, F32)
    assert_close(lse, ref_lse, F32)


def test_softcap_tanh_is_accurate():
    # The kernels' own tanh (libdevice's does not run under the interpreter): a few ulps over
    # the whole range, including near 0 where the exponential form alone loses ~1e-7 absolute.
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.linspace(-0.6, 0.6, 2001), torch.tensor([0.0, 1e-30])])
    x = x.to(DEVICE)
    out = torch.empty_like(x)
    _tanh_probe_kernel[(1,)](out, x, x.numel(), BLOCK=8192)
    want = torch.tanh(x.double())
    assert ((out.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * want.abs().clamp_min(1e-30)).all()


@triton.jit
def _tanh_probe_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tanh(tl.load(in_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)


def _poison_before_window(case, seq: int, first_visible: int) -> None:
    """NaN into sequence ``seq``'s K and V at every position before ``first_visible``."""
    bs = case.key_cache.shape[1]
    for j in range(first_visible):
        block = int(case.block_tables[seq, j // bs])
        case.key_cache[block, j % bs] = float("nan")
        case.value_cache[block, j % bs] = float("nan")


@pytest.mark.parametrize("splits", [1, 2])
def test_window_decode_never_reads_keys_before_the_window(splits):
    # Keys before a row's window are not merely masked but never loaded: NaN there (a masked
    # score still multiplies its V by 0, and 0 * NaN is NaN) leaves the output intact, whether
    # the row is split or not. The reference sees the clean cache.
    window = 20
    case = make_case([150, 90], num_heads=4, num_kv_heads=1, head_size=64, block_size=4, seed=8, device=DEVICE)
    kw = {"window_left": window}
    ref, ref_lse = _reference(case, kw, decode_op=True)
    for s, n in enumerate([150, 90]):
        _poison_before_window(case, s, n - 1 - window)
    for batch_invariant in (False, True):
        out, lse = nan_like(case.query), _nan_lse(case)
        if batch_invariant:
            triton_backend.decode_attention(*case.decode_args(out), lse=lse, batch_invariant=True, **kw)
        else:
            decode.run_decode(*case.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=splits,
                              variants=Variants(lse=lse, **kw))
        assert_close(out, ref, F32, msg=f"batch_invariant={batch_invariant}")
        assert_close(lse, ref_lse, F32)


def test_window_prefill_never_reads_keys_before_the_window():
    # A chunk of 8 queries at the end of 120 cached tokens, window 10: the tile's first row sees
    # keys from 120 - 8 - 10 on; NaN in every key before that must not reach the output.
    window = 10
    case = make_case([120], [8], num_heads=2, num_kv_heads=1, head_size=64, block_size=4, seed=9, device=DEVICE)
    kw = {"window_left": window}
    ref, _ = _reference(case, kw, decode_op=False)
    _poison_before_window(case, 0, 120 - 8 - window)
    out = nan_like(case.query)
    prefill.run_prefill(*case.prefill_args(out), {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
                        Variants(**kw))
    assert_close(out, ref, F32)


def test_window_splits_are_planned_over_the_window():
    # A window of 64 keys in a table of 4096 tokens: the heuristic's splits cut the window, not
    # the table (a split count from 4096 keys would make 64-key windows mostly empty partitions).
    case = make_case([5], num_heads=4, num_kv_heads=1, head_size=64, block_size=16, seed=1, device=DEVICE)
    table = torch.zeros(1, 256, dtype=torch.int32, device=DEVICE)
    bound = decode.visible_bound(decode.max_len_bound(table, 16), Variants(window_left=63))
    assert bound == 64
    assert decode.visible_bound(decode.max_len_bound(table, 16), Variants(window_left=63), causal=False) == 4096
    info = triton_backend.config_for("decode_attention", nan_like(case.query), case.query, case.key_cache,
                                     case.value_cache, table, case.seq_lens, case.scale, None, None, 0.0, 63)
    assert info["num_splits"] <= math.ceil(64 / info["BLOCK_N"])


# ---------------------------------------------------------------------------------------------
# batch-invariant mode

BI_SPECS = ["", "softcap+window300+sinks+alibi"]


@pytest.mark.parametrize("spec", BI_SPECS)
def test_batch_invariant_decode_row_is_independent_of_the_batch(spec):
    # One sequence of 600 tokens (3 partitions of 256) decoded alone and next to others: a longer
    # one (wider table: more splits in the grid), short ones, a different batch size. Its row's
    # out and lse must be bitwise the same.
    kw = _on(_variant_args(spec, 4, seed=4), DEVICE)
    lens = [600, 1200, 3, 77]
    case = make_case(lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, seed=6,
                     device=DEVICE)
    out, lse = nan_like(case.query), _nan_lse(case)
    triton_backend.decode_attention(*case.decode_args(out), lse=lse, batch_invariant=True, **kw)
    ref, ref_lse = _reference(case, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                              decode_op=True)
    assert_close(out, ref, F16)
    assert_close(lse, ref_lse, F32)
    for rows in ([0], [0, 2], [3, 0]):
        sub = torch.tensor(rows, device=DEVICE)
        width = max(math.ceil(lens[r] / 16) for r in rows) + 1  # the table as narrow as this batch allows
        sub_out, sub_lse = nan_like(case.query[sub]), torch.full((len(rows), 4), float("nan"), device=DEVICE)
        triton_backend.decode_attention(sub_out, case.query[sub], case.key_cache, case.value_cache,
                                        case.block_tables[sub, :width].contiguous(), case.seq_lens[sub],
                                        case.scale, None, None, lse=sub_lse, batch_invariant=True, **kw)
        i = rows.index(0)
        assert_bits_equal(sub_out[i], out[0], f"rows {rows}")
        assert_bits_equal(sub_lse[i], lse[0], f"rows {rows}")


@pytest.mark.parametrize("spec", BI_SPECS)
def test_batch_invariant_prefill_rows_equal_decode(spec):
    # Chunked prefill of a sequence with 560 cached tokens (rows at positions 560..565, 3
    # partitions each), next to another sequence's whole prompt: each causal row at position p
    # must give the bits of a decode of the first p + 1 tokens, out and lse.
    kw = _on(_variant_args(spec, 4, seed=4), DEVICE)
    case = make_case([566, 9], [6, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                     seed=7, device=DEVICE)
    out, lse = nan_like(case.query), _nan_lse(case)
    triton_backend.prefill_attention(*case.prefill_args(out), lse=lse, batch_invariant=True, **kw)
    ref, ref_lse = _reference(case, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                              decode_op=False)
    assert_close(out, ref, F16)
    assert_close(lse, ref_lse, F32)
    # The same rows as decodes of sequence 0 cut at p + 1 tokens, all in one decode batch.
    positions = list(range(560, 566))
    rows = torch.tensor(positions, device=DEVICE) - 560
    dec_out, dec_lse = nan_like(case.query[rows]), torch.full((len(positions), 4), float("nan"), device=DEVICE)
    tables = case.block_tables[[0] * len(positions)].contiguous()
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=DEVICE)
    triton_backend.decode_attention(dec_out, case.query[rows], case.key_cache, case.value_cache, tables, seq_lens,
                                    case.scale, None, None, lse=dec_lse, batch_invariant=True, **kw)
    assert_bits_equal(dec_out, out[:6])
    assert_bits_equal(dec_lse, lse[:6])


def test_batch_invariant_uses_a_fixed_config_and_split_size(monkeypatch):
    # A tuned (stored) config must not reach the mode: the lookup is never consulted.
    def no_tuner(*args, **kwargs):
        raise AssertionError("the batch-invariant mode consulted the tuner")
    monkeypatch.setattr(autotune.TUNERS["decode_attention"], "choose", no_tuner)
    monkeypatch.setattr(autotune.TUNERS["prefill_attention"], "choose", no_tuner)
    case = make_case([20], [3], num_heads=2, num_kv_heads=1, head_size=64, block_size=16, seed=1, device=DEVICE)
    out = nan_like(case.query)
    triton_backend.prefill_attention(*case.prefill_args(out), batch_invariant=True)
    assert_close(out, case.reference_prefill(), F32)
    assert decode.BATCH_INVARIANT_PARTITION % decode.default_config(64, F16)["BLOCK_N"] == 0


# ---------------------------------------------------------------------------------------------
# merge_attention_states

@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_merge_attention_states_matches_reference(dtype):
    # Head size 40 (a padded tile), 5 heads (a partial head block), strided outputs; lses with
    # -inf on one side (whose out is NaN, as attention over no keys leaves it: it must contribute
    # nothing, not 0 * NaN), on both, +inf and NaN, which must give the reference's NaN pattern.
    g = torch.Generator().manual_seed(0)
    T, H, D = 7, 5, 40
    prefix = torch.randn(T, H, D, generator=g).to(dtype)
    suffix = torch.randn(T, H + 1, D, generator=g).to(dtype)
    a, b = torch.randn(T, H, generator=g) * 3, torch.randn(T, H, generator=g) * 3
    a[0, 0] = -math.inf
    prefix[0, 0] = math.nan
    b[1, 1] = -math.inf
    suffix[1, 1] = math.nan
    prefix, suffix = prefix.to(DEVICE), suffix.to(DEVICE)[:, :H]  # suffix: head stride != D * H
    a[2, 2] = b[2, 2] = -math.inf
    a[3, 3] = math.inf
    b[4, 4] = math.nan
    a, b = a.to(DEVICE), b.to(DEVICE)
    out = poison(torch.empty(T, H, 2 * D, dtype=dtype, device=DEVICE))[..., :D]
    out_lse = torch.full((T, H), math.nan, device=DEVICE)
    triton_backend.merge_attention_states(out, out_lse, prefix, a, suffix, b)
    ref = torch.empty(T, H, D, dtype=torch.float64)
    ref_lse = torch.empty(T, H, dtype=torch.float64)
    reference.merge_attention_states(ref, ref_lse, prefix.cpu(), a.cpu(), suffix.cpu(), b.cpu())
    out, out_lse = out.cpu(), out_lse.cpu()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out_lse.isnan(), ref_lse.isnan())
    assert torch.equal(out_lse == -math.inf, ref_lse == -math.inf)
    finite = ~ref.isnan()
    assert_close(out[finite], ref[finite], dtype)
    finite = ref_lse.isfinite()
    assert_close(out_lse[finite], ref_lse[finite], F32)
    # Without out_lse: the same out.
    out2 = nan_like(prefix)
    triton_backend.merge_attention_states(out2, None, prefix, a, suffix, b)
    assert_bits_equal(out2.cpu(), out)


def test_cascade_prefix_then_suffix_merges_to_full_attention():
    # Shared-prefix attention: 6 query rows at the end of 50 tokens, over the first 36 keys
    # (causal=False: every prefix key precedes the rows) and over the last 14 (causal, the same
    # table from block 9 on: 36 is a block boundary), merged by their lses, equal attention over
    # all 50 keys.
    case = make_case([50], [6], num_heads=4, num_kv_heads=2, head_size=64, block_size=4, seed=12, device=DEVICE)
    prefix_len = 36
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    parts = []
    for table, length, causal in ((case.block_tables, prefix_len, False),
                                  (case.block_tables[:, prefix_len // 4:].contiguous(), 50 - prefix_len, True)):
        part_out, part_lse = nan_like(case.query), _nan_lse(case)
        prefill.run_prefill(part_out, case.query, case.key_cache, case.value_cache, table, case.cu_seqlens_q,
                            torch.tensor([length], dtype=torch.int32, device=DEVICE), 6, case.scale, causal, None,
                            None, cfg, Variants(lse=part_lse))
        parts += [part_out, part_lse]
    out = nan_like(case.query)
    triton_backend.merge_attention_states(out, None, *parts)
    assert_close(out, case.reference_prefill(), F32)


def test_batch_invariant_rows_launched_in_chunks_give_the_same_bits(monkeypatch):
    # Long prefills against long tables launch their rows in chunks (the partials stay under
    # BATCH_INVARIANT_SCRATCH_BYTES): a row's bits must not depend on the chunk it lands in.
    case = make_case([300, 40], [7, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=13,
                     device=DEVICE)
    kw = _on(_variant_args("sinks", 4), DEVICE)
    whole, whole_lse = nan_like(case.query), _nan_lse(case)
    triton_backend.prefill_attention(*case.prefill_args(whole), lse=whole_lse, batch_invariant=True, **kw)
    per_row = 4 * 2 * 64 * 4  # num_heads x num_splits (2 of 256 keys) x head_size x fp32
    monkeypatch.setattr(decode, "BATCH_INVARIANT_SCRATCH_BYTES", 5 * per_row)  # chunks of 5 rows: 5 + 5 + 2
    chunked, chunked_lse = nan_like(case.query), _nan_lse(case)
    triton_backend.prefill_attention(*case.prefill_args(chunked), lse=chunked_lse, batch_invariant=True, **kw)
    assert_bits_equal(chunked, whole)
    assert_bits_equal(chunked_lse, whole_lse)
    assert_close(whole, _reference(case, {"sinks": kw["sinks"].cpu()}, decode_op=False)[0], F32)

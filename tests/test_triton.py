"""Tests of the Triton backend against ``paged_ops.reference`` (float64).

Without a GPU the kernels run under the Triton interpreter on CPU tensors; the variable must
be set before the kernel modules are imported (Triton decides interpreter vs. compiler when a
``@triton.jit`` function is defined).

Every attention case poisons the output and every cache slot a sequence must not read (slots
past seq_len, blocks in no table) with NaN, and fills table entries past seq_len with garbage
block ids: a kernel that reads any of them fails the error budget with NaN.
The grid is a pairwise-style cover of block size x group x head size x dtype x layout x fp8
format/scale granularity rather than a full cross product: the interpreter is slow.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


import paged_ops  # noqa: E402
from paged_ops import reference  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.helpers import poison as poison_  # noqa: E402
from paged_ops import triton as triton_backend  # noqa: E402
from paged_ops.triton import autotune, decode, prefill  # noqa: E402
from paged_ops.triton._common import INTERPRET, fp8_format  # noqa: E402
from paged_ops.triton._tiles import fp8_bits_to_float  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GARBAGE_BLOCK_ID = 1 << 30  # table entries past seq_len: reading one would fault or read NaN

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
# helpers

def backend():
    """The Triton backend through the lead's router (validates inputs, then calls our functions)."""
    return paged_ops.backend("triton")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for bit-identity checks that NaN != NaN would defeat."""
    return t.contiguous().view(torch.uint8).cpu()


def empty_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout):
    return helpers.empty_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout, DEVICE)


def make_scales(cache_dtype, num_kv_heads, scale_mode):
    """fp8 k/v scales: 'tensor' = 1 element, 'head' = one per KV head; None for other caches."""
    if cache_dtype not in FP8:
        return None, None
    n = 1 if scale_mode == "tensor" else num_kv_heads
    return tuple(torch.rand(n, device=DEVICE) * 0.4 + 0.1 for _ in range(2))


class Paged:
    """A batch of sequences whose first seq_lens[s] tokens are cached (through the reference
    reshape_and_cache), all other slots NaN, plus a few blocks that no table references."""

    def __init__(self, *, dtype, cache_dtype, block_size, num_kv_heads, head_size, seq_lens,
                 layout="NHD", scale_mode="tensor", seed=0):
        torch.manual_seed(seed)
        self.dtype, self.cache_dtype = dtype, cache_dtype
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
        width = max(blocks_needed) + 1  # one spare column: it must never be read
        num_blocks = sum(blocks_needed) + 3  # three blocks in no table at all
        self.key_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
        self.value_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
        ids = torch.randperm(num_blocks).tolist()
        table = torch.full((len(seq_lens), width), GARBAGE_BLOCK_ID, dtype=torch.int32)
        slots = []
        for s, (n, nb) in enumerate(zip(seq_lens, blocks_needed)):
            table[s, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
            ids = ids[nb:]
            slots += [int(table[s, p // block_size]) * block_size + p % block_size for p in range(n)]
        self.block_tables = table.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.k_scale, self.v_scale = make_scales(cache_dtype, num_kv_heads, scale_mode)
        # Model-dtype K/V (fp8 caches: with a spread that exercises the fp8 range), cached the
        # way the contract says, so fp8 attention is compared over exactly the stored bits.
        kv_dtype = dtype if cache_dtype not in FP8 else F32
        k = torch.randn(len(slots), num_kv_heads, head_size, device=DEVICE).to(kv_dtype)
        v = torch.randn(len(slots), num_kv_heads, head_size, device=DEVICE).to(kv_dtype)
        reference.reshape_and_cache(k, v, self.key_cache, self.value_cache,
                                    torch.tensor(slots, dtype=torch.int64, device=DEVICE),
                                    self.k_scale, self.v_scale)
        self.scale = head_size ** -0.5

    def query(self, num_tokens, num_heads):
        return torch.randn(num_tokens, num_heads, self.head_size, device=DEVICE).to(self.dtype)


def decode_inputs(case: Paged, group):
    q = case.query(len(case.seq_lens), case.num_kv_heads * group)
    out = poison_(torch.empty_like(q))
    ref = torch.empty(q.shape, dtype=torch.float64, device=DEVICE)
    reference.decode_attention(ref, q.double(), case.key_cache, case.value_cache, case.block_tables,
                               case.seq_lens, case.scale, case.k_scale, case.v_scale)
    args = (out, q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale,
            case.k_scale, case.v_scale)
    return args, ref


# ---------------------------------------------------------------------------------------------
# decode

# (dtype, cache dtype, block size, kv heads, group, head size, layout, seq_lens, fp8 scale, splits)
# splits: None = the occupancy heuristic, k = forced flash-decoding split count.
DECODE_CASES = [
    (F32, F32, 16, 2, 1, 64, "NHD", [1, 16, 33], None, None),
    (F16, F16, 1, 1, 2, 80, "HND", [1, 5, 9], None, None),
    (BF16, BF16, 3, 2, 4, 96, "NHD", [3, 7, 20], None, 3),
    (F32, F32, 256, 1, 7, 128, "HND", [1, 256, 300], None, 4),
    (F16, F16, 16, 1, 8, 256, "NHD", [32, 17], None, 2),
    (BF16, BF16, 16, 2, 1, 128, "HND", [48, 2], None, 1),
    (F32, F32, 3, 4, 2, 256, "NHD", [6, 13, 1, 30], None, 4),
    (F16, F16, 16, 2, 7, 96, "HND", [16, 64, 5], None, 3),
    (F16, E4M3, 16, 2, 2, 64, "NHD", [20, 33], "tensor", None),
    (BF16, E5M2, 3, 2, 4, 80, "HND", [9, 1, 24], "head", 3),
    (F32, E4M3, 1, 1, 7, 96, "NHD", [7, 12], "head", None),
    (F16, E5M2, 256, 2, 8, 128, "NHD", [256, 100], "tensor", 2),
    (BF16, E4M3, 16, 1, 2, 256, "HND", [40, 3], "head", 3),
    (F32, E5M2, 16, 2, 1, 80, "HND", [33], "tensor", 2),
    (F16, F16, 3, 2, 2, 8, "NHD", [4, 20], None, 2),  # head 8: padded to tl.dot's minimum 16
    (BF16, E4M3, 1, 1, 4, 16, "HND", [3, 2], "tensor", None),
]


@pytest.mark.parametrize("dtype,cache_dtype,block_size,num_kv_heads,group,head_size,layout,seq_lens,"
                         "scale_mode,splits", DECODE_CASES)
def test_decode_attention(dtype, cache_dtype, block_size, num_kv_heads, group, head_size, layout,
                          seq_lens, scale_mode, splits):
    case = Paged(dtype=dtype, cache_dtype=cache_dtype, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_size=head_size, seq_lens=seq_lens, layout=layout, scale_mode=scale_mode)
    args, ref = decode_inputs(case, group)
    if splits is None:
        backend().decode_attention(*args)
    else:
        # 16-token tiles so that even these short sequences can be cut into several partitions
        used = decode.run_decode(*args, dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=splits)
        assert (used > 1) == (splits > 1), f"asked for {splits} splits, ran {used}"
    assert_close(args[0], ref, dtype)


@pytest.mark.parametrize("block_n,num_splits", [(16, 5), (32, 2)])
def test_decode_split_counts_agree(block_n, num_splits):
    # The split path and the single-program path must agree with each other (LSE merge) and
    # with the reference, including sequences shorter than one partition.
    case = Paged(dtype=F32, cache_dtype=F32, block_size=16, num_kv_heads=1, head_size=64,
                 seq_lens=[1, 40, 80, 17], seed=3)
    args, ref = decode_inputs(case, 4)
    config = dict(decode.DEFAULT_CONFIG, BLOCK_N=block_n)
    max_len = decode.max_len_bound(case.block_tables, 16)
    _, expected_splits = decode.partition_for(max_len, num_splits, block_n)
    assert expected_splits > 1
    assert decode.run_decode(*args, config, num_splits=num_splits) == expected_splits
    split_out = args[0].clone()
    poison_(args[0])
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

# (dtype, cache dtype, block size, kv heads, group, head size, layout, seq_lens, q_lens, causal, fp8 scale)
# q_len < seq_len = chunked prefill over cached context; q_len = 1 rows = decode tokens in the
# batch; q_len = 0 = a sequence with nothing to compute.
PREFILL_CASES = [
    (F32, F32, 16, 2, 1, 64, "NHD", [16, 40, 5], [16, 40, 5], True, None),
    (F16, F16, 1, 1, 2, 80, "HND", [9, 30], [9, 12], True, None),
    (BF16, BF16, 3, 2, 4, 96, "NHD", [20, 7, 33], [1, 7, 20], True, None),
    (F32, F32, 256, 1, 7, 128, "HND", [256, 300, 3], [256, 1, 2], True, None),
    (F16, F16, 16, 1, 8, 256, "NHD", [32, 17], [32, 17], False, None),
    (BF16, BF16, 16, 2, 1, 128, "HND", [48, 9], [20, 0], False, None),
    (F32, F32, 3, 4, 2, 256, "NHD", [6, 13, 1], [6, 1, 1], True, None),
    (F16, F16, 16, 2, 7, 96, "HND", [64, 5], [33, 5], True, None),
    (F16, E4M3, 16, 2, 2, 64, "NHD", [20, 33], [20, 1], True, "tensor"),
    (BF16, E5M2, 3, 2, 4, 80, "HND", [9, 24], [9, 10], True, "head"),
    (F32, E4M3, 1, 1, 7, 96, "NHD", [12, 7], [5, 7], False, "head"),
    (F16, E5M2, 256, 2, 8, 128, "NHD", [256, 100], [40, 1], True, "tensor"),
    (BF16, E4M3, 16, 1, 2, 256, "HND", [40, 3], [40, 3], True, "head"),
    (F32, F32, 1, 2, 1, 8, "HND", [7, 20], [7, 4], True, None),
    (F16, E5M2, 3, 1, 7, 16, "NHD", [10, 1], [10, 1], False, "head"),
    # many sequences: the flat query-tile grid's binary search, empty and 1-token queries
    (F16, F16, 3, 2, 2, 64, "NHD", [9, 4, 30, 1, 17, 8, 40], [9, 0, 1, 1, 17, 3, 0], True, None),
]


@pytest.mark.parametrize("dtype,cache_dtype,block_size,num_kv_heads,group,head_size,layout,seq_lens,"
                         "q_lens,causal,scale_mode", PREFILL_CASES)
def test_prefill_attention(dtype, cache_dtype, block_size, num_kv_heads, group, head_size, layout,
                           seq_lens, q_lens, causal, scale_mode):
    case = Paged(dtype=dtype, cache_dtype=cache_dtype, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_size=head_size, seq_lens=seq_lens, layout=layout, scale_mode=scale_mode, seed=1)
    q = case.query(sum(q_lens), num_kv_heads * group)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = poison_(torch.empty_like(q))
    ref = torch.empty(q.shape, dtype=torch.float64, device=DEVICE)
    reference.prefill_attention(ref, q.double(), case.key_cache, case.value_cache, case.block_tables, cu,
                                case.seq_lens, max(q_lens), case.scale, causal, case.k_scale, case.v_scale)
    backend().prefill_attention(out, q, case.key_cache, case.value_cache, case.block_tables, cu,
                                case.seq_lens, max(q_lens), case.scale, causal, case.k_scale, case.v_scale)
    assert_close(out, ref, dtype)


# PAGED_OPS_HYPOTHESIS_EXAMPLES=200 for a longer hunt (12 keep the file fast under the interpreter).
@settings(max_examples=int(os.environ.get("PAGED_OPS_HYPOTHESIS_EXAMPLES", 12)), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_shapes_decode_and_prefill(data):
    # Property test over the same axes as the grids above, combined at random: both kernels
    # against the reference on one random batch (seeded by hypothesis, reproducible).
    dtype = data.draw(st.sampled_from([F32, F16, BF16]), "dtype")
    cache_dtype = data.draw(st.sampled_from([dtype, E4M3, E5M2]), "cache_dtype")
    block_size = data.draw(st.sampled_from([1, 2, 3, 5, 16, 32]), "block_size")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 7, 8]), "group")
    head_size = data.draw(st.sampled_from([8, 24, 64, 80, 96, 128]), "head_size")
    seq_lens = data.draw(st.lists(st.integers(1, 48), min_size=1, max_size=4), "seq_lens")
    q_lens = [data.draw(st.integers(0, n), "q_len") for n in seq_lens]
    case = Paged(dtype=dtype, cache_dtype=cache_dtype, block_size=block_size, num_kv_heads=2,
                 head_size=head_size, seq_lens=seq_lens, layout=data.draw(st.sampled_from(["NHD", "HND"])),
                 scale_mode=data.draw(st.sampled_from(["tensor", "head"])), seed=data.draw(st.integers(0, 99)))
    args, ref = decode_inputs(case, group)
    triton_backend.decode_attention(*args)
    assert_close(args[0], ref, dtype)
    if sum(q_lens) == 0:
        return
    causal = data.draw(st.booleans(), "causal")
    q = case.query(sum(q_lens), 2 * group)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    pargs = [poison_(torch.empty_like(q)), q, case.key_cache, case.value_cache, case.block_tables, cu,
             case.seq_lens, max(q_lens), case.scale, causal, case.k_scale, case.v_scale]
    pref = torch.empty(q.shape, dtype=torch.float64, device=DEVICE)
    reference.prefill_attention(pref, q.double(), *pargs[2:])
    triton_backend.prefill_attention(*pargs)
    assert_close(pargs[0], pref, dtype)


def test_prefill_small_tiles_cross_many_kv_tiles():
    # Tiles much smaller than the sequence: many q tiles per sequence, causal tile skipping and
    # the diagonal tile all happen; a 1-query-token tile at the end of a long context too.
    case = Paged(dtype=F32, cache_dtype=F32, block_size=3, num_kv_heads=1, head_size=64,
                 seq_lens=[70, 41], seed=2)
    q_lens = [70, 1]
    q = case.query(sum(q_lens), 2)
    cu = torch.tensor([0, 70, 71], dtype=torch.int32, device=DEVICE)
    out = poison_(torch.empty_like(q))
    ref = torch.empty(q.shape, dtype=torch.float64, device=DEVICE)
    reference.prefill_attention(ref, q.double(), case.key_cache, case.value_cache, case.block_tables, cu,
                                case.seq_lens, 70, case.scale, True)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    prefill.run_prefill(out, q, case.key_cache, case.value_cache, case.block_tables, cu, case.seq_lens,
                        70, case.scale, True, None, None, config)
    assert_close(out, ref, F32)


def test_router_dispatches_to_triton():
    # torch.ops.paged.* forced to this backend: the public entry point reaches our kernels.
    case = Paged(dtype=F16, cache_dtype=E4M3, block_size=16, num_kv_heads=2, head_size=64,
                 seq_lens=[9, 30], scale_mode="head", seed=9)
    args, ref = decode_inputs(case, 4)
    with paged_ops.use_backend("triton"):
        torch.ops.paged.decode_attention(*args)
    assert_close(args[0], ref, F16)


# ---------------------------------------------------------------------------------------------
# reshape_and_cache, fp8 quantization, block copies

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

@pytest.mark.parametrize("cache_dtype,block_size,layout,scale_mode,dtype", [
    (F32, 16, "NHD", None, F32),
    (F16, 3, "HND", None, F16),
    (BF16, 1, "NHD", None, BF16),
    (E4M3, 16, "HND", "tensor", F16),
    (E4M3, 3, "NHD", "head", BF16),
    (E5M2, 1, "HND", "head", F32),
    (E5M2, 16, "NHD", "tensor", BF16),
])
def test_reshape_and_cache_bit_identical(cache_dtype, block_size, layout, scale_mode, dtype):
    torch.manual_seed(4)
    num_tokens, num_kv_heads, head_size = 11, 3, 80
    num_blocks = math.ceil(num_tokens / block_size) + 2
    key_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
    value_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    # Spread over many binades: fp8 subnormals, ties and outliers past the fp8 max (saturation).
    key = (torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE)
           * torch.exp(torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE) * 6)).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype) * 1000
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::4] = -1  # padding tokens: skipped
    k_scale, v_scale = make_scales(cache_dtype, num_kv_heads, scale_mode)
    backend().reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, k_scale, v_scale)
    assert torch.equal(bits(key_cache), bits(ref_k))
    assert torch.equal(bits(value_cache), bits(ref_v))


def fp8_probe(dtype: torch.dtype, fp8: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours (ties: round-to-even) and its
    two float32 neighbours, out-of-range values and infinities (saturate), random values."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].sort().values.unique()
    mids = ((values[1:].double() + values[:-1].double()) / 2).float()
    up, down = torch.full_like(mids, math.inf), torch.full_like(mids, -math.inf)
    special = torch.tensor([1e9, -1e9, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30])
    rand = torch.randn(4000) * torch.exp(torch.randn(4000) * 5)
    probe = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), special, rand])
    return probe.to(dtype).to(DEVICE)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_quantize_dequantize_bit_identical(fp8, dtype):
    torch.manual_seed(5)
    x = fp8_probe(dtype, fp8)
    for scale_value in (1.0, 0.37, 3e-3):
        scale = torch.tensor([scale_value], device=DEVICE)
        out = poison_(torch.empty(x.shape, dtype=fp8, device=DEVICE))
        ref = torch.empty_like(out)
        backend().quantize_fp8(out, x, scale)
        reference.quantize_fp8(ref, x, scale)
        assert torch.equal(bits(out), bits(ref)), f"quantize {dtype}->{fp8} scale {scale_value}"

        back = poison_(torch.empty(x.shape, dtype=dtype, device=DEVICE))
        ref_back = torch.empty_like(back)
        backend().dequantize_fp8(back, ref, scale)
        reference.dequantize_fp8(ref_back, ref, scale)
        assert torch.equal(bits(back), bits(ref_back)), f"dequantize {fp8}->{dtype} scale {scale_value}"


def test_quantize_dequantize_non_contiguous_2d():
    torch.manual_seed(6)
    x = torch.randn(33, 40, device=DEVICE).t()  # [40, 33], non-contiguous
    scale = torch.tensor([0.05], device=DEVICE)
    out = poison_(torch.empty(33, 40, dtype=E4M3, device=DEVICE)).t()
    ref = torch.empty(40, 33, dtype=E4M3, device=DEVICE)
    triton_backend.quantize_fp8(out, x, scale)
    reference.quantize_fp8(ref, x, scale)
    assert torch.equal(bits(out), bits(ref))
    back = poison_(torch.empty(33, 40, dtype=BF16, device=DEVICE)).t()
    ref_back = torch.empty(40, 33, dtype=BF16, device=DEVICE)
    triton_backend.dequantize_fp8(back, ref, scale)
    reference.dequantize_fp8(ref_back, ref, scale)
    assert torch.equal(bits(back), bits(ref_back))


@pytest.mark.parametrize("dtype,block_size", [(F16, 16), (E5M2, 3), (F32, 1)])
def test_copy_blocks_all_layers(dtype, block_size):
    torch.manual_seed(7)
    num_blocks, heads, head_size = 9, 2, 24

    def layer(layout):
        cache = empty_cache(num_blocks, block_size, heads, head_size, dtype, layout)
        cache.copy_(torch.randn(cache.shape, device=DEVICE).to(dtype))
        return cache

    # Two layers NHD, one HND, and one non-dense view (every other head of a wider cache):
    # the dense ones share one launch, the last one takes the fallback.
    wide = torch.randn(num_blocks, block_size, 2 * heads, head_size, device=DEVICE).to(dtype)
    key_caches = [layer("NHD"), layer("HND"), wide[:, :, ::2]]
    value_caches = [layer("NHD"), layer("HND"), layer("NHD")]
    refs = [c.clone() for c in key_caches + value_caches]
    wide_before = wide.clone()
    mapping = torch.tensor([[0, 5], [2, 7], [0, 8]], dtype=torch.int64, device=DEVICE)
    backend().copy_blocks(key_caches, value_caches, mapping)
    reference.copy_blocks(refs[:3], refs[3:], mapping)
    for got, want in zip(key_caches + value_caches, refs):
        assert torch.equal(bits(got), bits(want))
    # the unselected heads of the strided view are untouched
    assert torch.equal(bits(wide[:, :, 1::2]), bits(wide_before[:, :, 1::2]))


@pytest.mark.parametrize("dtype,src_layout,dst_layout", [(BF16, "NHD", "HND"), (E4M3, "HND", "NHD")])
def test_swap_blocks(dtype, src_layout, dst_layout):
    torch.manual_seed(8)
    src = empty_cache(6, 3, 2, 16, dtype, src_layout)
    src.copy_(torch.randn(src.shape, device=DEVICE).to(dtype))
    dst = empty_cache(7, 3, 2, 16, dtype, dst_layout)
    ref = dst.clone()
    mapping = torch.tensor([[1, 6], [4, 0], [5, 3]], dtype=torch.int64)
    backend().swap_blocks(src, dst, mapping)
    reference.swap_blocks(src, ref, mapping)
    assert torch.equal(bits(dst), bits(ref))
    # a device->host swap: the destination on CPU
    host = poison_(torch.empty(7, 3, 2, 16, dtype=dtype))
    host_ref = host.clone()
    backend().swap_blocks(src, host, mapping)
    reference.swap_blocks(src, host_ref, mapping)
    assert torch.equal(bits(host), bits(host_ref))


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
    case = Paged(dtype=F16, cache_dtype=F16, block_size=16, num_kv_heads=2, head_size=64, seq_lens=[5, 20])
    args, ref = decode_inputs(case, 2)
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

    q = case.query(5, 4)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    pargs = (poison_(torch.empty_like(q)), q, case.key_cache, case.value_cache, case.block_tables, cu,
             case.seq_lens, 3, case.scale, True, None, None)
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
    case = Paged(dtype=F16, cache_dtype=F16, block_size=16, num_kv_heads=2, head_size=128,
                 seq_lens=[300, 1000], seed=11)
    args, ref = decode_inputs(case, 4)
    triton_backend.decode_attention(*args)
    info = triton_backend.last_config("decode_attention")
    assert info["source"] == "tuned" and info["config"] in candidates
    poison_(args[0])
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

"""The CUDA kernels (csrc/kernels) run by the CPU emulator (backend ``cuda_emu``) against the
float64 reference, plus self-tests of the emulator.

Same checks and error budget as the cpu backend's tests (tests/helpers.py: fresh random inputs,
outputs and unused cache slots poisoned with NaN), over a smaller, pairwise grid: the emulator
runs every GPU thread as a fiber, so each case costs milliseconds to a second.

The same checks run on a real GPU with backend ``cuda`` in tests/test_cuda_gpu.py.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

import paged_ops
from paged_ops import reference
from tests.helpers import FP8, assert_close, empty_cache, make_case, nan_like, poison

emu = paged_ops.backend("cuda_emu")
selftest = torch.ops.paged_cuda_emu_selftest

BLOCK_SIZES = (1, 3, 16, 256)
GROUPS = (1, 2, 4, 7, 8)
HEAD_SIZES = (64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


CONFIG_FIELDS = ("threads", "partition", "kv_tile", "force_split", "tc")  # kernels/params.h LaunchConfig


def config_list(**kw) -> list[int]:
    assert set(kw) <= set(CONFIG_FIELDS), f"unknown launch config keys {set(kw) - set(CONFIG_FIELDS)}"
    return [int(kw.get(k, 0)) for k in CONFIG_FIELDS]


class ConfiguredOps:
    """The emulator's attention kernels launched with an explicit configuration
    (torch.ops.paged_cuda_emu_test.*_config: test-only, no validation)."""

    def __init__(self, config: list[int]):
        self.config = config

    def decode_attention(self, *args):
        torch.ops.paged_cuda_emu_test.decode_attention_config(*args, self.config)

    def prefill_attention(self, *args):
        torch.ops.paged_cuda_emu_test.prefill_attention_config(*args, self.config)


@pytest.fixture
def launch_config():
    """launch_config(threads=..., partition=..., ...) -> ops that launch with that configuration."""
    return lambda **kw: ConfiguredOps(config_list(**kw))


def ragged_lens(block_size: int) -> list[int]:
    # 1 token, an exact block boundary, one past a boundary, and a ragged one
    return [1, block_size, 2 * block_size + 1, 37]


def check_decode(case, ops=emu):
    out = nan_like(case.query)
    ops.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), case.dtype)


def check_prefill(case, causal=True, ops=emu):
    out = nan_like(case.query)
    ops.prefill_attention(*case.prefill_args(out, causal))
    assert_close(out, case.reference_prefill(causal), case.dtype)


# ---- decode ------------------------------------------------------------------------------------
# Every block size x group; dtype, head size and layout rotate through them (pairwise coverage).
DECODE_GRID = [(bs, g, DTYPES[i % 3], HEAD_SIZES[i % 5], ("NHD", "HND")[i % 2])
               for i, (bs, g) in enumerate(itertools.product(BLOCK_SIZES, GROUPS))]


@pytest.mark.parametrize("block_size,group,dtype,head_size,layout", DECODE_GRID)
def test_decode(block_size, group, dtype, head_size, layout):
    lens = ragged_lens(block_size) if block_size < 256 else [1, 256, 300]
    case = make_case(lens, num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=block_size * 100 + group)
    check_decode(case)


@pytest.mark.parametrize("head_size,dtype", list(itertools.product(HEAD_SIZES, DTYPES)))
def test_decode_head_sizes(head_size, dtype):
    layout = ("NHD", "HND")[head_size % 3 == 0]
    case = make_case([5, 16, 33], num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, layout=layout, seed=head_size)
    check_decode(case)


@pytest.mark.parametrize("head_size", [8, 24, 136, 200])
def test_prefill_other_head_sizes(head_size):
    # head sizes that are not multiples of 16: the tensor-core path pads the k-steps with zeros.
    case = make_case([7, 20], q_lens=[7, 9], num_heads=6, num_kv_heads=2, head_size=head_size, block_size=8,
                     dtype=torch.bfloat16, seed=head_size)
    check_prefill(case)


@pytest.mark.parametrize("head_size", [8, 24, 136, 200])
def test_decode_other_head_sizes(head_size):
    # Any multiple of 8 up to 256 runs (runtime head size; no dispatch table to fall off).
    case = make_case([7, 20], num_heads=4, num_kv_heads=1, head_size=head_size, block_size=8, seed=head_size)
    check_decode(case)


@pytest.mark.parametrize("group,dtype,partition,threads,cache_dtype", [
    (1, torch.float32, 16, 128, None), (4, torch.float16, 32, 64, None), (7, torch.bfloat16, 48, 256, None),
    (8, torch.float32, 64, 128, None), (2, torch.float16, 5, 128, None),
    (4, torch.bfloat16, 32, 128, torch.float8_e4m3fn), (1, torch.float16, 24, 64, torch.float8_e5m2)])
def test_decode_split_kv(launch_config, group, dtype, partition, threads, cache_dtype):
    # The split-KV path with its log-sum-exp merge: partitions that are empty for short
    # sequences, partial last partitions, partition sizes that do not divide the block size.
    ops = launch_config(force_split=1, partition=partition, threads=threads)
    case = make_case([1, partition, partition + 1, 150, 3 * partition - 1], num_heads=2 * group, num_kv_heads=2,
                     head_size=(64, 128, 96, 80, 256)[group % 5], block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, scale_kind=("tensor", "head")[group % 2],
                     layout=("NHD", "HND")[group % 2], seed=group)
    check_decode(case, ops)


def test_decode_one_pass_forced(launch_config):
    ops = launch_config(partition=-1)
    case = make_case([1, 200, 333], num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.float16, seed=3)
    check_decode(case, ops)


# ---- decode, groups > 8: the shared-KV kernel --------------------------------------------------
# One block per (sequence, KV head) holds up to 64 query heads (8 warp tiles of 8) and stages each
# KV chunk (64 tokens by default, fewer for wide rows: 16 for fp32 x 256) once in shared memory;
# groups > 64 are cut into head chunks of at most 64. Lengths: 1 token, a block boundary, one past
# it, and lengths that are not multiples of the chunk (65, 130).
LARGE_GROUP_GRID = [  # group, KV heads, head size, dtype, layout, block size
    (12, 2, 128, torch.bfloat16, "NHD", 16), (16, 2, 64, torch.float32, "HND", 3),
    (16, 1, 256, torch.float16, "NHD", 1), (24, 1, 96, torch.float32, "NHD", 16),
    (32, 2, 80, torch.float16, "HND", 16), (32, 1, 128, torch.bfloat16, "NHD", 256),
    (64, 1, 128, torch.float32, "HND", 16), (64, 2, 256, torch.bfloat16, "NHD", 7),
    (72, 1, 64, torch.float32, "NHD", 16),  # 9 tiles: two blocks of 5 tiles, the last one has an idle tile
    (80, 1, 64, torch.float16, "HND", 16), (96, 1, 128, torch.bfloat16, "NHD", 5)]


def large_lens(block_size):
    return [1, 256, 300] if block_size == 256 else [1, block_size, 2 * block_size + 1, 65, 130]


@pytest.mark.parametrize("group,kv_heads,head_size,dtype,layout,block_size", LARGE_GROUP_GRID)
def test_decode_large_group(group, kv_heads, head_size, dtype, layout, block_size):
    case = make_case(large_lens(block_size), num_heads=group * kv_heads, num_kv_heads=kv_heads, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=group + head_size)
    check_decode(case)


@pytest.mark.parametrize("group,cache_dtype,scale_kind,head_size,dtype", [
    (16, torch.float8_e4m3fn, "tensor", 128, torch.bfloat16), (32, torch.float8_e5m2, "head", 64, torch.float16),
    (64, torch.float8_e4m3fn, "head", 256, torch.float32), (20, torch.float8_e5m2, "tensor", 24, torch.float16)])
def test_decode_large_group_fp8(group, cache_dtype, scale_kind, head_size, dtype):
    # head size 24: 24-byte fp8 rows, so the staging copies are 8 bytes wide and rows are padded.
    case = make_case([1, 16, 33, 100], num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, cache_dtype=cache_dtype, scale_kind=scale_kind, layout=("NHD", "HND")[group % 3 == 0],
                     seed=group)
    check_decode(case)


@pytest.mark.parametrize("group,config,cache_dtype", [
    (16, dict(force_split=1, partition=32, threads=64), None),
    (32, dict(force_split=1, partition=48, threads=256, kv_tile=7), None),  # chunks that straddle partitions
    (64, dict(force_split=1, partition=20, threads=128), torch.float8_e4m3fn),
    (80, dict(force_split=1, partition=64, kv_tile=1), None),
    (16, dict(threads=32, kv_tile=5), None),     # one warp per tile, tiny chunks
    (24, dict(threads=256, partition=-1), torch.float8_e5m2)])  # several warps per tile, one pass
def test_decode_large_group_configs(launch_config, group, config, cache_dtype):
    ops = launch_config(**config)
    case = make_case([1, 31, 32, 33, 150], num_heads=2 * group, num_kv_heads=2, head_size=(64, 128, 80)[group % 3],
                     block_size=16, dtype=(torch.float16, torch.bfloat16, torch.float32)[group % 3],
                     cache_dtype=cache_dtype, scale_kind=("tensor", "head")[group % 2], layout=("NHD", "HND")[group % 2],
                     seed=group)
    check_decode(case, ops)


def test_decode_large_group_unaligned_cache():
    # Odd element offset and head stride: the staging falls back to 2-byte copies.
    case = make_case([1, 17, 70], num_heads=32, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.bfloat16, seed=1)
    for name in ("key_cache", "value_cache"):
        c = getattr(case, name)
        wide = torch.full(c.shape[:-1] + (c.shape[-1] + 1,), float("nan"), dtype=c.dtype)[..., 1:]
        wide.copy_(c)
        setattr(case, name, wide)
    check_decode(case)


@pytest.mark.parametrize("group,config", [(1, ""), (8, ""), (12, ""), (16, ""), (32, "force_split=1,partition=40"),
                                          (64, "threads=256"), (80, ""), (130, "")])
def test_decode_reads_kv_once_per_group(group, config):
    # The emulator counts the bytes the kernels' load helpers read from the two caches. Every live
    # KV token must be read exactly once for a group of up to 64 heads (before the shared-KV kernel,
    # group 16 read it twice, group 64 eight times), and once per 64-head chunk beyond that.
    config = config_list(**{k: int(v) for k, v in (kv.split("=") for kv in config.split(",") if kv)})
    lens, kv_heads, head_size = [1, 16, 65, 131], 2, 64
    case = make_case(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                     dtype=torch.float16, seed=group)
    out = nan_like(case.query)
    read = torch.ops.paged_cuda_emu_test.decode_kv_bytes_read(*case.decode_args(out), config)
    assert_close(out, case.reference_prefill(), case.dtype)
    once = 2 * sum(lens) * kv_heads * head_size * case.key_cache.element_size()  # K and V of live tokens
    assert read == once * -(-group // 64)


def test_decode_strided_query_out():
    case = make_case([9, 30], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, seed=5)
    wide = torch.randn(case.query.shape[0], case.query.shape[1], 2 * case.query.shape[2])
    wide[..., :64] = case.query
    case.query = wide[..., :64]  # row stride 128, stride(-1) == 1
    out_wide = torch.empty(wide.shape)
    poison(out_wide)
    out = out_wide[..., 64:]
    emu.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), case.dtype)
    assert torch.isnan(out_wide[..., :64]).all(), "wrote outside out's view"


# ---- fp8 caches --------------------------------------------------------------------------------
FP8_GRID = [(cd, sk, DTYPES[i % 3], GROUPS[i % 5], ("NHD", "HND")[i % 2])
            for i, (cd, sk) in enumerate(itertools.product(FP8, ("tensor", "head")))]


@pytest.mark.parametrize("cache_dtype,scale_kind,dtype,group,layout", FP8_GRID)
def test_decode_fp8(cache_dtype, scale_kind, dtype, group, layout):
    case = make_case([1, 16, 37], num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, layout=layout, scale_kind=scale_kind, seed=group)
    check_decode(case)


@pytest.mark.parametrize("cache_dtype,scale_kind,dtype,group,layout", FP8_GRID)
def test_prefill_fp8(cache_dtype, scale_kind, dtype, group, layout):
    case = make_case([5, 20], q_lens=[5, 7], num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=3,
                     dtype=dtype, cache_dtype=cache_dtype, layout=layout, scale_kind=scale_kind, seed=group)
    check_prefill(case)


# ---- prefill -----------------------------------------------------------------------------------
PREFILL_GRID = [(bs, g, DTYPES[i % 3], HEAD_SIZES[i % 5], ("NHD", "HND")[i % 2], bool(i % 4))
                for i, (bs, g) in enumerate(itertools.product((1, 3, 16), GROUPS))]


# default: tensor cores (mma.sync, emulated) for fp16/bf16, CUDA cores for fp32; "cuda_cores"
# forces the CUDA-core kernel for the 16-bit cases as well (fp32 takes it anyway).
PREFILL_PATHS = [("default",) + c for c in PREFILL_GRID] + \
                [("cuda_cores",) + c for c in PREFILL_GRID if c[2] != torch.float32]


@pytest.mark.parametrize("path,block_size,group,dtype,head_size,layout,causal", PREFILL_PATHS)
def test_prefill(launch_config, path, block_size, group, dtype, head_size, layout, causal):
    ops = launch_config(tc=-1) if path == "cuda_cores" else emu
    # Chunked prefill: cached context before the new tokens, a q_len = 1 (decode) row, a fresh
    # prompt (q_len = seq_len), a sequence with no new tokens, exact block boundaries.
    seq_lens = [1, 2 * block_size, 21, 9, 6]
    q_lens = [1, block_size, 5, 9, 0]
    case = make_case(seq_lens, q_lens=q_lens, num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=block_size * 10 + group)
    check_prefill(case, causal, ops)


@pytest.mark.parametrize("kv_tile,threads", [(16, 64), (64, 256), (7, 128)])
def test_prefill_launch_configs(launch_config, kv_tile, threads):
    ops = launch_config(kv_tile=kv_tile, threads=threads, tc=-1)
    case = make_case([40, 13], q_lens=[33, 13], num_heads=14, num_kv_heads=2, head_size=96, block_size=16,
                     dtype=torch.float16, seed=kv_tile)
    check_prefill(case, ops=ops)
    check_prefill(case, causal=False, ops=ops)


def test_public_ops_route_to_cuda_emu():
    # Through torch.ops.paged.* with the backend forced, validation included.
    case = make_case([1, 19], num_heads=6, num_kv_heads=2, head_size=64, block_size=4, seed=12)
    with paged_ops.use_backend("cuda_emu"):
        out = nan_like(case.query)
        torch.ops.paged.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), case.dtype)


def test_prefill_all_empty():
    case = make_case([4, 6], q_lens=[0, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=4)
    out = torch.empty(0, 4, 64)
    emu.prefill_attention(*case.prefill_args(out))


# ---- reshape_and_cache / fp8 ops -----------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


RESHAPE_GRID = [(dt, cd, ("tensor", "head")[i % 2], ("NHD", "HND")[i // 2 % 2], (1, 3, 16)[i % 3])
                for i, (dt, cd) in enumerate(itertools.product(DTYPES, ("same",) + FP8))]


@pytest.mark.parametrize("dtype,cache_dtype,scale_kind,layout,block_size", RESHAPE_GRID)
def test_reshape_and_cache(dtype, cache_dtype, scale_kind, layout, block_size):
    g = torch.Generator().manual_seed(block_size)
    cache_dtype = dtype if cache_dtype == "same" else cache_dtype
    heads, hs, tokens, blocks = 3, 64, 11, 12
    key = (torch.randn(tokens, heads, hs, generator=g) * 4).to(dtype)
    value = (torch.randn(tokens, heads, hs, generator=g) * 4).to(dtype)
    key[0, 0, :4] = torch.tensor([1e9, -1e9, float("inf"), 1e-12])  # saturation and subnormals
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].long()
    slots[3] = -1  # padding token: skipped
    k_scale = v_scale = None
    if cache_dtype in FP8:
        n = 1 if scale_kind == "tensor" else heads
        k_scale = torch.rand(n, generator=g) * 0.1 + 0.01
        v_scale = torch.rand(n, generator=g) * 0.1 + 0.01
    caches = [empty_cache(blocks, block_size, heads, hs, cache_dtype, layout) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    emu.reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(bits(caches[2]), bits(caches[0]))  # bit-identical, NaN slots untouched
    assert torch.equal(bits(caches[3]), bits(caches[1]))


def test_reshape_and_cache_strided_key():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(6, 2, 4, 32, generator=g)  # fused qkv-style: key/value are strided views
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 5, 9, 2, 7, 11])
    caches = [empty_cache(3, 4, 4, 32, torch.float32) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots)
    emu.reshape_and_cache(key, value, caches[2], caches[3], slots, None, None)
    assert torch.equal(bits(caches[2]), bits(caches[0])) and torch.equal(bits(caches[3]), bits(caches[1]))


@pytest.mark.parametrize("dtype,fp8", list(itertools.product(DTYPES, FP8)))
def test_quantize_dequantize(dtype, fp8):
    g = torch.Generator().manual_seed(7)
    n = 1000 + 5  # not a multiple of 8: the scalar tail runs
    x = (torch.randn(n, generator=g) * 100).to(dtype)
    x[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1e-30]).to(dtype)
    scale = torch.tensor([0.37])
    q_ref = torch.empty(n, dtype=fp8)
    q = poison(torch.empty(n, dtype=fp8))
    reference.quantize_fp8(q_ref, x, scale)
    emu.quantize_fp8(q, x, scale)
    assert torch.equal(bits(q), bits(q_ref))
    d_ref = torch.empty(n, dtype=dtype)
    d = nan_like(d_ref)
    reference.dequantize_fp8(d_ref, q_ref, scale)
    emu.dequantize_fp8(d, q_ref, scale)
    # Exact, except that a NaN's payload bits are not part of the contract.
    nan = torch.isnan(d_ref)
    assert torch.equal(torch.isnan(d), nan)
    assert torch.equal(bits(d)[~nan], bits(d_ref)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_bit_patterns_sample(dtype):
    # A wide sample of bit patterns (every exponent, random mantissas, both NaN signs) must
    # quantize exactly like the reference: RNE ties, subnormals, saturation, NaN.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2**31, 2**31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    if dtype != torch.float32:
        x = x.view(torch.int16).view(dtype)  # 16-bit patterns, not a rounding of float32 ones
    for fp8 in FP8:
        for s in (1.0, 0.01, 3.7):
            scale = torch.tensor([s])
            q_ref = torch.empty(x.shape, dtype=fp8)
            q = poison(torch.empty(x.shape, dtype=fp8))
            reference.quantize_fp8(q_ref, x, scale)
            emu.quantize_fp8(q, x, scale)
            assert torch.equal(bits(q), bits(q_ref)), (fp8, s)


# ---- copy / swap -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_blocks(layout):
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float16, torch.float8_e4m3fn, torch.float32]  # layers may differ
    kcs, vcs = [], []
    for dt in dtypes:
        for lst in (kcs, vcs):
            c = empty_cache(8, 3, 2, 24, dt, layout)
            c.view(torch.uint8).copy_(torch.randint(0, 120, c.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
            lst.append(c)
    mapping = torch.tensor([[0, 5], [2, 6], [1, 7]])
    ref_k, ref_v = [c.clone() for c in kcs], [c.clone() for c in vcs]
    reference.copy_blocks(ref_k, ref_v, mapping)
    emu.copy_blocks(kcs, vcs, mapping)
    for a, b in zip(kcs + vcs, ref_k + ref_v):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("src_layout,dst_layout", [("NHD", "NHD"), ("HND", "HND"), ("NHD", "HND")])
def test_swap_blocks(src_layout, dst_layout):
    g = torch.Generator().manual_seed(4)
    src = empty_cache(6, 4, 2, 16, torch.bfloat16, src_layout)
    src.copy_(torch.randn(src.shape, generator=g))
    dst = empty_cache(5, 4, 2, 16, torch.bfloat16, dst_layout)
    ref = dst.clone()
    mapping = torch.tensor([[5, 0], [0, 3], [2, 2]])
    reference.swap_blocks(src, ref, mapping)
    emu.swap_blocks(src, dst, mapping)
    assert torch.equal(bits(dst), bits(ref))


# ---- the emulator itself -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [32, 64, 96, 100])
def test_emu_warp_ops(n):
    x = torch.randint(0, 50, (n,), dtype=torch.int32)
    x[n // 2] = 7
    res = selftest.warp_ops(x)
    out, counter = res[:-1].reshape(n, 9), int(res[-1])
    assert counter == int(x.sum())
    for t in range(n):
        w0, lane = (t // 32) * 32, t % 32
        lanes = list(range(w0, min(w0 + 32, n)))  # a partial last warp has fewer lanes
        val = lambda src: int(x[src]) if w0 + src - w0 in lanes else int(x[t])  # noqa: E731
        assert out[t, 0] == val(w0 + (lane ^ 1)), t
        assert out[t, 1] == val(w0 + 3), t
        assert out[t, 2] == (val(w0 + lane + 2) if lane + 2 < 32 else int(x[t])), t
        assert out[t, 3] == (int(x[t - 5]) if lane >= 5 else int(x[t])), t
        ballot = sum(1 << (s - w0) for s in lanes if int(x[s]) % 2 == 0)
        assert out[t, 4] == torch.tensor(ballot, dtype=torch.int64).to(torch.int32).item()
        assert out[t, 5] == 1
        assert out[t, 6] == int(any(int(x[s]) == 7 for s in lanes))
        assert out[t, 7] == val(w0 + (lane ^ 4)), t
        assert out[t, 8] == int(x[n - 1 - t])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emu_mma_matches_matmul(dtype):
    # The emulated mma.sync m16n8k16 with the fragment layouts of kernels/mma.cuh.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    ref = a.double() @ b.double()
    out = selftest.mma(a, b)
    for d in out:
        assert (d.double() - ref).abs().max() < 1e-4


def test_emu_atomics_across_blocks():
    count, fsum = selftest.atomics(300, 64)
    assert count == 300 * 64 and fsum == 300 * 64 * 0.5


@pytest.mark.parametrize("case,message", [
    ("barrier_exit", "__syncthreads"), ("different_barriers", "__syncthreads"), ("shuffle_exit", "shuffle"),
    ("smem_over_request", "dynamic shared memory"), ("smem_over_limit", "227 KB"),
    ("block_too_large", "invalid launch"), ("block_zero", "invalid launch"), ("grid_zero", "invalid launch"),
    ("grid_y_too_large", "invalid launch")])
def test_emu_misuse_raises(case, message):
    with pytest.raises(RuntimeError, match=message):
        selftest.misuse(case)
    selftest.misuse("ok")  # and the emulator is usable afterwards


def test_emu_sequential_matches_parallel(monkeypatch):
    case = make_case([1, 50, 17], num_heads=8, num_kv_heads=2, head_size=64, block_size=4, seed=9)
    out_par = nan_like(case.query)
    emu.decode_attention(*case.decode_args(out_par))
    monkeypatch.setenv("CUDA_EMU_SEQUENTIAL", "1")
    out_seq = nan_like(case.query)
    emu.decode_attention(*case.decode_args(out_seq))
    assert torch.equal(out_par, out_seq)

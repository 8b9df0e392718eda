"""What is specific to the CUDA kernels (csrc/kernels) run by the CPU emulator (backend
``cuda_emu``): forced launch configurations (split-KV, one pass, shared-KV chunking, CUDA-core
prefill), unaligned cache staging, the KV bytes each kernel reads, and self-tests of the emulator.
The op contract over the emulator's pairwise grid runs in tests/test_ops.py.

Same inputs and error budget as there (paged_ops.testing: fresh random inputs, outputs and unused
cache slots poisoned with NaN); the emulator runs every GPU thread as a fiber, so each case costs
milliseconds to a second. The GPU counterparts are in tests/test_cuda_gpu.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import paged_ops
from paged_ops.testing import assert_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

emu = paged_ops.backend("cuda_emu")
selftest = torch.ops.paged_cuda_emu_test

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


def check_decode(case, ops=emu):
    out = nan_like(case.query)
    ops.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), case.dtype)


def check_prefill(case, causal=True, ops=emu):
    out = nan_like(case.query)
    ops.prefill_attention(*case.prefill_args(out, causal))
    assert_close(out, case.reference_prefill(causal), case.dtype)


# ---- decode ------------------------------------------------------------------------------------
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


# ---- prefill -----------------------------------------------------------------------------------
# test_ops' pairwise prefill grid runs the default kernels: tensor cores (mma.sync, emulated) for
# fp16/bf16, CUDA cores for fp32. Here the CUDA-core kernel is forced (tc=-1) for its 16-bit cases.
PREFILL_GRID = [(bs, g, DTYPES[i % 3], HEAD_SIZES[i % 5], ("NHD", "HND")[i % 2], bool(i % 4))
                for i, (bs, g) in enumerate(itertools.product((1, 3, 16), GROUPS))]


@pytest.mark.parametrize("block_size,group,dtype,head_size,layout,causal",
                         [c for c in PREFILL_GRID if c[2] != torch.float32])
def test_prefill_cuda_cores(launch_config, block_size, group, dtype, head_size, layout, causal):
    # Chunked prefill: cached context before the new tokens, a q_len = 1 (decode) row, a fresh
    # prompt (q_len = seq_len), a sequence with no new tokens, exact block boundaries.
    seq_lens = [1, 2 * block_size, 21, 9, 6]
    q_lens = [1, block_size, 5, 9, 0]
    case = make_case(seq_lens, q_lens=q_lens, num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=block_size * 10 + group)
    check_prefill(case, causal, launch_config(tc=-1))


@pytest.mark.parametrize("kv_tile,threads", [(16, 64), (64, 256), (7, 128)])
def test_prefill_launch_configs(launch_config, kv_tile, threads):
    ops = launch_config(kv_tile=kv_tile, threads=threads, tc=-1)
    case = make_case([40, 13], q_lens=[33, 13], num_heads=14, num_kv_heads=2, head_size=96, block_size=16,
                     dtype=torch.float16, seed=kv_tile)
    check_prefill(case, ops=ops)
    check_prefill(case, causal=False, ops=ops)


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

"""What is specific to the CUDA kernels (csrc/kernels) run by the CPU emulator (backend
``cuda_emu``): forced launch configurations (split-KV, one pass, shared-KV chunking, CUDA-core
prefill), unaligned cache staging, the KV bytes each kernel reads, the decode variants of issue #13
on every decode path (a window reads only its own K/V bytes), merge_attention_states, the
batch-invariant mode (torch.equal across batch mixes and chunked prefill vs decode), and
self-tests of the emulator.
The op contract over the emulator's pairwise grid runs in tests/test_ops.py.

Same inputs and error budget as there (paged_ops.testing: fresh random inputs, outputs and unused
cache slots poisoned with NaN); the emulator runs every GPU thread as a fiber, so each case costs
milliseconds to a second. The GPU counterparts are in tests/test_cuda_gpu.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

emu = paged_ops.backend("cuda_emu")
selftest = torch.ops.paged_cuda_emu_test

GROUPS = (1, 2, 4, 7, 8)
HEAD_SIZES = (64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


CONFIG_FIELDS = ("threads", "partition_size", "kv_tile", "force_split", "tensor_cores")  # kernels/params.h LaunchConfig


def config_list(**kw) -> list[int]:
    assert set(kw) <= set(CONFIG_FIELDS), f"unknown launch config keys {set(kw) - set(CONFIG_FIELDS)}"
    return [int(kw.get(k, 0)) for k in CONFIG_FIELDS]


class ConfiguredOps:
    """The emulator's attention kernels launched with an explicit configuration
    (torch.ops.paged_cuda_emu_test.*_config: test-only, no validation)."""

    def __init__(self, config: list[int]):
        self.config = config

    def decode_attention(self, *args, **variants):
        torch.ops.paged_cuda_emu_test.decode_attention_config(*args, self.config, **variants)

    def prefill_attention(self, *args, **variants):
        torch.ops.paged_cuda_emu_test.prefill_attention_config(*args, self.config, **variants)


@pytest.fixture
def launch_config():
    """launch_config(threads=..., partition_size=..., ...) -> ops that launch with that configuration."""
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
    ops = launch_config(force_split=1, partition_size=partition, threads=threads)
    case = make_case([1, partition, partition + 1, 150, 3 * partition - 1], num_heads=2 * group, num_kv_heads=2,
                     head_size=(64, 128, 96, 80, 256)[group % 5], block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, scale_kind=("tensor", "head")[group % 2],
                     layout=("NHD", "HND")[group % 2], seed=group)
    check_decode(case, ops)


def test_decode_one_pass_forced(launch_config):
    ops = launch_config(partition_size=-1)
    case = make_case([1, 200, 333], num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.float16, seed=3)
    check_decode(case, ops)


# ---- decode, groups > 8: the shared-KV kernel --------------------------------------------------
@pytest.mark.parametrize("group,config,cache_dtype", [
    (16, dict(force_split=1, partition_size=32, threads=64), None),
    (32, dict(force_split=1, partition_size=48, threads=256, kv_tile=7), None),  # chunks that straddle partitions
    (64, dict(force_split=1, partition_size=20, threads=128), torch.float8_e4m3fn),
    (80, dict(force_split=1, partition_size=64, kv_tile=1), None),
    (16, dict(threads=32, kv_tile=5), None),     # one warp per tile, tiny chunks
    (24, dict(threads=256, partition_size=-1), torch.float8_e5m2)])  # several warps per tile, one pass
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


@pytest.mark.parametrize("group,config", [(1, ""), (8, ""), (12, ""), (16, ""), (32, "force_split=1,partition_size=40"),
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


# ---- decode: the attention variants (paged_ops/reference.py attention) ---------------------------
def variant_args(num_heads, *, softcap=0.0, window_left=-1, sinks=False, alibi=False, seed=0):
    """Keyword arguments of one variant combination; sinks and slopes drawn fresh."""
    g = torch.Generator().manual_seed(1000 + seed)
    kw = dict(softcap=softcap, window_left=window_left)
    if sinks:
        kw["sinks"] = torch.randn(num_heads, generator=g) * 2
    if alibi:
        kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.25
    return kw


def decode_reference(case, **variants):
    """The float64 reference's out [num_seqs, num_heads, head_size] and lse [num_seqs, num_heads]."""
    ref = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    args = case._on_cpu_in_float64(case.decode_args(ref))
    reference.decode_attention(*args, **variants, lse=lse)
    return ref, lse


def check_decode_variants(case, ops, **variants):
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"))
    ops.decode_attention(*case.decode_args(out), **variants, lse=lse)
    ref, ref_lse = decode_reference(case, **variants)
    assert_close(out, ref, case.dtype)
    assert_close(lse, ref_lse, torch.float32)  # float32 math on the same (rounded) inputs


VARIANTS = {
    "softcap": dict(softcap=1.5),
    "window": dict(window_left=37),
    "window0": dict(window_left=0),  # the query sees only itself
    "sinks": dict(sinks=True),
    "alibi": dict(alibi=True),
    "all": dict(softcap=3.0, window_left=50, sinks=True, alibi=True),
}
DECODE_PATHS = {
    "one_pass": (2, dict(partition_size=-1)),
    "split": (4, dict(force_split=1, partition_size=32)),
    "split_odd": (2, dict(force_split=1, partition_size=24, threads=64)),
    "shared_kv": (16, dict(force_split=1, partition_size=48, kv_tile=16)),
    "shared_kv_one_pass": (24, dict(partition_size=-1, threads=256)),
}


@pytest.mark.parametrize("path", list(DECODE_PATHS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_variants(launch_config, path, variant):
    # Every variant on every decode kernel (one pass, split-KV + reduce, the shared-KV kernel):
    # windows that start mid-block and mid-partition, shorter than the sequence or not.
    group, config = DECODE_PATHS[path]
    i = list(VARIANTS).index(variant) + list(DECODE_PATHS).index(path)
    case = make_case([1, 30, 51, 130], num_heads=2 * group, num_kv_heads=2, head_size=(64, 128, 80)[i % 3],
                     block_size=(16, 5, 8)[i % 3], dtype=(torch.float16, torch.bfloat16, torch.float32)[i % 3],
                     layout=("NHD", "HND")[i % 2], seed=i)
    check_decode_variants(case, launch_config(**config), **variant_args(2 * group, seed=i, **VARIANTS[variant]))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_variants_fp8(cache_dtype):
    case = make_case([3, 70, 200], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16,
                     cache_dtype=cache_dtype, scale_kind="head", seed=5)
    check_decode_variants(case, emu, **variant_args(8, softcap=2.0, window_left=90, sinks=True, alibi=True))


def test_decode_default_variants_unchanged():
    # The defaults spelled out are the plain call, bit for bit, and lse alone changes no output bit.
    case = make_case([1, 40, 300], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, seed=2)
    plain, spelled, with_lse = nan_like(case.query), nan_like(case.query), nan_like(case.query)
    emu.decode_attention(*case.decode_args(plain))
    emu.decode_attention(*case.decode_args(spelled), softcap=0.0, window_left=-1, sinks=None, alibi_slopes=None)
    emu.decode_attention(*case.decode_args(with_lse), lse=torch.empty(3, 8))
    assert torch.equal(plain, spelled) and torch.equal(plain, with_lse)


@pytest.mark.parametrize("group,config", [(2, ""), (2, "force_split=1,partition_size=64"), (16, ""),
                                          (16, "force_split=1,partition_size=40")])
def test_decode_window_reads_only_the_window(group, config):
    # A sliding window skips the blocks before it: the kernels read exactly the K and V rows of the
    # window, so a decode with window W costs O(W) whatever the context length.
    config = config_list(**{k: int(v) for k, v in (kv.split("=") for kv in config.split(",") if kv)})
    window_left, kv_heads, head_size = 40, 2, 64
    reads = []
    for lens in ([1, 16, 41, 300], [1, 16, 41, 1200]):
        case = make_case(lens, num_heads=group * kv_heads, num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                         dtype=torch.float16, seed=len(reads))
        out = nan_like(case.query)
        read = selftest.decode_kv_bytes_read(*case.decode_args(out), config, window_left=window_left)
        assert_close(out, decode_reference(case, window_left=window_left)[0], case.dtype)
        visible = sum(min(n, window_left + 1) for n in lens)
        assert read == 2 * visible * kv_heads * head_size * case.key_cache.element_size()
        reads.append(read)
    assert reads[0] == reads[1]


def test_decode_cascade_merge():
    # The cascade identity on the emulator's kernels alone: decode over a sequence equals the merge
    # of decode over its first part (a shared prefix) and over the rest, through their lses.
    bs, prefix = 16, 64
    case = make_case([200, 100], num_heads=8, num_kv_heads=2, head_size=64, block_size=bs, dtype=torch.float32, seed=4)
    full = nan_like(case.query)
    emu.decode_attention(*case.decode_args(full))
    parts = []
    for table, lens in ((case.block_tables[:, :prefix // bs], [prefix] * 2),
                        (case.block_tables[:, prefix // bs:].contiguous(), [200 - prefix, 100 - prefix])):
        out, lse = nan_like(case.query), torch.full((2, 8), float("nan"))
        emu.decode_attention(out, case.query, case.key_cache, case.value_cache, table.contiguous(),
                             torch.tensor(lens, dtype=torch.int32), case.scale, lse=lse)
        parts += [out, lse]
    merged, merged_lse = nan_like(case.query), torch.full((2, 8), float("nan"))
    emu.merge_attention_states(merged, merged_lse, *parts)
    assert_close(merged, full.double(), torch.float32)
    ref_lse = decode_reference(case)[1]
    assert_close(merged_lse, ref_lse, torch.float32)


# ---- merge_attention_states ------------------------------------------------------------------------
def merge_inputs(num_tokens, num_heads, head_size, dtype, seed, special=True):
    g = torch.Generator().manual_seed(seed)
    rows = lambda: torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)  # noqa: E731
    a = torch.randn(num_tokens, num_heads, generator=g) * 5
    b = torch.randn(num_tokens, num_heads, generator=g) * 5
    po, so = rows(), rows()
    if special and num_tokens >= 3:
        a[0, 0] = -math.inf                  # the prefix contributes nothing, not even its NaN out
        po[0, 0] = math.nan
        b[1, 0] = -math.inf                  # the suffix contributes nothing
        so[1, 0] = math.nan
        a[2, 0] = b[2, 0] = -math.inf        # neither: out 0, lse -inf (#27)
        a[0, -1], b[0, -1] = 80.0, -80.0     # far apart: no overflow
    return po, a, so, b


def check_merge(out, out_lse, po, a, so, b):
    emu.merge_attention_states(out, out_lse, po, a, so, b)
    ref = torch.empty(out.shape, dtype=torch.float64)
    ref_lse = torch.empty(a.shape, dtype=torch.float64)
    reference.merge_attention_states(ref, ref_lse, po, a, so, b)
    nan_rows = ref.isnan()
    assert torch.equal(out.isnan(), nan_rows)
    if out.numel():
        assert_close(out[~nan_rows], ref[~nan_rows], out.dtype)
    if out_lse is not None:
        assert torch.equal(out_lse.isinf(), ref_lse.isinf())
        finite = ref_lse.isfinite()
        assert_close(out_lse[finite], ref_lse[finite], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [8, 64, 80, 256])
def test_merge_attention_states(dtype, head_size):
    po, a, so, b = merge_inputs(7, 3, head_size, dtype, seed=head_size)
    check_merge(torch.full_like(po, float("nan")), torch.full_like(a, float("nan")), po, a, so, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_strided_and_unaligned(dtype):
    # Rows that are not 8-element aligned (odd offsets, odd strides) take element loads; a head size
    # that is not a multiple of 8 ends in a partial chunk; out_lse may be omitted.
    po, a, so, b = merge_inputs(5, 4, 24, dtype, seed=1)
    wide = lambda t: torch.full((5, 4, 31), float("nan"), dtype=dtype)[..., 3:27].copy_(t)  # noqa: E731
    po, so = wide(po), wide(so)
    out = torch.full((6, 4, 29), float("nan"), dtype=dtype)[1:, :, 1:25]
    check_merge(out, None, po, a, so, b)
    po, a, so, b = merge_inputs(4, 2, 13, dtype, seed=2)
    check_merge(torch.full_like(po, float("nan")), torch.full_like(a, float("nan")), po, a, so, b)


def test_merge_lse_only():
    # head_size 0: nothing to merge but the lses, which are still written.
    po, a, so, b = merge_inputs(3, 2, 0, torch.float32, seed=3)
    out_lse = torch.full_like(a, float("nan"))
    check_merge(torch.empty(3, 2, 0), out_lse, po, a, so, b)


# ---- the batch-invariant mode --------------------------------------------------------------------
# kernels/plan.h kBatchInvariantPartition: contexts past it split into fixed-size partitions.
BI_PARTITION = 256


def bi_decode(case, ops=emu, **variants):
    out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"))
    ops.decode_attention(*case.decode_args(out), **variants, lse=lse, batch_invariant=True)
    return out, lse


def subcase(case, rows):
    """The same sequences (same cache, same block-table rows) as a decode batch of `rows`, in that order."""
    idx = torch.tensor(rows)
    return dataclasses.replace(case, query=case.query[idx].contiguous(), block_tables=case.block_tables[idx].contiguous(),
                               seq_lens=case.seq_lens[idx].contiguous(),
                               cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32))


@pytest.mark.parametrize("group", [2, 16])
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_batch_invariant_decode_across_batches(launch_config, group, variant):
    # Sequence 2 (3 partitions of 256) alone, among short ones, among longer ones, at another index,
    # and under launch configurations that would change the split outside the mode: same bits.
    case = make_case([5, 1000, 600, 40, 257, 1], num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.bfloat16, seed=group)
    kw = variant_args(2 * group, **(VARIANTS["all"] if variant == "all" else {}))
    want_out, want_lse = bi_decode(subcase(case, [2]), **kw)
    assert_close(want_out, decode_reference(subcase(case, [2]), **kw)[0], case.dtype)
    for rows, ops in (([0, 1, 2, 3, 4, 5], emu), ([2, 4], emu), ([3, 2], launch_config(force_split=1, partition_size=16)),
                      ([5, 0, 2], launch_config(partition_size=-1, threads=256)), ([1, 2], launch_config(threads=64))):
        out, lse = bi_decode(subcase(case, rows), ops, **kw)
        i = rows.index(2)
        assert torch.equal(out[i], want_out[0]) and torch.equal(lse[i], want_lse[0]), rows


@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("variant", ["plain", "softcap", "window", "all"])
def test_batch_invariant_prefill_rows_equal_decode(group, variant):
    # Chunked prefill in the mode: each query row of a prefill chunk (any q_len, any position in a
    # batch of other sequences) is bitwise the decode of its sequence cut at the row's position.
    kw = variant_args(2 * group, seed=7, **(VARIANTS[variant] if variant != "plain" else {}))
    # sequences with no rows first, in the middle and last: each row must find its own sequence
    seq_lens, q_lens = [7, 300, 12, 9, 560, 20], [0, 5, 0, 9, 3, 0]
    case = make_case(seq_lens, q_lens=q_lens, num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=group)
    out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"))
    emu.prefill_attention(*case.prefill_args(out), **kw, lse=lse, batch_invariant=True)
    ref = case.reference_prefill() if variant == "plain" else None
    if ref is not None:
        assert_close(out, ref, case.dtype)
    # Every row as a decode: one sequence per row, seq_len = position + 1, same block-table row.
    rows = [(s, n - q + i) for s, (n, q) in enumerate(zip(seq_lens, q_lens)) for i in range(q)]
    seq = torch.tensor([s for s, _ in rows])
    dec = dataclasses.replace(case, block_tables=case.block_tables[seq].contiguous(),
                              seq_lens=torch.tensor([p + 1 for _, p in rows], dtype=torch.int32),
                              cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32))
    dec_out, dec_lse = bi_decode(dec, **kw)
    assert torch.equal(out, dec_out) and torch.equal(lse, dec_lse)
    assert_close(dec_out, decode_reference(dec, **kw)[0], case.dtype)


def test_batch_invariant_prefill_non_causal():
    # Non-causal rows in the mode (every row sees the whole sequence, the window from its position).
    case = make_case([300, 30], q_lens=[4, 30], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float32, seed=3)
    for kw in (dict(), dict(window_left=20, sinks=torch.randn(4), softcap=2.0)):
        out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"))
        emu.prefill_attention(*case.prefill_args(out, causal=False), **kw, lse=lse, batch_invariant=True)
        ref, ref_lse = torch.empty(case.query.shape, dtype=torch.float64), torch.empty(case.query.shape[:2],
                                                                                        dtype=torch.float64)
        args = case._on_cpu_in_float64(case.prefill_args(ref, causal=False))
        reference.prefill_attention(*args, **kw, lse=ref_lse)
        assert_close(out, ref, case.dtype)
        assert_close(lse, ref_lse, torch.float32)


# ---- prefill -----------------------------------------------------------------------------------
# test_ops' pairwise prefill grid runs the default kernels: tensor cores (mma.sync, emulated) for
# fp16/bf16, CUDA cores for fp32. Here the CUDA-core kernel is forced (tensor_cores=-1) for its 16-bit cases.
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
    check_prefill(case, causal, launch_config(tensor_cores=-1))


@pytest.mark.parametrize("kv_tile,threads", [(16, 64), (64, 256), (7, 128)])
def test_prefill_launch_configs(launch_config, kv_tile, threads):
    ops = launch_config(kv_tile=kv_tile, threads=threads, tensor_cores=-1)
    case = make_case([40, 13], q_lens=[33, 13], num_heads=14, num_kv_heads=2, head_size=96, block_size=16,
                     dtype=torch.float16, seed=kv_tile)
    check_prefill(case, ops=ops)
    check_prefill(case, causal=False, ops=ops)


# ---- launch configuration: an explicit argument, not an environment variable (issue #10 item 5) ----

def test_explicit_launch_config_reaches_the_kernels():
    # A configuration the decode plan must reject proves the test op's config is what the plan sees.
    case = make_case([20, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=2)
    test_ops = torch.ops.paged_cuda_emu_test
    with pytest.raises((RuntimeError, ValueError), match="threads"):
        test_ops.decode_attention_config(*case.decode_args(nan_like(case.query)), [48])
    with pytest.raises((RuntimeError, ValueError), match="threads"):
        test_ops.prefill_attention_config(*case.prefill_args(nan_like(case.query)), [40, 0, 0, 0, -1])
    # Forced split-KV with small partitions, and the one-pass kernel: both exact.
    for config in ([0, 8, 0, 1, 0], [0, -1, 0, 0, 0]):
        out = nan_like(case.query)
        test_ops.decode_attention_config(*case.decode_args(out), config)
        assert_close(out, case.reference_prefill(), case.dtype)


def test_environment_is_not_a_launch_api(monkeypatch):
    # PAGED_CUDA_CONFIG used to be parsed at every call (an unknown key raised); it is ignored now.
    monkeypatch.setenv("PAGED_CUDA_CONFIG", "threads=48,bogus=1")
    case = make_case([20, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=2)
    out = nan_like(case.query)
    emu.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), case.dtype)


# ---- the emulator itself -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [32, 96, 100])
def test_emu_block_votes(n):
    # __syncthreads_or / _count / _and (the tensor-core prefill's edge tiles vote with _or): every
    # thread gets the block's answer, and one barrier's count does not leak into the next.
    with_7 = torch.randint(0, 50, (n,), dtype=torch.int32)
    with_7[n // 3] = 7
    for x in (with_7, torch.full((n,), 8, dtype=torch.int32)):
        votes = selftest.block_votes(x)
        want = [int((x == 7).any()), int((x % 2 == 0).sum()), int((x >= 0).all()), 0]
        assert votes.tolist() == [want] * n
    x[n - 1] = -1
    assert selftest.block_votes(x)[:, [2, 3]].tolist() == [[0, 1]] * n


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


def test_attention_rules_header():
    # csrc/attention_rules.h (visible_keys, end_row in both bases) against the reference's
    # definitions, checked in C++: raises naming the first broken rule.
    selftest.attention_rules()


def test_emu_approx_math_is_the_documented_instruction_not_exact_math():
    """ex2.approx.ftz.f32 (PTX ISA: ex2(-inf) = +0, NaN stays NaN, subnormals flushed) and
    __fdividef (CUDA programming guide: 0 for 2^126 < |y| < 2^128, else within 2 ulp), modelled
    stricter than the hardware: never the exact value, so a kernel that relies on exact powers of
    two or exact quotients fails its tests; tanh_fast (kernels/common.cuh) over them within its
    stated absolute error."""
    inf, nan, tiny = float("inf"), float("nan"), 1e-40  # tiny: a float32 subnormal
    x = torch.tensor([-inf, inf, nan, tiny, 3.0, -1.5, 0.25, -200.0], dtype=torch.float32)
    ex2, _, _ = selftest.approx_math(x, torch.ones_like(x))
    assert ex2[0].item() == 0.0 and ex2[1].item() == inf and ex2[2].isnan()
    assert ex2[-1].item() == 0.0, "a subnormal result is flushed to zero"
    exact = torch.exp2(x[3:7].double())  # x = tiny reads as 0: 2^0
    assert (ex2[3:7].double() != exact).all(), "ex2 of an exact power of two must not be exact"
    assert ((ex2[3:7].double() - exact).abs() / exact).max() < 3e-7

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4096, generator=g) * 100, torch.randn(4096, generator=g) * 10
    _, quot, _ = selftest.approx_math(a, b)
    want = a.double() / b.double()
    assert ((quot.double() - want).abs() / want.abs()).max() < 3e-7
    assert (quot.double() != want).float().mean() > 0.99, "the quotient is never rounded exactly"
    big = torch.tensor([2.0 ** 127, -(2.0 ** 127), 2.0 ** 127], dtype=torch.float32)
    _, quot, _ = selftest.approx_math(torch.tensor([1.0, 3.0, inf]), big)
    assert quot[0].item() == 0.0 and quot[1].item() == 0.0 and quot[2].isnan()

    xs = torch.cat([torch.linspace(-20, 20, 4001), torch.tensor([-inf, inf, nan, 0.0, 1e-30])])
    _, _, th = selftest.approx_math(xs, torch.ones_like(xs))
    err = (th[:-3].double() - torch.tanh(xs[:-3].double())).abs()
    assert err.max() < 1e-6, f"tanh_fast off by {err.max().item():.2e}"
    assert abs(th[-5].item() + 1) < 1e-6 and th[-4].item() == 1.0 and th[-3].isnan()  # -1 within __fdividef's 2 ulp
    small = torch.logspace(-38, -1.3, 400)  # |x| < 1/16 (the series) and past it: relative error
    small = torch.cat([small, -small])
    _, _, th = selftest.approx_math(small, torch.ones_like(small))
    rel = (th.double() - torch.tanh(small.double())).abs() / torch.tanh(small.double()).abs()
    assert rel.max() < 1e-5, f"tanh_fast off by {rel.max().item():.2e} relatively near 0"


def test_emu_prmt_and_f16x2_multiply_are_the_ptx_instructions():
    """prmt.b32's generic form and mul.rn.f16x2 as the PTX ISA defines them: bytes of {b, a} chosen by
    the selector's nibbles (only c's low 16 bits), a nibble's msb replicating that byte's sign; the
    half products rounded to nearest even with subnormals kept (no .ftz), a NaN operand a NaN."""
    a, b = 0x807F01FF, 0x44332211  # a's bytes (low first): ff 01 7f 80
    prmt = lambda c: selftest.bit_ops(a, b, c)[0]  # noqa: E731
    assert prmt(0x3210) == a and prmt(0x7654) == b and prmt(0x12343210) == a
    assert prmt(0x4567) == 0x11223344 and prmt(0x0404) == 0xFF11FF11
    assert prmt(0x8888) == 0xFFFFFFFF and prmt(0xBBBB) == 0xFFFFFFFF  # signs of ff and 80
    assert prmt(0x9999) == 0 and prmt(0xAAAA) == 0 and prmt(0xCCCC) == 0  # signs of 01, 7f, 11
    mul = lambda x, y: selftest.bit_ops(x, y, 0)[1]  # noqa: E731
    assert mul(0x40003C00, 0x3C004000) == 0x40004000  # 2 x 1, 1 x 2
    assert mul(0x80010001, 0x5C005C00) == 0x81000100  # 2^-24 x 2^8 = 2^-16, a subnormal kept, signs kept
    assert mul(0x3C01, 0x3C01) & 0xFFFF == 0x3C02  # (1 + 2^-10)^2 = 1 + 2^-9 + 2^-20: to nearest
    assert mul(0xFE003C00, 0x3C003C00) == 0x7FFF3C00  # a NaN operand: NaN (canonical here)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pair_conversion_without_hardware_cvt_is_exact(fmt):
    """kernels/common.cuh fp8x2_to_half2_bits, the sm_80 / 86 decode's conversion (GPUs before sm_89
    have no cvt.f16x2.e4m3x2), on all 65536 byte pairs: every finite and infinite value bit for bit
    torch's own fp8 -> fp16 cast, every NaN the canonical 0x7fff that cuda_fp8.h's conversion gives,
    and the same bits as that library conversion everywhere."""
    ours, lib = selftest.fp8_pairs(fmt == torch.float8_e4m3fn)
    pairs = torch.arange(65536, dtype=torch.int32)
    as_half = torch.stack([pairs & 0xFF, pairs >> 8], dim=1).to(torch.uint8).view(fmt).to(torch.float16)
    want = as_half.view(torch.int16).to(torch.int32) & 0xFFFF  # [65536, 2]: low element first
    got = torch.stack([ours & 0xFFFF, (ours >> 16) & 0xFFFF], dim=1)
    nan = as_half.isnan()
    assert torch.equal(got[~nan], want[~nan]), f"first mismatch at pair {int((got != want).any(1).nonzero()[0])}"
    assert (got[nan] == 0x7FFF).all(), "a NaN byte must give the canonical fp16 NaN"
    assert torch.equal(ours, lib)


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

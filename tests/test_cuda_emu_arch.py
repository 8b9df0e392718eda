"""The decode kernel's sm_80 / 86 / 89 code under the emulator (issue #23's open point: code only
Ampere and Ada GPUs run, which the emulator's default sm_90 build never executed). nvcc compiles
decode_kernel's group-4 kernels there one token row a step (decode_kernel_rows_per_step: more rows
spill at the 128-register cap); csrc/cuda_emu/kernels_decode_sm80.cpp builds the same choice for the
emulator, selected by paged_cuda_emu_test.set_emulated_arch(80). Every case runs on both builds
against the float64 reference (fresh random inputs, NaN outputs and unused cache slots)."""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops.testing import assert_close, assert_lse_close, make_case, make_variants, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

selftest = torch.ops.paged_cuda_emu_test
F32, F16, BF16, E4M3, E5M2 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(params=[80, 90])
def arch(request):
    previous = selftest.set_emulated_arch(request.param)
    yield request.param
    selftest.set_emulated_arch(previous)


def test_the_two_builds_take_the_choices_nvcc_takes():
    previous = selftest.set_emulated_arch(80)
    try:
        ampere = [selftest.decode_rows_per_step(b) for b in (4, 2, 1)]
        selftest.set_emulated_arch(90)
        hopper = [selftest.decode_rows_per_step(b) for b in (4, 2, 1)]
    finally:
        selftest.set_emulated_arch(previous)
    assert ampere == [1, 1, 1], "sm_80's group-4 kernels take one row a step (decode.cuh)"
    assert hopper == [2, 4, 4]
    with pytest.raises(ValueError, match="set_emulated_arch"):
        selftest.set_emulated_arch(75)


# (seq_lens, num_heads, num_kv_heads, head_size, dtype, cache_dtype, scale_kind): groups of 4 and 8
# (the 4-head-per-thread kernels whose step differs) beside group 2, every cache element size,
# contexts from one key to split-KV lengths.
CASES = [
    ([1, 17, 40, 0, 333], 8, 2, 64, F16, None, "tensor"),
    ([1500], 8, 1, 128, BF16, None, "tensor"),
    ([90, 7, 260], 16, 2, 80, F32, None, "tensor"),
    ([64, 129], 8, 2, 128, BF16, E4M3, "head"),
    ([300, 5], 4, 1, 96, F16, E5M2, "seq"),
    ([50, 700], 4, 2, 64, BF16, None, "tensor"),
]


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_size,dtype,cache_dtype,scale_kind", CASES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference(arch, seq_lens, num_heads, num_kv_heads, head_size, dtype, cache_dtype,
                                  scale_kind, block_size):
    case = make_case(seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     block_size=block_size, dtype=dtype, cache_dtype=cache_dtype, scale_kind=scale_kind,
                     seed=len(seq_lens) + block_size)
    out = nan_like(case.query)
    paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_decode(), dtype, f"sm_{arch}")


@pytest.mark.parametrize("variant", ["softcap", "window", "sinks", "alibi"])
def test_decode_variants_and_lse_match_reference(arch, variant):
    case = make_case([3, 200, 1100], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16, seed=11)
    variants = make_variants(8, **{"softcap": dict(softcap=8.0), "window": dict(window_left=70),
                                   "sinks": dict(sinks=True), "alibi": dict(alibi=True)}[variant])
    case.poison_hidden(**variants)
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"))
    paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out), lse=lse, **variants)
    want, want_lse = case.reference_decode_lse(**variants)
    assert_close(out, want, BF16, f"sm_{arch} {variant}")
    assert_lse_close(lse, want_lse, BF16, f"sm_{arch} {variant}")


def test_batch_invariant_row_is_the_same_bits_alone_and_in_a_batch(arch):
    """Batch-invariant mode on each build: a row decoded in a batch and alone gives the same bits."""
    case = make_case([600, 3, 77], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16, seed=12)
    out = nan_like(case.query)
    paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out), batch_invariant=True)
    assert_close(out, case.reference_decode(), BF16, f"sm_{arch}")
    _, query, key_cache, value_cache, block_tables, seq_lens, *rest = case.decode_args(out)
    alone = nan_like(query[:1])
    paged_ops.backend("cuda_emu").decode_attention(alone, query[:1], key_cache, value_cache, block_tables[:1],
                                                   seq_lens[:1], *rest, batch_invariant=True)
    assert torch.equal(alone[0].view(torch.int16), out[0].view(torch.int16))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("cache_dtype", [None, E4M3, E5M2])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 2, 2), (128, 8, 4), (256, 8, 2), (128, 16, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_fast_loop_with_score_mods(arch, dtype, cache_dtype, head_size, num_heads, num_kv_heads, split):
    """decode_kernel<T, KV, TPT, G, true, true> (plan.h score_mods): the soft-cap and ALiBi compiled into
    the fast loop, at every head tile G (groups 1, 2, 4, 8) and lanes per token TPT (heads 64, 128,
    256), over a cache of the query's dtype or fp8 (per-head scales, K's moved onto q), one pass and
    split, with a sink and the lse, against the float64 reference."""
    from tests.test_cuda_decode_plan import config_list, plan  # noqa: PLC0415

    case = make_case([1, 37, 300], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     block_size=16, dtype=dtype, cache_dtype=cache_dtype, scale_kind="head",
                     seed=head_size + num_heads + split)
    variants = make_variants(num_heads, softcap=20.0, alibi=True, sinks=True)
    config = dict(force_split=1, partition_size=64) if split else dict(partition_size=-1)
    pl = plan(case, softcap=variants["softcap"], alibi_slopes=variants["alibi_slopes"], **config)
    assert pl["fast_path"] and pl["score_mods"] and pl["split"] == split
    case.poison_hidden(**variants)
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"))
    selftest.decode_attention_config(*case.decode_args(out), config_list(**config), lse=lse, **variants)
    want, want_lse = case.reference_decode_lse(**variants)
    assert_close(out, want, dtype, f"sm_{arch}")
    assert_lse_close(lse, want_lse, dtype, f"sm_{arch}")

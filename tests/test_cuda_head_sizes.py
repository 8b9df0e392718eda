"""The CUDA decode kernel at keys and values of different head sizes and heads up to 576 (#24 item 1,
MLA) under the emulator, where tests/test_attention_head_sizes.py (the contract, every backend)
cannot reach: the wide kernel's plan (decode_wide_kernel, csrc/kernels/plan.h decode_wide_chunks),
the absorbed latent read from memory once per block (V from the staged K rows), forced split-KV
and 1-SM / 132-SM plans, the ring's odd views and block sizes, and sm_80's build. Same standards
as tests/test_cuda_decode_plan.py: NaN outputs and unused slots, the float64 reference.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import paged_ops
from paged_ops.testing import assert_close, assert_lse_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

from tests.test_cuda_decode_plan import config_list, ctas, plan  # noqa: E402

selftest = torch.ops.paged_cuda_emu_test
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def num_sms():
    previous = []
    yield lambda n: previous.append(selftest.set_num_sms(n))
    if previous:
        selftest.set_num_sms(previous[0])


def latent(seq_lens, num_heads=16, block_size=16, dtype=BF16, cache_dtype=None, seed=0, **kw):
    """Absorbed MLA: one KV head of 576 (512 latent + 64 RoPE), value_cache = key_cache[..., :512]."""
    return make_case(list(seq_lens), num_heads=num_heads, num_kv_heads=1, head_size=576, value_head_size=512,
                     value_in_key=True, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype, seed=seed, **kw)


def run(case, config=None, **kw):
    out = case.new_out()
    if config is None:
        paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out), **kw)
    else:
        selftest.decode_attention_config(*case.decode_args(out), config_list(**config), **kw)
    return out


def check(case, config=None):
    out = run(case, config)
    assert out.shape[-1] == case.value_cache.shape[-1]
    assert_close(out, case.reference_decode(), case.dtype)


def test_the_latent_plan():
    # 16 heads on one latent: one head per token group (G = 1), 8 token groups of 32 lanes, so two
    # blocks of 8 heads per row; stages of 14 latent rows (16 KB of 1152-byte rows, V not staged
    # apart), just under 48 KB in all.
    case = latent([40, 77], seed=2)
    pl = plan(case, partition_size=-1)
    assert (pl["heads_per_thread"], pl["threads"], pl["grid_x"], pl["tile_tokens"]) == (1, 256, 4, 14), pl
    assert pl["smem"] == 3 * 14 * 16 + 3 * 14 * 1152, pl
    # A tuned tile of 28 rows: 96 KB, past the 48 KB a launch gets without the opt-in attribute
    # (the emulator refuses such a launch without it, as a GPU does).
    assert plan(case, kv_tile=28)["smem"] == 3 * 28 * 16 + 3 * 28 * 1152
    check(case, dict(kv_tile=28))
    # Separate K and V caches of 576 and 512: both staged, so half the rows per stage.
    sep = make_case([40], num_heads=4, num_kv_heads=4, head_size=576, value_head_size=512, dtype=BF16)
    assert plan(sep, partition_size=-1)["tile_tokens"] == 7


def test_the_latent_is_read_once_per_block():
    # Each block reads each of its row's latent rows once (K and V from the same staged row);
    # two blocks a row (16 heads, 8 a block), one pass.
    case = latent([1, 17, 70], seed=1)
    out = case.new_out()
    read = selftest.decode_kv_bytes_read(*case.decode_args(out), config_list(partition_size=-1))
    assert read == (1 + 17 + 70) * 576 * 2 * 2
    assert_close(out, case.reference_decode(), case.dtype)


@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("dtype,cache_dtype,num_heads", [(BF16, None, 16), (F16, E4M3, 128), (F32, None, 16)])
def test_one_and_132_sm_plans(num_sms, sms, dtype, cache_dtype, num_heads):
    num_sms(sms)
    case = latent([1, 37, 300], num_heads=num_heads, dtype=dtype, cache_dtype=cache_dtype, scale_kind="head",
                  seed=sms + num_heads)
    pl = plan(case)
    assert pl["split"] == (sms == 132), pl  # 6 or 48 blocks: enough for 1 SM (2 resident), not for 132
    check(case)


@pytest.mark.parametrize("dk,dv,group,kv_heads,block_size,dtype,cache_dtype", [
    (576, 512, 16, 1, 16, BF16, None),   # the latent, split in partitions across pages
    (192, 128, 1, 4, 16, BF16, None),    # DeepSeek's non-absorbed heads through the narrow kernel
    (576, 576, 1, 2, 5, F32, None),      # V as wide as K, separate caches, odd block size
    (320, 8, 4, 1, 3, F16, E5M2),        # a wide key and the narrowest value
    (136, 72, 3, 2, 1, F16, E4M3),       # narrow, Dk != Dv, fp8 rows of 72 bytes (8-byte copies)
])
def test_forced_split(dk, dv, group, kv_heads, block_size, dtype, cache_dtype):
    case = make_case([1, 23, 90], num_heads=group * kv_heads, num_kv_heads=kv_heads, head_size=dk,
                     value_head_size=dv, value_in_key=dk == 576 and dv == 512, block_size=block_size, dtype=dtype,
                     cache_dtype=cache_dtype, scale_kind="seq" if cache_dtype else "tensor", seed=dk + dv)
    check(case, dict(force_split=1, partition_size=24))
    check(case, dict(partition_size=-1, kv_tile=5, threads=64))  # tiles straddling pages, 2 token groups


def test_latent_variants_split_and_one_pass(num_sms):
    num_sms(132)
    case = latent([3, 64, 200], num_heads=16, dtype=F16, seed=9)
    g = torch.Generator().manual_seed(3)
    kw = dict(softcap=20.0, window_left=100, sinks=torch.randn(16, generator=g) * 2,
              alibi_slopes=torch.rand(16, generator=g) * 0.1)
    case.poison_hidden(True, **kw)
    want, want_lse = case.reference_decode_lse(**kw)
    for config in (None, dict(partition_size=-1), dict(force_split=1, partition_size=32)):
        lse = torch.full(case.query.shape[:2], float("nan"))
        out = run(case, config, lse=lse, **kw)
        assert_close(out, want, case.dtype)
        assert_lse_close(lse, want_lse, case.dtype)


def test_odd_latent_view():
    # The latent at an odd element offset: 2-byte copies instead of 16, and V still read from K's rows.
    case = latent([5, 40], seed=4)
    c = case.key_cache
    wide = torch.full(c.shape[:-1] + (c.shape[-1] + 1,), float("nan"), dtype=c.dtype)[..., 1:]
    wide.copy_(c)
    case.key_cache, case.value_cache = wide, wide[..., :512]
    check(case)
    check(case, dict(force_split=1, partition_size=16))


def test_sm80_build_runs_the_wide_kernel():
    previous = selftest.set_emulated_arch(80)
    try:
        check(latent([2, 50], num_heads=16, cache_dtype=E4M3, seed=6))
        check(make_case([30], num_heads=2, num_kv_heads=2, head_size=576, value_head_size=576, dtype=F32, seed=7),
              dict(force_split=1, partition_size=16))
    finally:
        selftest.set_emulated_arch(previous)


def test_batch_invariant_prefill_rows_through_the_wide_kernel():
    # The batch-invariant mode runs prefill rows through decode.cuh: a latent row's bits alone and in
    # a chunked-prefill batch agree with the decode of the same position.
    case = make_case([40, 9], [6, 9], num_heads=16, num_kv_heads=1, head_size=576, value_head_size=512,
                     value_in_key=True, dtype=BF16, seed=8)
    out = case.new_out()
    paged_ops.backend("cuda_emu").prefill_attention(*case.prefill_args(out, True), batch_invariant=True)
    assert_close(out, case.reference_prefill(), case.dtype)
    # Row 5 of sequence 0 (40 cached, 6 new) is at position 39: a decode of seq_len 40.
    dec = replace(case, query=case.query[5:6], block_tables=case.block_tables[:1], seq_lens=case.seq_lens[:1])
    got = dec.new_out()
    paged_ops.backend("cuda_emu").decode_attention(*dec.decode_args(got), batch_invariant=True)
    assert torch.equal(got.view(torch.int16), out[5:6].view(torch.int16))
    assert ctas(plan(dec)) >= 2

"""The cpu backend's heads path (csrc/cpu/attention.h: TaskShape::heads_path): decode tasks of 16,
32, ... query rows per KV head on a bf16 cache (or fp8 under a bf16 query), where every row sees
the same keys, so QK runs with the rows as the lanes (bf16_dot.h dot_qk_heads, or amx_dot.h
amx_qk_heads on tiles: the key rows are read as they lie, no re-layout), the online softmax runs
across the rows (softmax_tile_heads) and PV is the dot path's. Absorbed MLA decode (16-128 heads,
576 / 512 in one latent row) is its main user; GQA decode of large groups takes it too.

On every build this machine runs that has it (avx512_bf16, amx_emulated, amx): the head sizes of
the latent and of plain heads (and sizes whose pairs are not a multiple of 16: the AMX builds keep
the rows path there), block sizes that make a tile's 16-token halves evenly spaced or not (the AMX
QK reads the former in place, gathers the latter), every variant with lse, fp8 caches, a NaN key
(every row NaN) and a NaN value no row sees, against the float64 reference. Rows not a multiple
of 16 (24) take the rows path on the same inputs and must agree too.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from paged_ops.testing import assert_close, assert_lse_close, make_case, named_variants, poison

ops = torch.ops.paged_cpu
BF16 = torch.bfloat16
ISAS = [isa for isa in ("avx512_bf16", "amx_emulated", "amx") if isa in ops.supported_isas()]

pytestmark = pytest.mark.skipif(not ISAS, reason="no AVX-512 BF16 here: the heads path is not built")


@pytest.fixture(params=ISAS)
def heads_isa(request):
    previous = ops.set_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_isa(previous)


def decode(case, kw):
    out, lse = poison(torch.empty(case.out_shape, dtype=BF16)), poison(torch.empty(case.query.shape[:2]))
    ops.decode_attention(*case.decode_args(out), lse=lse, **kw)
    return out, lse


def check(case, kw):
    out, lse = decode(case, kw)
    ref, ref_lse = case.reference_decode_lse(**kw)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)


# (heads, kv heads, Dk, Dv, value in key): the latent at 16 and 128 heads, a GQA group of 16 and of
# 32, Dk = 80 (40 pairs: no AMX heads path), Dv < Dk apart, and 24 rows (the rows path).
SHAPES = {
    "latent-16": (16, 1, 576, 512, True),
    "latent-128": (128, 1, 576, 512, True),
    "gqa-16": (32, 2, 128, 128, False),
    "gqa-32": (32, 1, 64, 64, False),
    "d80": (16, 1, 80, 80, False),
    "192-128": (16, 1, 192, 128, False),
    "rows-24": (24, 1, 128, 128, False),
}


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_against_the_reference(heads_isa, shape, block_size):
    heads, kv_heads, dk, dv, in_key = SHAPES[shape]
    # contexts: under a half tile, a tile and a bit, long enough to split
    case = make_case([5, 45, 700], num_heads=heads, num_kv_heads=kv_heads, head_size=dk, value_head_size=dv,
                     value_in_key=in_key, block_size=block_size, dtype=BF16, seed=block_size + heads)
    check(case, {})


@pytest.mark.parametrize("variant", ["softcap", "window", "sinks", "alibi", "all"])
@pytest.mark.parametrize("shape", ["latent-16", "gqa-32"])
def test_variants_with_lse(heads_isa, shape, variant):
    heads, kv_heads, dk, dv, in_key = SHAPES[shape]
    case = make_case([3, 90, 333], num_heads=heads, num_kv_heads=kv_heads, head_size=dk, value_head_size=dv,
                     value_in_key=in_key, block_size=16, dtype=BF16, seed=7)
    check(case, named_variants(heads, variant, seed=3))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_latent_under_a_bf16_query(heads_isa, fp8):
    case = make_case([40, 260], num_heads=16, num_kv_heads=1, head_size=576, value_head_size=512,
                     value_in_key=True, block_size=64, dtype=BF16, cache_dtype=fp8, seed=5)
    check(case, dict(softcap=4.0))


def test_nan_key_makes_every_row_nan_and_an_unseen_nan_value_none(heads_isa):
    case = make_case([100, 100], num_heads=16, num_kv_heads=1, head_size=128, block_size=16, dtype=BF16, seed=9)
    seen = int(case.block_tables[0, 60 // 16])
    case.key_cache[seen, 60 % 16, 0, 3] = float("nan")  # inside sequence 0's window: all its rows NaN
    unseen = int(case.block_tables[1, 10 // 16])
    case.value_cache[unseen, 10 % 16, 0, 5] = float("nan")  # outside sequence 1's window
    kw = dict(window_left=50)
    out, _ = decode(case, kw)
    ref, _ = case.reference_decode_lse(**kw)
    assert out[0].isnan().all() and ref[0].isnan().all()
    assert not out[1].isnan().any()
    assert_close(out[1:], ref[1:], BF16)

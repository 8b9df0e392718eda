"""The Triton backend's MLA paths (#24 item 1): keys and values of their own head sizes.

tests/test_attention_head_sizes.py runs the contract's cases on every backend; here what is
specific to the Triton kernels: the key split (a power-of-two main tile plus a power-of-two
remainder), V read from the K tile when value_cache is key_cache's first columns (V_FROM_K),
and GQA groups wider than one program's accumulator cut into head blocks (absorbed MLA's 128
heads on one latent KV head) in decode, prefill and the batch-invariant row-wise path, forced
split counts included. Interpreter on CPU tensors here, CUDA tensors on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from paged_ops.testing import assert_bits_equal, assert_close, assert_lse_close, make_case
from paged_ops.triton import decode, prefill
from paged_ops.triton._common import HeadDims, Variants, key_split, value_is_key_main

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3 = torch.float8_e4m3fn

pytestmark = pytest.mark.usefixtures("untuned_configs")


def absorbed(seq_lens, q_lens=None, num_heads=16, **kw):
    """DeepSeek's absorbed MLA: one latent KV head of 512 + 64, the value its first 512 columns."""
    kw = {"block_size": 16, "dtype": BF16, **kw}
    return make_case(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=1, head_size=576, value_head_size=512,
                     value_in_key=True, device=DEVICE, **kw)


class Recorded:
    """Wraps a kernel: records each launch's grid and constexprs, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("head_size,split", [
    (576, (512, 64)), (192, (128, 64)), (320, (256, 64)), (136, (128, 16)), (72, (128, 0)), (40, (64, 0)),
    (64, (64, 0)), (128, (128, 0)), (256, (256, 0)), (512, (512, 0)), (104, (128, 0)), (200, (256, 0)),
    (24, (32, 0)), (8, (16, 0)), (16, (16, 0))])
def test_key_split_saves_padding_only_where_it_can(head_size, split):
    main, rest = key_split(head_size)
    assert (main, rest) == split
    assert main + rest >= head_size and main & (main - 1) == 0 and rest & (rest - 1) == 0
    assert rest == 0 or (rest >= 16 and main < head_size)


def test_configs_of_equal_head_sizes_are_unchanged_by_the_value_width():
    # A call with Dk == Dv keys its default config as before values had their own size.
    for head_size in (64, 72, 80, 96, 128, 256):
        assert HeadDims(head_size, head_size).config_pad == max(16, 1 << (head_size - 1).bit_length())
        for dtype in (F32, F16, BF16):
            assert decode.default_config(head_size, dtype) == decode.default_config(head_size, dtype, None,
                                                                                 Variants(), head_size)
            assert prefill.default_config(head_size, dtype) == prefill.default_config(head_size, dtype, None,
                                                                                   Variants(), head_size)


def test_value_is_key_main_only_for_the_latent_view():
    dims = HeadDims(576, 512)
    c = absorbed([5])
    assert value_is_key_main(c.key_cache, c.value_cache, dims)
    kc = c.key_cache
    assert not value_is_key_main(kc, kc[..., 64:], dims)  # other columns: V read on its own
    assert not value_is_key_main(kc, kc[..., :512].clone(), dims)
    assert not value_is_key_main(kc, kc[..., :448], HeadDims(576, 448))  # not the whole main tile
    same = make_case([5], head_size=128, device=DEVICE)
    assert value_is_key_main(same.key_cache, same.key_cache, HeadDims(128, 128))
    assert not value_is_key_main(same.key_cache, same.value_cache, HeadDims(128, 128))


@pytest.mark.parametrize("num_heads,splits", [(16, 1), (16, 3), (128, 1), (128, 2)])
def test_absorbed_decode_reads_the_latent_once_per_head_block(monkeypatch, num_heads, splits):
    c = absorbed([33, 1, 70], num_heads=num_heads, seed=num_heads + splits)
    recorder = Recorded(decode._decode_kernel)
    monkeypatch.setattr(decode, "_decode_kernel", recorder)
    out = c.new_out()
    lse = torch.empty(c.query.shape[:2], device=DEVICE)
    config = decode.default_config(576, BF16, BF16, Variants(), 512)
    decode.run_decode(*c.decode_args(out), config, num_splits=splits, variants=Variants(lse=lse))
    ref, ref_lse = c.reference_decode_lse()
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, BF16)
    (grid, kw), = recorder.launches
    # One program per (sequence, head block, split); V from the K tile; the key as 512 + 64.
    block_m = decode.block_rows(num_heads, 512, config["num_warps"])
    assert kw["V_FROM_K"] and kw["BLOCK_M"] == block_m and (kw["HEAD_MAIN"], kw["HEAD_REST"]) == (512, 64)
    assert grid[1] == -(-num_heads // block_m) and (num_heads == 16) == (grid[1] == 1)


def test_separate_value_cache_of_the_main_width_is_read_on_its_own(monkeypatch):
    # Same shapes as the latent, but value_cache its own tensor: V is loaded, not taken from K.
    c = make_case([20, 7], num_heads=4, num_kv_heads=2, head_size=576, value_head_size=512, dtype=F16,
                  cache_dtype=E4M3, scale_kind="seq", layout="HND", device=DEVICE, seed=3)
    recorder = Recorded(decode._decode_kernel)
    monkeypatch.setattr(decode, "_decode_kernel", recorder)
    out = c.new_out()
    decode.run_decode(*c.decode_args(out), decode.default_config(576, F16, E4M3, Variants(), 512), num_splits=2)
    assert_close(out, c.reference_decode(), F16)
    assert not recorder.launches[0][1]["V_FROM_K"]


@pytest.mark.parametrize("num_heads", [16, 128])
def test_absorbed_prefill_with_head_blocks(monkeypatch, num_heads):
    # Chunked prefill over cached context with decode rows mixed in; 128 heads: row blocks hold
    # part of the group (HEAD_TILE < GROUP_SIZE), each block its own program.
    c = absorbed([9, 30, 4], [9, 5, 1], num_heads=num_heads, block_size=3, seed=num_heads)
    recorder = Recorded(prefill._prefill_kernel)
    monkeypatch.setattr(prefill, "_prefill_kernel", recorder)
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(num_heads, generator=g).to(DEVICE)
    out, lse = c.new_out(), torch.empty(c.query.shape[:2], device=DEVICE)
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    prefill.run_prefill(*c.prefill_args(out), config, Variants(sinks=sinks, lse=lse, window_left=6))
    ref, ref_lse = c.reference_prefill_lse(sinks=sinks, window_left=6)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, BF16)
    (grid, kw), = recorder.launches
    assert kw["V_FROM_K"] and kw["HEAD_TILE"] == min(num_heads, kw["BLOCK_M"])
    assert grid[1] == -(-num_heads // kw["HEAD_TILE"])


def test_non_absorbed_prefill_hidden_nonfinite_values():
    # DeepSeek's 192 / 128 with inf in every key and value outside the rows' windows: the masked
    # tiles' repair pass reads keys as 128 + 64 and values as 128 columns.
    c = make_case([30, 12], [12, 12], num_heads=2, num_kv_heads=2, head_size=192, value_head_size=128, dtype=F16,
                  block_size=5, device=DEVICE, seed=5)
    c.poison_hidden(True, window_left=4)
    out, lse = c.new_out(), torch.empty(c.query.shape[:2], device=DEVICE)
    prefill.run_prefill(*c.prefill_args(out), {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
                        Variants(window_left=4, lse=lse))
    ref, ref_lse = c.reference_prefill_lse(window_left=4)
    assert_close(out, ref, F16)
    assert_lse_close(lse, ref_lse, F16)


def test_batch_invariant_rows_at_128_heads():
    # The row-wise path with head blocks: a causal prefill row gives the bits of the decode of
    # its position, and a row's bits do not depend on the rest of the batch.
    c = absorbed([40], [40], num_heads=128, seed=9)
    out = c.new_out()
    prefill.prefill_attention(*c.prefill_args(out), batch_invariant=True)
    assert_close(out, c.reference_prefill(), BF16)
    for p in (0, 17, 39):
        one = torch.full((1, 128, 512), float("nan"), dtype=BF16, device=DEVICE)
        decode.decode_attention(one, c.query[p:p + 1], c.key_cache, c.value_cache, c.block_tables,
                                torch.tensor([p + 1], dtype=torch.int32, device=DEVICE), c.scale,
                                batch_invariant=True)
        assert_bits_equal(one, out[p:p + 1], f"decode of {p + 1} keys vs prefill row {p}")

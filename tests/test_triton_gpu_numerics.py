"""The Triton backend's GPU numerics, checked under the interpreter: fp8 NaN / inf bytes, the GPU's
bf16 rounding, the error of long contexts.

Each case is a bug a review of the CPU proof found (issue #11, #12 item 6), and failed before its fix:
- fp8 bytes: an e4m3fn NaN byte (0x7F / 0xFF) was decoded as +-480 (times the scale) in the
  attention kernels and in dequantize_fp8, and dequantize_fp8 loaded the fp8 tensor itself
  (Triton's fp8e4nv, which does not compile before sm_89); e5m2 infinities must stay infinite.
- GPU numerics: the interpreter widens bf16 dots to fp32 and truncates fp32 -> bf16 where a GPU
  rounds to nearest even; the kernels now round the softmax weights and the output the way the
  GPU does, so the error measured here (long contexts included) is the GPU's.
The 64-bit offset fixes are proven by tests/test_large_offsets.py (triton is one of its backends).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from paged_ops import reference
from paged_ops.testing import assert_close, nan_like, rel_err
from paged_ops import triton as triton_backend
from paged_ops.triton import decode
from paged_ops.triton._common import INTERPRET
from paged_ops.triton._tiles import round_to_bf16

pytestmark = [pytest.mark.skipif(not triton_backend.is_available() or "cpu" not in triton_backend.DEVICES,
                                 reason="needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest)"),
              pytest.mark.usefixtures("untuned_configs")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same_values(out: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN exactly where ref is NaN, every other value bit-identical (inf included)."""
    assert torch.equal(out.isnan(), ref.isnan()), (out[out.isnan() != ref.isnan()], ref[out.isnan() != ref.isnan()])
    keep = ~ref.isnan()
    assert torch.equal(out[keep], ref[keep]), (out[keep][out[keep] != ref[keep]], ref[keep][out[keep] != ref[keep]])


# ---------------------------------------------------------------------------------------------
# fp8 bytes

@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_dequantize_fp8_every_byte_matches_torch(fp8, out_dtype, scale):
    # All 256 bytes: NaN (e4m3fn 0x7F/0xFF, e5m2 0x7D-0x7F/0xFD-0xFF) -> NaN, e5m2 +-inf -> +-inf,
    # subnormals and the largest values exact. Before: e4m3fn NaN gave +-480 x scale.
    src = torch.arange(256, dtype=torch.uint8).view(fp8).view(16, 16)
    s = torch.tensor([scale])
    out, ref = nan_like(torch.empty(16, 16, dtype=out_dtype)), torch.empty(16, 16, dtype=out_dtype)
    triton_backend.dequantize_fp8(out, src, s)
    reference.dequantize_fp8(ref, src, s)
    _same_values(out, ref)


def _nonfinite_case(fp8, byte, which, seq_len, pos, seed):
    """Two sequences over fp8 caches (scale 0.5); one K or V byte of KV head 1 at ``pos`` of
    sequence 0 set to ``byte``. Returns (query, caches..., tables, lens, scale tensor)."""
    num_blocks, block_size, kvh, d = 80, 16, 2, 64
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(fp8)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(fp8)
    (kc if which == "k" else vc).view(torch.uint8)[pos // block_size, pos % block_size, 1, 5] = byte
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, 40)
    lens = torch.tensor([seq_len, 40], dtype=torch.int32)
    return kc, vc, tables, lens, torch.tensor([0.5]), gen


def _check_nonfinite(out, ref):
    assert torch.equal(out.isnan(), ref.isnan()), (out.isnan().any(-1), ref.isnan().any(-1))
    assert torch.equal(out.isinf(), ref.isinf())
    finite = ref.isfinite().all(-1)
    assert_close(out[finite], ref[finite], torch.float32)


# NaN bytes (e4m3fn 0x7F / 0xFF, e5m2 0x7E) and e5m2 infinities (0x7C / 0xFC), in K and in V, in
# the first, a middle and the last tile of a sequence long enough to be split.
NONFINITE = [(E4M3, 0x7F), (E4M3, 0xFF), (E5M2, 0x7C), (E5M2, 0xFC), (E5M2, 0x7E)]
POSITIONS = [(40, 0), (40, 39), (600, 300), (600, 599)]


@pytest.mark.parametrize("fp8,byte", NONFINITE)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_nan_and_inf_bytes_like_reference(fp8, byte, which, num_splits):
    for seq_len, pos in POSITIONS:
        kc, vc, tables, lens, s, gen = _nonfinite_case(fp8, byte, which, seq_len, pos, byte + pos)
        q = torch.randn(2, 8, 64, generator=gen)
        out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
        decode.run_decode(out, q, kc, vc, tables, lens, 0.125, s, s, decode.default_config(64, q.dtype), num_splits)
        reference.decode_attention(ref, q.double(), kc, vc, tables, lens, 0.125, s, s)
        if byte in (0x7F, 0xFF, 0x7E):  # a NaN reaches every query head of KV head 1, sequence 0
            assert ref[0, 4:].isnan().any(-1).all()
        _check_nonfinite(out, ref)


@pytest.mark.parametrize("fp8,byte", NONFINITE)
@pytest.mark.parametrize("which", ["k", "v"])
def test_prefill_fp8_nan_and_inf_bytes_like_reference(fp8, byte, which):
    for seq_len, pos in POSITIONS:
        kc, vc, tables, lens, s, gen = _nonfinite_case(fp8, byte, which, seq_len, pos, byte + pos)
        q_lens = [8, 2]  # sequence 0's last 8 rows: all see pos 0 and 300, one sees 39 / 599
        cu = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 8, 64, generator=gen)
        out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
        triton_backend.prefill_attention(out, q, kc, vc, tables, cu, lens, max(q_lens), 0.125, True, s, s)
        reference.prefill_attention(ref, q.double(), kc, vc, tables, cu, lens, max(q_lens), 0.125, True, s, s)
        _check_nonfinite(out, ref)


# ---------------------------------------------------------------------------------------------
# GPU numerics under the interpreter

@triton.jit
def _round_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, round_to_bf16(tl.load(in_ptr + offs, mask=offs < n)), mask=offs < n)


def test_round_to_bf16_is_round_to_nearest_even():
    # Ties both ways, values that round up into the next binade and to inf, subnormals, inf, NaN.
    g = torch.Generator().manual_seed(0)
    bits = torch.cat([torch.randint(0, 1 << 31, (4000,), generator=g),
                      torch.tensor([0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                                    0x00008000, 0x00018000, 0x007FFFFF, 0x7F800000, 0x7FC00000, 0])])
    bits = torch.cat([bits, bits | (1 << 31)]).to(torch.int32)
    x = bits.view(torch.float32)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](out, x, x.numel(), BLOCK=1024)
    _same_values(out, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_bf16_output_is_rounded_to_nearest_even(op):
    # q = 0: every score is 0, so the output is the exact fp32 mean of two bf16 V rows, and a
    # GPU stores its nearest-even bf16: the reference's float64 result cast by torch. Before,
    # the interpreter truncated (about half of the elements one bf16 ulp low).
    d = 64
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(4, 16, 2, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(4, 16, 2, d, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([2, 2], dtype=torch.int32)
    q = torch.zeros(2, 8, d, dtype=torch.bfloat16)
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    if op == "decode":
        triton_backend.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5)
        reference.decode_attention(ref, q.double(), kc, vc, tables, lens, d ** -0.5)
    else:
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        triton_backend.prefill_attention(out, q, kc, vc, tables, cu, lens, 1, d ** -0.5, True)
        reference.prefill_attention(ref, q.double(), kc, vc, tables, cu, lens, 1, d ** -0.5, True)
    assert torch.equal(out.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))


def test_bf16_softmax_weights_are_rounded_like_the_gpu():
    # One sequence, one tile: the GPU computes out = bf16(sum_j bf16(p_j) v_j / sum_j p_j) with
    # p_j = exp2(s_j - max) in fp32. Emulated here in float64 from the same p_j, the kernel
    # matches it up to an fp32-rounding tie flip; unrounded p (what the interpreter did before)
    # is off by the bf16 rounding of p.
    # Keys one-hot at +-1 or +-2: every score is one product q_i * k_ji, so its fp32 value is the same
    # whether the kernel scales q before the dot or the dot after, and whatever order the
    # interpreter's matmul sums in (a random key's fp32 dot rounds differently with the CPU's BLAS
    # kernels: a seed that passed on one machine failed on another).
    d, n = 64, 24
    g = torch.Generator().manual_seed(2)
    kc = torch.zeros(2 * 16, d)
    kc[torch.arange(2 * 16), torch.randperm(d, generator=g)[:2 * 16]] = (
        torch.tensor([1.0, -1.0, 2.0, -2.0])[torch.randint(4, (2 * 16,), generator=g)])
    kc = kc.view(2, 16, 1, d).to(torch.bfloat16)
    vc = torch.randn(2, 16, 1, d, generator=g).to(torch.bfloat16)
    q = (torch.randn(1, 1, d, generator=g) * 2).to(torch.bfloat16)
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    out = nan_like(q)
    decode.run_decode(out, q, kc, vc, tables, lens, d ** -0.5, None, None, decode.default_config(d, q.dtype), 1)
    k = kc[:, :, 0].reshape(-1, d)[:n].float()
    v = vc[:, :, 0].reshape(-1, d)[:n].double()
    # fp32 scores and exp2 by numpy, the interpreter's own arithmetic: torch's and numpy's fp32
    # exp2 differ in the last bit on some builds (numpy 2.4 here), enough to flip a bf16 rounding.
    # The kernel's order (q pre-multiplied by scale * log2(e), then the dot); one-hot keys make it exact.
    s = (q[0].float() * np.float32(d ** -0.5 * 1.4426950408889634)).numpy() @ k.T.numpy()
    p = torch.from_numpy(np.exp2(s - s.max()))  # fp32, as in the kernel
    gpu = (p.to(torch.bfloat16).double() @ v) / p.double().sum()
    unrounded = (p.double() @ v) / p.double().sum()
    gpu, unrounded = gpu[0].to(torch.bfloat16), unrounded[0]
    err_gpu, err_unrounded = rel_err(out[0, 0], gpu), rel_err(unrounded.to(torch.bfloat16), gpu)
    assert err_unrounded > 3e-4  # the emulation tells the two apart on this input
    assert err_gpu < err_unrounded / 4, (err_gpu, err_unrounded)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_error_within_budget(dtype):
    # 16400 cached tokens, decode (flash-decoding splits) and the last 16 rows of a prefill chunk,
    # with the GPU's roundings (see module docstring): within the contract's budget for dtype.
    if not INTERPRET:
        pytest.skip("the interpreter's numerics are what this test measures")
    seq_len, block_size, kvh, group, d = 16400, 16, 2, 4, 128
    g = torch.Generator().manual_seed(3)
    blocks = -(-seq_len // block_size)
    kc = torch.randn(blocks, block_size, kvh, d, generator=g).to(dtype)
    vc = torch.randn(blocks, block_size, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g).to(torch.int32)[None]
    lens = torch.tensor([seq_len], dtype=torch.int32)
    q = torch.randn(1, kvh * group, d, generator=g).to(dtype)
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    triton_backend.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5)
    reference.decode_attention(ref, q.double(), kc, vc, tables, lens, d ** -0.5)
    print(f"{dtype} decode over {seq_len} tokens: relative L2 error {rel_err(out, ref):.3g}")
    assert_close(out, ref, dtype)
    q = torch.randn(16, kvh * group, d, generator=g).to(dtype)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    triton_backend.prefill_attention(out, q, kc, vc, tables, cu, lens, 16, d ** -0.5, True)
    reference.prefill_attention(ref, q.double(), kc, vc, tables, cu, lens, 16, d ** -0.5, True)
    print(f"{dtype} prefill, 16 rows over {seq_len} tokens: relative L2 error {rel_err(out, ref):.3g}")
    assert_close(out, ref, dtype)

"""fp8 conversions shared by every kernel, plus the ``quantize_fp8`` / ``dequantize_fp8`` ops.

The contract asks for results bit-identical to ``paged_ops.reference``, i.e. to torch's
casts. Triton's native casts are not usable for that: its interpreter rounds fp32 -> fp8
half-up without sticky bits and truncates fp32 -> bf16, and pre-Hopper GPUs emulate fp8.
So the rounding is done here with integer arithmetic, which is exact and identical on the
interpreter and every GPU, and the result is stored through a uint8 / uint16 view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import device_guard, fp8_format
from ._tiles import fp8_bits_to_float

# Per fp8 format: (largest finite value, mantissa bits, exponent bias).
FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, 7),
    torch.float8_e5m2: (57344.0, 2, 15),
}


@triton.jit
def saturating_fp8_bits(y, FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Bits (uint8) of ``clamp(y, -max, max)`` rounded to nearest-even in the fp8 format.

    y: fp32 tensor of any shape. NaN maps to 0x7F | sign, as torch's cast does.
    """
    is_nan = y != y
    # The sign before the clamp: clamping keeps every number's sign, but min/max of a NaN may
    # return either operand (triton 3.8 returns -FP8_MAX for +NaN), which would flip a NaN's sign.
    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    bits = y.to(tl.uint32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    exponent = (abits >> 23).to(tl.int32) - 127

    # Normal range: drop the low mantissa bits with round-half-to-even; a carry out of the
    # mantissa correctly bumps the exponent. Clamping above keeps the result finite.
    DROP: tl.constexpr = 23 - MANT
    rounded = (abits + ((1 << (DROP - 1)) - 1) + ((abits >> DROP) & 1)) >> DROP
    normal = rounded - ((127 - BIAS) << MANT)

    # Subnormal range: the value in units of the smallest subnormal is mantissa >> shift;
    # round that integer division half-to-even. Rounding up to 1 << MANT yields the
    # smallest normal number's encoding, which is what we want.
    mantissa = (abits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((24 - BIAS - MANT) - exponent, 1), 31).to(tl.uint32)
    quotient = mantissa >> shift
    remainder = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.uint32)

    magnitude = tl.where(exponent >= 1 - BIAS, normal, subnormal)
    magnitude = tl.where(is_nan, 0x7F, magnitude)
    return (magnitude | sign).to(tl.uint8)


@triton.jit
def bf16_bits(x):
    """Bits (uint16) of fp32 ``x`` rounded to nearest-even bf16 (NaN -> canonical quiet NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16)


@triton.jit
def _quantize_kernel(out_ptr, in_ptr, scale_ptr, n,
                     FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    # out: uint8 view of the fp8 output, in: flat input; both contiguous [n]
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.math.div_rn(x, tl.load(scale_ptr))  # true division, as the contract specifies
    tl.store(out_ptr + offs, saturating_fp8_bits(y, FP8_MAX, MANT, BIAS), mask=mask)


@triton.jit
def _dequantize_kernel(out_ptr, in_ptr, scale_ptr, n, FP8_FORMAT: tl.constexpr, OUT_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    # out: flat output (uint16 view when bf16), in: uint8 view of the fp8 input; both contiguous [n].
    # Bytes, not Triton's fp8 types: fp8e4nv does not exist before sm_89, and the byte decoding
    # maps e4m3fn NaN to NaN and e5m2 inf to inf, as torch's cast does.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = fp8_bits_to_float(tl.load(in_ptr + offs, mask=mask, other=0), FP8_FORMAT) * tl.load(scale_ptr)
    if OUT_BF16:
        tl.store(out_ptr + offs, bf16_bits(x), mask=mask)
    else:
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


def _contiguous_target(out: torch.Tensor) -> torch.Tensor:
    # Kernels write flat memory; a non-contiguous `out` gets a scratch buffer copied back.
    return out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)


def quantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out (fp8) = saturate(input / scale), round-to-nearest-even; per-tensor ``scale``."""
    fp8_max, mant, bias = FP8_FORMATS[out.dtype]
    target = _contiguous_target(out)
    src = input.contiguous()
    n = src.numel()
    with device_guard(src):
        _quantize_kernel[(triton.cdiv(n, _BLOCK),)](
            target.view(torch.uint8), src, scale, n,
            FP8_MAX=fp8_max, MANT=mant, BIAS=bias, BLOCK=_BLOCK)
    if target is not out:
        out.copy_(target)


def dequantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out = input (fp8) * scale in fp32, cast to out's dtype."""
    target = _contiguous_target(out)
    src = input.contiguous()
    n = src.numel()
    is_bf16 = out.dtype == torch.bfloat16
    with device_guard(src):
        _dequantize_kernel[(triton.cdiv(n, _BLOCK),)](
            target.view(torch.int16) if is_bf16 else target, src.view(torch.uint8), scale, n,
            FP8_FORMAT=fp8_format(input.dtype), OUT_BF16=is_bf16, BLOCK=_BLOCK)
    if target is not out:
        out.copy_(target)

"""``python -m paged_ops.demo``: every op of every backend runnable here checked against the
float64 reference on random inputs (``paged_ops.testing``), one table row per op and dtype.

The quick CPU decode benchmark that ``make demo`` prints after it is ``bench/decode_table.py``.
"""
from __future__ import annotations

import math

import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import TOLERANCE, bits, make_case, nan_like, rel_err


def check_backend(name: str) -> list[tuple[str, str, float, bool]]:
    """(op, variant, error, ok) rows for one backend (on CPU tensors)."""
    ops = paged_ops.backend(name)
    rows = []
    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)):
        label = f"{str(dtype)[6:]}/{str(cache_dtype)[6:]}"
        shape = dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype, cache_dtype=cache_dtype)
        # chunked prefill over cached context, a fresh prompt and a decode row in one batch
        case = make_case([70, 5, 33], [20, 5, 1], **shape)
        out = nan_like(case.query)
        ops.prefill_attention(*case.prefill_args(out))
        err = rel_err(out, case.reference_prefill())
        rows.append(("prefill_attention", label, err, err <= TOLERANCE[dtype]))
        case = make_case([70, 5, 33], **shape)
        out = nan_like(case.query)
        ops.decode_attention(*case.decode_args(out))
        err = rel_err(out, case.reference_decode())
        rows.append(("decode_attention", label, err, err <= TOLERANCE[dtype]))
        key, value = torch.randn(6, 2, 128).to(dtype), torch.randn(6, 2, 128).to(dtype)
        slots = torch.tensor([1, 4, -1, 17, 30, 2])
        got = (case.key_cache.clone(), case.value_cache.clone())
        want = (case.key_cache.clone(), case.value_cache.clone())
        ops.reshape_and_cache(key, value, *got, slots, case.k_scale, case.v_scale)
        reference.reshape_and_cache(key, value, *want, slots, case.k_scale, case.v_scale)
        same = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
        rows.append(("reshape_and_cache", label, 0.0 if same else math.inf, same))
    x, scale = torch.randn(1000) * 100, torch.tensor([0.5])
    q8, q8_ref = torch.empty(1000, dtype=torch.float8_e4m3fn), torch.empty(1000, dtype=torch.float8_e4m3fn)
    ops.quantize_fp8(q8, x, scale)
    reference.quantize_fp8(q8_ref, x, scale)
    same = torch.equal(bits(q8), bits(q8_ref))
    rows.append(("quantize_fp8", "float32->e4m3", 0.0 if same else math.inf, same))
    y, y_ref = torch.empty(1000), torch.empty(1000)
    ops.dequantize_fp8(y, q8, scale)
    reference.dequantize_fp8(y_ref, q8, scale)
    rows.append(("dequantize_fp8", "e4m3->float32", 0.0, torch.equal(y, y_ref)))
    caches = [torch.randn(6, 4, 2, 64) for _ in range(4)]
    want = [c.clone() for c in caches]
    ops.copy_blocks(caches[:2], caches[2:], torch.tensor([[0, 3], [1, 5]]))
    reference.copy_blocks(want[:2], want[2:], torch.tensor([[0, 3], [1, 5]]))
    rows.append(("copy_blocks", "2 layers", 0.0, all(torch.equal(a, b) for a, b in zip(caches, want))))
    dst, dst_ref = torch.zeros(3, 4, 2, 64), torch.zeros(3, 4, 2, 64)
    ops.swap_blocks(caches[0], dst, torch.tensor([[4, 0], [2, 2]]))
    reference.swap_blocks(caches[0], dst_ref, torch.tensor([[4, 0], [2, 2]]))
    rows.append(("swap_blocks", "cpu->cpu", 0.0, torch.equal(dst, dst_ref)))
    return rows


def main() -> None:
    print(f"paged_ops on torch {torch.__version__}; backends here: {paged_ops.available_backends()}")
    failures = 0
    for name in paged_ops.available_backends():
        if "cpu" not in paged_ops.backend(name).devices:
            continue
        print(f"\n== backend {name!r} vs float64 reference ==")
        print(f"{'op':<20}{'dtypes':<22}{'rel L2 err':>12}  ok")
        for op, variant, err, ok in check_backend(name):
            failures += not ok
            print(f"{op:<20}{variant:<22}{err:>12.2e}  {'yes' if ok else 'NO'}")
    if failures:
        raise SystemExit(f"{failures} check(s) failed")


if __name__ == "__main__":
    main()

"""``python -m paged_ops.demo``: every op of every backend runnable here checked against the
float64 reference on random inputs, then a short decode benchmark across block sizes.

Bandwidth is reported next to this machine's memory-copy bandwidth measured in the same run
(read + write bytes / time, the STREAM convention), so the ratio means something on a noisy box.
"""
from __future__ import annotations

import math
import time

import torch

import paged_ops
from paged_ops import reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def random_case(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, cache_dtype, device="cpu"):
    """Caches whose unused slots hold NaN, a random block table, and random queries."""
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc, vc = torch.empty(shape, dtype=cache_dtype), torch.empty(shape, dtype=cache_dtype)
    for c in (kc, vc):
        c.view(torch.uint8).fill_(0x7F) if cache_dtype.itemsize == 1 else c.fill_(float("nan"))
    scales = (torch.tensor([0.02]), torch.tensor([0.03])) if cache_dtype.itemsize == 1 else (None, None)
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        nb = math.ceil(n / block_size)
        tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(n)
        slots = tables[s, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        reference.reshape_and_cache(k, torch.randn(k.shape, generator=g).to(dtype), kc, vc, slots, *scales)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_size, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, kc, vc, tables, cu, lens, scales


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_backend(name: str) -> list[tuple[str, str, float, bool]]:
    """(op, variant, error, ok) rows for one backend."""
    ops = paged_ops.backend(name)
    rows = []
    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float16),
                               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)):
        label = f"{str(dtype)[6:]}/{str(cache_dtype)[6:]}"
        q, kc, vc, bt, cu, lens, (ks, vs) = random_case([70, 5, 33], [20, 5, 1], 8, 2, 128, 16, dtype, cache_dtype)
        out, ref = torch.full_like(q, float("nan")), torch.empty(q.shape, dtype=torch.float64)
        ops.prefill_attention(out, q, kc, vc, bt, cu, lens, 20, 128 ** -0.5, True, ks, vs)
        reference.prefill_attention(ref, q.double(), kc, vc, bt, cu, lens, 20, 128 ** -0.5, True, ks, vs)
        err = rel_err(out, ref)
        rows.append(("prefill_attention", label, err, err <= TOLERANCE[dtype]))
        dq = q[:3].contiguous()
        out, ref = torch.full_like(dq, float("nan")), torch.empty(dq.shape, dtype=torch.float64)
        ops.decode_attention(out, dq, kc, vc, bt, lens, 128 ** -0.5, ks, vs)
        reference.decode_attention(ref, dq.double(), kc, vc, bt, lens, 128 ** -0.5, ks, vs)
        err = rel_err(out, ref)
        rows.append(("decode_attention", label, err, err <= TOLERANCE[dtype]))
        key, value = torch.randn(6, 2, 128).to(dtype), torch.randn(6, 2, 128).to(dtype)
        slots = torch.tensor([1, 4, -1, 17, 30, 2])
        got, want = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
        ops.reshape_and_cache(key, value, *got, slots, ks, vs)
        reference.reshape_and_cache(key, value, *want, slots, ks, vs)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
        rows.append(("reshape_and_cache", label, 0.0 if same else math.inf, same))
    x, scale = torch.randn(1000) * 100, torch.tensor([0.5])
    q8, q8_ref = torch.empty(1000, dtype=torch.float8_e4m3fn), torch.empty(1000, dtype=torch.float8_e4m3fn)
    ops.quantize_fp8(q8, x, scale)
    reference.quantize_fp8(q8_ref, x, scale)
    same = torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))
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


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Best-of-5 memory-copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_table(block_sizes=(1, 16, 64, 256), num_seqs=16, seq_len=2048, num_heads=32, num_kv_heads=8,
                 head_size=128, dtype=torch.bfloat16):
    """Decode time and achieved bandwidth (KV bytes read / time) per block size."""
    rows = []
    for block_size in block_sizes:
        num_blocks = num_seqs * seq_len // block_size
        kc = torch.randn(num_blocks, block_size, num_kv_heads, head_size).to(dtype)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_blocks).to(torch.int32).reshape(num_seqs, -1)
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
        q = torch.randn(num_seqs, num_heads, head_size).to(dtype)
        out = torch.empty_like(q)
        args = (out, q, kc, vc, tables, lens, head_size ** -0.5, None, None)
        torch.ops.paged.decode_attention(*args)
        best = min(_timed(lambda: torch.ops.paged.decode_attention(*args)) for _ in range(5))
        rows.append((block_size, best * 1e3, 2 * kc.numel() * kc.element_size() / best / 1e9))
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
    copy_bw = copy_bandwidth()
    print(f"\n== cpu decode, bf16, 16 seqs x 2048 tokens, 32/8 heads, head 128 "
          f"({torch.get_num_threads()} threads) ==")
    print(f"memory copy bandwidth (read+write): {copy_bw:.1f} GB/s")
    print(f"{'block':>6}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    for block_size, ms, gbs in decode_table():
        print(f"{block_size:>6}{ms:>9.2f}{gbs:>9.2f}{gbs / copy_bw:>9.0%}")
    if failures:
        raise SystemExit(f"{failures} check(s) failed")


if __name__ == "__main__":
    main()

"""Shared test machinery: random paged KV caches with poisoned unused slots, and the error budget.

The error budget is stated once (TOLERANCE): relative L2 error of a backend's output against
``paged_ops.reference`` run in float64 on the same (stored) inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paged_ops import reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, NaN-propagating (a NaN anywhere fails every budget)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(out, ref)
    assert not math.isnan(err), "output holds NaN: a poisoned slot or output row leaked"
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.3g} > {TOLERANCE[dtype]:g} for {dtype}"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (fp8: the 0x7F NaN bit pattern, valid for e4m3fn and e5m2)."""
    if t.dtype in FP8:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return poison(torch.empty_like(t))


def empty_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout="NHD", device="cpu"):
    """A poisoned cache in the contract's [num_blocks, block_size, num_kv_heads, head_size] view.

    layout "HND" allocates [num_blocks, num_kv_heads, block_size, head_size] and permutes it.
    """
    if layout == "NHD":
        c = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    else:
        c = torch.empty(num_blocks, num_kv_heads, block_size, head_size, dtype=dtype, device=device).transpose(1, 2)
    return poison(c)


@dataclass
class PagedCase:
    """A batch of sequences whose first seq_lens[s] tokens are cached; every other slot is NaN."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)

    @property
    def max_seqlen_q(self) -> int:
        return int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max()) if len(self.seq_lens) else 0

    def prefill_args(self, out, causal=True):
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables, self.cu_seqlens_q,
                self.seq_lens, self.max_seqlen_q, self.scale, causal, self.k_scale, self.v_scale)

    def decode_args(self, out):
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.scale, self.k_scale, self.v_scale)

    def reference_prefill(self, causal=True) -> torch.Tensor:
        ref = torch.empty(self.query.shape, dtype=torch.float64)
        args = list(self.prefill_args(ref, causal))
        args[1] = self.query.double().cpu()
        args[2], args[3] = self.key_cache.cpu(), self.value_cache.cpu()
        args[4:7] = [a.cpu() for a in args[4:7]]
        args[10:] = [None if s is None else s.cpu() for s in args[10:]]
        reference.prefill_attention(*args)
        return ref


def make_case(seq_lens, q_lens=None, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
              dtype=torch.float32, cache_dtype=None, layout="NHD", scale_kind="tensor",
              spare_blocks=3, device="cpu", seed=0) -> PagedCase:
    """Random queries and caches; blocks are handed out in random order, some left unused.

    q_lens defaults to 1 per sequence (decode). fp8 caches are filled through the reference
    quantizer with random positive scales, per tensor or per head.
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [1] * len(seq_lens)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq + [1]) + 1  # a spare, never-used column
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    # Unused table entries point at a real but poisoned block, or hold garbage ids: both
    # must be ignored.
    block_tables = torch.randint(-5, num_blocks * 3, (len(seq_lens), max_blocks), generator=g).to(torch.int32)
    taken = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[taken:taken + n]
        taken += n

    kc = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
    vc = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
    k_scale = v_scale = None
    if cache_dtype in FP8:
        n = 1 if scale_kind == "tensor" else num_kv_heads
        k_scale = (torch.rand(n, generator=g) * 0.05 + 0.01).float()
        v_scale = (torch.rand(n, generator=g) * 0.05 + 0.01).float()
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
        reference.reshape_and_cache(k, v, kc, vc, slots, k_scale, v_scale)

    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_size, generator=g).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PagedCase(query=to(query), key_cache=kc.to(device) if device != "cpu" else kc,
                     value_cache=vc.to(device) if device != "cpu" else vc,
                     block_tables=to(block_tables), seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
                     cu_seqlens_q=to(cu), k_scale=to(k_scale), v_scale=to(v_scale),
                     scale=head_size ** -0.5, dtype=dtype)

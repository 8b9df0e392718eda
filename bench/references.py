"""Reference implementations the paged kernels are compared with, on the same shapes:

- prefill: torch's scaled_dot_product_attention with the flash backend, on the same sequences laid
  out contiguously ([num_seqs, heads, context, head_size]; no paging, no varlen), causal;
- decode (GPU): FlexAttention's paged decode (torch.nn.attention.experimental PagedAttention with
  a converted block mask, compiled), pages of 128 tokens handed out in random order like ours.

Each builder returns (a zero-argument callable running one call, bytes of KV it reads), for the
same rotating-input timing as the kernels.
"""
from __future__ import annotations

import math
import random

import torch

from bench.kernels import Case, _rand


def sdpa_flash_prefill(case: Case, device: str, seed: int):
    """Causal SDPA, flash backend forced (fails rather than silently falling back to math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device).manual_seed(seed)
    c, dt = case, case.torch_dtype
    q = _rand((c.num_seqs, c.num_heads, c.context_len, c.head_size), dt, device, g)
    k = _rand((c.num_seqs, c.num_kv_heads, c.context_len, c.head_size), dt, device, g)
    v = _rand((c.num_seqs, c.num_kv_heads, c.context_len, c.head_size), dt, device, g)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        run()
    except RuntimeError:  # a flash build without GQA: give it K/V with the query's head count
        k = k.repeat_interleave(c.group, 1)
        v = v.repeat_interleave(c.group, 1)
        run.kv_heads_expanded = True
    return run


_compiled_flex = None


def flex_paged_decode(case: Case, device: str, seed: int, page_size: int = 128):
    """FlexAttention paged decode: one query token per sequence over its context_len cached tokens,
    the cache [1, kv_heads, pages * page_size, head_size] with pages assigned in random order."""
    global _compiled_flex
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator(device).manual_seed(seed)
    c, dt = case, case.torch_dtype
    pages_per_seq = math.ceil(c.context_len / page_size)
    n_pages = c.num_seqs * pages_per_seq
    pa = PagedAttention(n_pages, page_size, c.num_seqs, device=device)
    pa.empty_pages = random.Random(seed).sample(range(n_pages), n_pages)  # scattered, as in our caches
    for b in range(c.num_seqs):
        pa.reserve(torch.tensor(b, device=device), torch.tensor(c.context_len, device=device))
    kc = _rand((1, c.num_kv_heads, n_pages * page_size, c.head_size), dt, device, g)
    vc = _rand((1, c.num_kv_heads, n_pages * page_size, c.head_size), dt, device, g)
    q = _rand((c.num_seqs, c.num_heads, 1, c.head_size), dt, device, g)
    L = c.context_len
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < L, c.num_seqs, None, 1,
                                pages_per_seq * page_size, device=device, BLOCK_SIZE=page_size)
    mask = pa.convert_logical_block_mask(logical)
    score_mod = pa.get_score_mod(None)

    run_inputs = {"q": q, "k_cache": kc, "v_cache": vc, "page_table": pa.page_table, "page_size": page_size}

    def run():
        return _compiled_flex(q, kc, vc, block_mask=mask, score_mod=score_mod, enable_gqa=True)
    run.inputs = run_inputs  # for the check that this is paged decode (tests/test_bench_smoke.py)
    return run

"""paged-ops: paged KV-cache attention kernels as ``torch.ops.paged.*``.

Importing the package registers the ops. Call them directly (``torch.ops.paged.decode_attention``)
or through the wrappers below; both validate their inputs and route to a backend
(``paged_ops.backend``, ``paged_ops.use_backend``). The semantics of every op are written out in
``paged_ops.reference``.
"""
from __future__ import annotations

import torch

from . import _build

_build.check()  # no build / another torch than the build's: an ImportError that says what to do
__version__ = _build.version()

from . import _C  # noqa: F401,E402  (registers the schemas and the C++ backends)

from . import reference
from .backends import OPS, available_backends, backend, selected_backend, use_backend
from .backends import _register

_register()


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store token ``t``'s K/V at slot ``slot_mapping[t]`` (negative: skip); fp8 caches quantize.

    key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size, num_kv_heads, head_size].
    """
    torch.ops.paged.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     k_scale=None, v_scale=None) -> None:
    """One query token per sequence over its ``seq_lens[s]`` cached tokens; writes ``out``.

    query, out: [num_seqs, num_heads, head_size]; block_tables: int32 [num_seqs, max_blocks];
    seq_lens: int32 [num_seqs].
    """
    torch.ops.paged.decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                     scale, k_scale, v_scale)


def prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, scale, causal=True, k_scale=None, v_scale=None) -> None:
    """Varlen paged attention (prefill, chunked prefill, decode rows), bottom-right causal.

    query, out: [total_q_tokens, num_heads, head_size]; cu_seqlens_q: int32 [num_seqs + 1];
    seq_lens: int32 [num_seqs], each including the sequence's new tokens (already cached).
    """
    torch.ops.paged.prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                      seq_lens, max_seqlen_q, scale, causal, k_scale, v_scale)


def quantize_fp8(out, input, scale) -> None:
    """``out = saturate(input / scale)`` in out's fp8 dtype, bit-identical to torch's cast."""
    torch.ops.paged.quantize_fp8(out, input, scale)


def dequantize_fp8(out, input, scale) -> None:
    """``out = input * scale`` in out's floating dtype."""
    torch.ops.paged.dequantize_fp8(out, input, scale)


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy block ``src`` to ``dst`` for every (src, dst) row of ``block_mapping``, in every layer."""
    torch.ops.paged.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src, dst, block_mapping) -> None:
    """``dst[d] = src[s]`` for every (s, d) row; src and dst may be on different devices."""
    torch.ops.paged.swap_blocks(src, dst, block_mapping)


__all__ = ["__version__", "OPS", "available_backends", "backend", "selected_backend", "use_backend", "reference",
           *OPS]

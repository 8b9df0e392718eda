"""paged-ops: paged KV-cache attention kernels as ``torch.ops.paged.*``.

Importing the package registers the ops. Call them directly (``torch.ops.paged.decode_attention``)
or through the wrappers below (the same C++ op: validation and backend choice happen there, see
``paged_ops.backend``, ``paged_ops.use_backend``). ``paged_ops.reference`` is the specification
of every op.
"""
from __future__ import annotations

import torch

from . import _build

_build.check()  # no build / another torch than the build's: an ImportError that says what to do
__version__ = _build.version()

from . import _C  # noqa: F401,E402  (registers the schemas and the C++ backends)

from . import reference
from .backends import OPS, available_backends, backend, batch_invariant, selected_backend, use_backend
from .backends import _register

_register()

if torch.cuda.is_available():
    # The CUDA kernels' tuned configs live in the extension, which reads no file: a process on a
    # GPU starts with this build's stored ones (paged_ops.tuning; never raises on a bad file).
    from . import tuning as _tuning

    _tuning.load()


def _check_mode(batch_invariant) -> None:
    # torch's argument parser turns any int into a bool before the op sees it (batch_invariant=2
    # would be True), so the wrappers check the type; torch.ops.paged.* itself cannot tell.
    if type(batch_invariant) is not bool:
        raise TypeError(f"batch_invariant must be a bool (True / False), got {type(batch_invariant).__name__}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store each token's K/V in its cache slot; specification: ``paged_ops.reference.reshape_and_cache``."""
    torch.ops.paged.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def concat_and_cache_mla(latent, rope, latent_cache, slot_mapping, scale=None) -> None:
    """Store each token's MLA latent and RoPE part in its latent-cache slot (the full text: below)."""
    torch.ops.paged.concat_and_cache_mla(latent, rope, latent_cache, slot_mapping, scale)


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     k_scale=None, v_scale=None, *, softcap=0.0, window_left=-1, sinks=None,
                     alibi_slopes=None, lse=None, batch_invariant=False, window_right=-1) -> None:
    """One query token per sequence; specification: ``paged_ops.reference.decode_attention``
    (the keyword-only variants: ``paged_ops.reference.attention``)."""
    _check_mode(batch_invariant)
    torch.ops.paged.decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                     scale, k_scale, v_scale, softcap=softcap, window_left=window_left,
                                     sinks=sinks, alibi_slopes=alibi_slopes, lse=lse,
                                     batch_invariant=batch_invariant, window_right=window_right)


def prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, scale, causal=True, k_scale=None, v_scale=None, *, softcap=0.0,
                      window_left=-1, sinks=None, alibi_slopes=None, lse=None, batch_invariant=False,
                      window_right=-1) -> None:
    """Varlen paged attention; specification: ``paged_ops.reference.prefill_attention``."""
    _check_mode(batch_invariant)
    torch.ops.paged.prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                      seq_lens, max_seqlen_q, scale, causal, k_scale, v_scale,
                                      softcap=softcap, window_left=window_left, sinks=sinks,
                                      alibi_slopes=alibi_slopes, lse=lse, batch_invariant=batch_invariant,
                                      window_right=window_right)


def merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """Attention over two disjoint key sets from attention over each (their ``out`` and ``lse``);
    specification: ``paged_ops.reference.merge_attention_states``."""
    torch.ops.paged.merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)


def merge_states(out, out_lse, states, states_lse) -> None:
    """Attention over N disjoint key sets from attention over each (split-KV, context parallelism);
    specification: ``paged_ops.reference.merge_states``."""
    torch.ops.paged.merge_states(out, out_lse, states, states_lse)


def quantize_fp8(out, input, scale) -> None:
    """Saturating cast to fp8; specification: ``paged_ops.reference.quantize_fp8``."""
    torch.ops.paged.quantize_fp8(out, input, scale)


def dequantize_fp8(out, input, scale) -> None:
    """fp8 to a float dtype; specification: ``paged_ops.reference.dequantize_fp8``."""
    torch.ops.paged.dequantize_fp8(out, input, scale)


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy-on-write of blocks in every layer; specification: ``paged_ops.reference.copy_blocks``."""
    torch.ops.paged.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src, dst, block_mapping) -> None:
    """Whole-block copies across devices; specification: ``paged_ops.reference.swap_blocks``."""
    torch.ops.paged.swap_blocks(src, dst, block_mapping)


# help(paged_ops.X) and help(torch.ops.paged.X): the op's reference text, from its specification.
from . import _docs  # noqa: E402

_docs.document({op: globals()[op] for op in OPS})

__all__ = ["__version__", "OPS", "available_backends", "backend", "batch_invariant", "selected_backend", "use_backend",
           "reference",
           *OPS]

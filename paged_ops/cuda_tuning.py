"""The ``cuda`` backend's view of the one tuner (``paged_ops.tuning``).

``tune_decode`` / ``tune_prefill`` time the candidate launch configurations on the caller's real
inputs (unless this shape is already stored for this build and GPU), install the fastest in the
extension's registry and persist it; ``maybe_tune_*`` are the same (the tuner never re-times a
stored shape). ``tuned_config_for_*`` tell what the kernels will use (None = built-in defaults).
"""
from __future__ import annotations

from . import tuning
from .tuning import CUDA_DECODE_CANDIDATES as DECODE_CANDIDATES  # noqa: F401
from .tuning import CUDA_PREFILL_CANDIDATES as PREFILL_CANDIDATES  # noqa: F401
from .tuning import load  # noqa: F401


def decode_key(query, key_cache, block_tables) -> str:
    return tuning.cuda_registry_key(query, key_cache, block_tables, None)


def prefill_key(query, key_cache, block_tables, max_seqlen_q: int) -> str:
    return tuning.cuda_registry_key(query, key_cache, block_tables, max_seqlen_q)


def tuned_config_for_decode(query, key_cache, block_tables) -> dict | None:
    return tuning.cuda_tuned_config(query, key_cache, block_tables)


def tuned_config_for_prefill(query, key_cache, block_tables, max_seqlen_q: int) -> dict | None:
    return tuning.cuda_tuned_config(query, key_cache, block_tables, max_seqlen_q)


def tune_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                reps: int = 20) -> dict:
    """Choose (timing on this GPU unless stored) and install the decode config; ``out`` is overwritten."""
    return tuning.tune_cuda_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                   k_scale, v_scale, reps=reps, force=True)


def tune_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
                 causal, k_scale=None, v_scale=None, reps: int = 10) -> dict:
    """Choose (timing on this GPU unless stored) and install the prefill config; ``out`` is overwritten."""
    return tuning.tune_cuda_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                    max_seqlen_q, scale, causal, k_scale, v_scale, reps=reps, force=True)


maybe_tune_decode = tune_decode
maybe_tune_prefill = tune_prefill

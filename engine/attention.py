"""The attention glue between a model and ``torch.ops.paged.*``: the paged KV cache object, one
step's metadata, ``paged_attention`` (every layer, every step, through the public ops), the
transformers attention-interface function, and fp8 scales (checkpoint or first prefill)."""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from .config import KV_CACHE_DTYPES

ATTN_IMPLEMENTATION = "paged_ops"  # not "paged": transformers reserves "paged|..." for its own cache


@functools.cache
def ops():
    """``torch.ops.paged``, imported on first use so the scheduler and block manager work
    without the built extension."""
    import paged_ops  # noqa: F401  (registers torch.ops.paged.*)
    return torch.ops.paged


@dataclass
class KVCache:
    """Per-layer paged caches ``[num_blocks, block_size, num_kv_heads, head_size]`` and fp8 scales."""
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor | None]   # float32 [1] or [num_kv_heads] per layer, fp8 only
    v_scales: list[torch.Tensor | None]

    @property
    def is_fp8(self) -> bool:
        return self.key_caches[0].dtype in KV_CACHE_DTYPES.values()


@dataclass
class AttentionMetadata:
    """Batch layout of one step, shared by all layers."""
    slot_mapping: torch.Tensor   # int64 [num_tokens]: block * block_size + offset
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    seq_lens: torch.Tensor       # int32 [num_seqs]: KV length after this step
    max_seqlen_q: int
    decode_only: bool            # every sequence has q_len 1: use decode_attention
    kv: KVCache


def fp8_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size] -> float32 [num_kv_heads]: each head's amax maps
    # to the fp8 max (per head, as heads' ranges differ a lot; later outliers saturate)
    amax = x.abs().amax(dim=(0, 2)).float().clamp(min=1e-6)
    return amax / torch.finfo(dtype).max


def window_left(sliding_window: int | None) -> int:
    """The ops' ``window_left`` for a transformers ``sliding_window`` (the one place the two
    conventions meet). transformers' sliding-window mask (``masking_utils.sliding_window_overlay``:
    ``kv_idx > q_idx - sliding_window``, on top of the causal mask, used by its eager and sdpa
    paths) lets a query see W keys counting itself; its flash path passes ``window_size =
    (W - 1, W - 1)``, the same keys. So W keys = the query and W - 1 before it:
    ``window_left = W - 1``; no window (None) is -1. Gemma 2, gpt-oss, Qwen2 and Mistral all use
    that mask (Gemma 2 / gpt-oss / Qwen2 on the layers whose ``layer_types`` entry is
    "sliding_attention", Mistral on every layer)."""
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return sliding_window - 1


def layer_sliding_window(hf_attention: torch.nn.Module, config) -> int | None:
    """A transformers attention module's sliding window, as its forward passes it to the attention
    function: Gemma 2, gpt-oss and Qwen2 store it per layer (``self.sliding_window``: the config's
    window on "sliding_attention" layers, else None); Mistral passes ``config.sliding_window`` on
    every layer; Llama has none."""
    if hasattr(hf_attention, "sliding_window"):
        return hf_attention.sliding_window
    return getattr(config, "sliding_window", None)


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types the ops can run


def check_layer_types(config) -> None:
    """A ValueError for a model whose ``layer_types`` name an attention the engine cannot run
    (e.g. Llama 4's "chunked_attention", built by transformers as a mask the engine never builds)."""
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if other:
        raise ValueError(f"layer_types {other} are not supported by the engine (only {LAYER_TYPES})")


def variant_kwargs(softcap: float | None = None, window: int = -1, sinks: torch.Tensor | None = None) -> dict:
    """The ops' keyword-only variant arguments that differ from their defaults (a plain model's
    call stays the plain call). softcap None or 0: none; sinks: per-head logits, float32 as the
    ops take them."""
    kw = {}
    if softcap:
        kw["softcap"] = float(softcap)
    if window >= 0:
        kw["window_left"] = window
    if sinks is not None:
        kw["sinks"] = sinks.detach().float().contiguous()
    return kw


def paged_attention(meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, **variants) -> torch.Tensor:
    """Store the step's K/V in layer's cache, attend over the cache. q: [T, num_heads, D];
    k, v: [T, num_kv_heads, D] (after RoPE) -> [T, num_heads, D]. ``variants``: the ops'
    keyword-only arguments (``variant_kwargs``: softcap, window_left, sinks). Every layer calls the
    public ops, which check their arguments and pick the backend."""
    paged, kv = ops(), meta.kv
    kc, vc = kv.key_caches[layer], kv.value_caches[layer]
    if kv.is_fp8 and kv.k_scales[layer] is None:  # no checkpoint scales: calibrate on the first prefill
        kv.k_scales[layer], kv.v_scales[layer] = fp8_scale(k, kc.dtype), fp8_scale(v, vc.dtype)
    ks, vs = kv.k_scales[layer], kv.v_scales[layer]
    paged.reshape_and_cache(k, v, kc, vc, meta.slot_mapping, ks, vs)
    out = torch.empty_like(q)
    if meta.decode_only:
        paged.decode_attention(out, q, kc, vc, meta.block_tables, meta.seq_lens, scale, ks, vs, **variants)
    else:
        paged.prefill_attention(out, q, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                meta.max_seqlen_q, scale, True, ks, vs, **variants)
    return out


# The runner passes the step's metadata to a transformers model as the keyword argument
# ``paged_metadata``, which transformers hands through to the attention function; _CURRENT is the
# fallback for models whose forward does not pass extra keyword arguments down.
_CURRENT: AttentionMetadata | None = None


@contextlib.contextmanager
def step_metadata(meta: AttentionMetadata):
    global _CURRENT
    _CURRENT = meta
    try:
        yield
    finally:
        _CURRENT = None


def paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0,
                            paged_metadata: AttentionMetadata | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention interface: query [1, num_heads, T, D], key/value
    [1, num_kv_heads, T, D] (after RoPE) -> ([1, T, num_heads, D], None). The variants come as
    the modeling code passes them to every attention function: ``sliding_window`` (Mistral, Qwen2,
    Gemma 2, gpt-oss; None on full-attention layers), ``softcap`` (Gemma 2's attention logit
    soft-cap) and ``s_aux`` (gpt-oss's per-head sink logits)."""
    meta = paged_metadata or _CURRENT
    assert meta is not None, "paged_ops attention called outside ModelRunner.run"
    if not getattr(module, "is_causal", True):  # e.g. Gemma with use_bidirectional_attention
        raise ValueError(f"{type(module).__name__}: non-causal attention is not supported by the engine")
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    if sliding_window is None and layer_types and layer_types[module.layer_idx] == "sliding_attention":
        # transformers would apply this layer's window through its mask, which the engine never builds
        raise ValueError(f"{type(module).__name__} does not pass its sliding_window to the attention function")
    to_tokens = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731  [T, heads, D]
    out = paged_attention(meta, module.layer_idx, to_tokens(query), to_tokens(key), to_tokens(value), scaling,
                          **variant_kwargs(softcap, window_left(sliding_window), s_aux))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def load_kv_scales(model_dir: str, num_layers: int) -> tuple[list, list] | None:
    """fp8 KV scales stored in the checkpoint (``layers.N.self_attn.{k,v}_scale``, or
    ``{k,v}_proj.output_scale`` as llm-compressor writes them); None unless every layer has both."""
    from safetensors import safe_open
    pattern = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
    scales = {"k": [None] * num_layers, "v": [None] * num_layers}
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if (m := pattern.search(name)) and int(m.group(1)) < num_layers:
                    scales[m.group(2) or m.group(3)][int(m.group(1))] = f.get_tensor(name).float().reshape(-1)
    if any(s is None for s in scales["k"] + scales["v"]):
        return None
    return scales["k"], scales["v"]

"""The attention glue between a model and ``torch.ops.paged.*``: the paged KV cache object and its
layout, one step's metadata, ``paged_attention`` (every layer, every step, through the public ops),
``mla_attention`` (DeepSeek's multi-head latent attention over a latent cache), the transformers
attention-interface function, and fp8 scales (checkpoint or first prefill)."""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class CacheLayout:
    """What one layer's cache holds per token: ``num_kv_heads`` keys of ``key_size`` and values of
    ``value_size``. ``value_in_key``: the values are the keys' first ``value_size`` columns (MLA's
    latent cache: one row per token, the value cache a view of the key cache), so only the key
    cache is allocated."""
    num_kv_heads: int
    key_size: int
    value_size: int
    value_in_key: bool = False

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token takes in one layer's cache(s) of dtype."""
        elements = self.num_kv_heads * (self.key_size + (0 if self.value_in_key else self.value_size))
        return elements * torch.empty((), dtype=dtype).element_size()


def is_mla(config) -> bool:
    """DeepSeek-V2/V3-style multi-head latent attention (``kv_lora_rank`` in the config)."""
    return bool(getattr(config, "kv_lora_rank", None))


def cache_layout(config, latent: bool) -> CacheLayout:
    """The cache layout of a transformers config. An MLA model (``is_mla``) run natively caches the
    compressed latent (``latent=True``): one row of ``kv_lora_rank + qk_rope_head_dim`` per token
    (576 at DeepSeek's sizes), whose first ``kv_lora_rank`` columns are the absorbed decode's values.
    Through transformers' modeling code (``latent=False``) it hands the attention function per-head
    keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim`` for every query
    head, which a per-head cache stores. Other models: ``num_key_value_heads`` x ``head_dim``."""
    if is_mla(config):
        if latent:
            return CacheLayout(1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank, True)
        return CacheLayout(config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim,
                           config.v_head_dim)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return CacheLayout(num_kv_heads, head_size, head_size)


@dataclass
class KVCache:
    """Per-layer paged caches ``[num_blocks, block_size, num_kv_heads, head_size]`` and fp8 scales.
    With a latent layout (``CacheLayout.value_in_key``) ``value_caches[i]`` is the view
    ``key_caches[i][..., :value_size]``."""
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor | None]   # float32 [1] or [num_kv_heads] per layer, fp8 only
    v_scales: list[torch.Tensor | None]
    value_in_key: bool = False

    @classmethod
    def allocate(cls, layout: CacheLayout, num_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device) -> KVCache:
        """Zeroed caches of num_blocks blocks for every layer (what ModelRunner allocates)."""
        shape = lambda size: (num_blocks, block_size, layout.num_kv_heads, size)  # noqa: E731
        keys = [torch.zeros(shape(layout.key_size), dtype=dtype, device=device) for _ in range(num_layers)]
        if layout.value_in_key:
            values = [k[..., :layout.value_size] for k in keys]
        else:
            values = [torch.zeros(shape(layout.value_size), dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values, [None] * num_layers, [None] * num_layers, layout.value_in_key)

    @property
    def is_fp8(self) -> bool:
        return self.key_caches[0].dtype in KV_CACHE_DTYPES.values()

    def storage(self) -> list[torch.Tensor]:
        """Every distinct cache tensor once (what a whole-block copy must move): the key and value
        caches, or the latent caches alone."""
        return list(self.key_caches) if self.value_in_key else self.key_caches + self.value_caches

    def disjoint_pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(key-side, value-side) lists that cover each layer's storage exactly once and do not
        overlap (``copy_blocks`` takes two such lists): a latent cache splits into its value
        columns and the rest."""
        if not self.value_in_key:
            return self.key_caches, self.value_caches
        rank = self.value_caches[0].shape[-1]
        return [k[..., :rank] for k in self.key_caches], [k[..., rank:] for k in self.key_caches]


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
    # what layers of one step share and compute once (mla_attention's context blocks)
    shared: dict = field(default_factory=dict)


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
    k: [T, num_kv_heads, D] (after RoPE), v: [T, num_kv_heads, Dv] -> [T, num_heads, Dv]. ``variants``: the ops'
    keyword-only arguments (``variant_kwargs``: softcap, window_left, sinks). Every layer calls the
    public ops, which check their arguments and pick the backend."""
    paged, kv = ops(), meta.kv
    kc, vc = kv.key_caches[layer], kv.value_caches[layer]
    if kv.is_fp8 and kv.k_scales[layer] is None:  # no checkpoint scales: calibrate on the first prefill
        kv.k_scales[layer], kv.v_scales[layer] = fp8_scale(k, kc.dtype), fp8_scale(v, vc.dtype)
    ks, vs = kv.k_scales[layer], kv.v_scales[layer]
    paged.reshape_and_cache(k, v, kc, vc, meta.slot_mapping, ks, vs)
    out = q.new_empty(*q.shape[:2], v.shape[-1])  # [T, H, Dv]: Dv may differ from D (DeepSeek via transformers)
    if meta.decode_only:
        paged.decode_attention(out, q, kc, vc, meta.block_tables, meta.seq_lens, scale, ks, vs, **variants)
    else:
        paged.prefill_attention(out, q, kc, vc, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                meta.max_seqlen_q, scale, True, ks, vs, **variants)
    return out


def mla_context_blocks(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache blocks the step's sequences read, each once (a prefix shared by several sequences
    too), and the block tables renumbered into that list: ``(block_ids int64 [nb], tables int32
    [num_seqs, max_blocks])``. Computed once per step (every layer has the same)."""
    if "mla_blocks" not in meta.shared:
        block_size = meta.kv.key_caches[0].shape[1]
        tables = meta.block_tables.long()
        num_blocks = (meta.seq_lens.long() + block_size - 1) // block_size  # [num_seqs]
        used = torch.arange(tables.shape[1], device=tables.device)[None] < num_blocks[:, None]
        block_ids, inverse = torch.unique(tables[used], return_inverse=True)
        compact = torch.zeros_like(tables)
        compact[used] = inverse
        meta.shared["mla_blocks"] = (block_ids, compact.to(torch.int32))
    return meta.shared["mla_blocks"]


def mla_attention(meta: AttentionMetadata, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                  latent: torch.Tensor, k_pe: torch.Tensor, mla) -> torch.Tensor:
    """DeepSeek's multi-head latent attention over a latent cache: store the step's latents, attend.

    q_nope: [T, H, qk_nope]; q_pe: [T, H, rope] and k_pe: [T, rope] after RoPE; latent: [T, rank]
    (after ``kv_a_layernorm``) -> [T, H, v_head]. ``mla`` (the model's attention module) holds
    ``kv_b_proj`` (latent -> per head [k_nope | v]), its weight split per head as ``w_uk``
    [H, qk_nope, rank] and ``w_uv`` [H, v_head, rank], and ``scale`` (DeepSeek's softmax scale).

    The cache ``[num_blocks, block_size, 1, rank + rope]`` holds one row per token:
    ``concat_and_cache_mla(latent, k_pe)``. An fp8 cache has one float32 scale per layer (the
    checkpoint's k_scale, as vLLM's MLA, else ``amax / fp8_max`` of the layer's first prefill over
    latent and RoPE part; later outliers saturate), the k_scale and v_scale of the decode, and the
    prefill's dequantization (float32, then the model dtype) before the up-projection.

    Decode (every row q_len 1) is the absorbed form: ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so
    each head's query moves into the latent space and attends the latent rows directly, one KV head
    for all heads: ``query = [q_nope W_UK | q_pe]`` [T, H, rank + rope] against ``key_cache`` = the
    latent cache and ``value_cache`` = its first ``rank`` columns (a view); the output [T, H, rank]
    goes through W_UV. Nothing per head is ever materialized.

    Any other step (prefill, chunked prefill, prefix hits, mixed with decode rows) is the
    non-absorbed form DeepSeek's prefill uses: per-head K = [W_UK c | k_pe] (qk_nope + rope) and
    V = W_UV c (v_head). The sequences' earlier tokens exist only as latents, so their K/V must be
    re-materialized from the cache. Choice: up-project the *blocks* the step reads
    (``mla_context_blocks``: each used block once, so a shared prefix is expanded once) into a
    scratch per-head paged cache ``[nb, block_size, H, D]`` read through the same block tables
    renumbered. It stays a plain ``prefill_attention`` call over one varlen batch (bottom-right
    causal, every sequence's own context), with no per-sequence loop, no copy of the step's own
    K/V (they are read back from the latent cache like the rest), and at most ``block_size - 1``
    unused rows per sequence up-projected (the slots past ``seq_lens``, never read). The scratch
    is freed after the layer, so peak memory is one layer's context in per-head form."""
    paged, kv = ops(), meta.kv
    cache = kv.key_caches[layer]
    rank, T, H = latent.shape[1], q_nope.shape[0], q_nope.shape[1]
    if kv.is_fp8 and kv.k_scales[layer] is None:  # no checkpoint scale: calibrate on the first prefill
        amax = torch.maximum(latent.abs().amax(), k_pe.abs().amax()).float().clamp(min=1e-6)
        kv.k_scales[layer] = kv.v_scales[layer] = (amax / torch.finfo(cache.dtype).max).reshape(1)
    fp8_scale = kv.k_scales[layer] if kv.is_fp8 else None  # float32 [1]: latent and RoPE part alike
    paged.concat_and_cache_mla(latent, k_pe, cache, meta.slot_mapping, fp8_scale)
    if meta.decode_only:
        query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, mla.w_uk), q_pe], dim=-1)  # [T, H, rank + rope]
        out = query.new_empty(T, H, rank)
        paged.decode_attention(out, query, cache, kv.value_caches[layer], meta.block_tables, meta.seq_lens,
                               mla.scale, fp8_scale, fp8_scale)
        return torch.einsum("thr,hvr->thv", out, mla.w_uv)  # [T, H, v_head]
    block_ids, tables = mla_context_blocks(meta)
    rows = cache[block_ids]  # [nb, block_size, 1, rank + rope]
    if fp8_scale is not None:
        rows = (rows.float() * fp8_scale).to(q_nope.dtype)
    nb, block_size, nope, rope = rows.shape[0], rows.shape[1], q_nope.shape[2], k_pe.shape[1]
    up = mla.kv_b_proj(rows[:, :, 0, :rank]).view(nb, block_size, H, -1)  # [nb, bs, H, nope + v_head]
    keys = torch.cat([up[..., :nope], rows[..., rank:].expand(nb, block_size, H, rope)], dim=-1)
    values = up[..., nope:]  # [nb, bs, H, v_head]: a strided view (the ops need only the last dim contiguous)
    query = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + rope]
    out = query.new_empty(T, H, values.shape[-1])
    paged.prefill_attention(out, query, keys, values, tables, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q,
                            mla.scale, True, None, None)
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

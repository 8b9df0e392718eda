"""Gemma 2 written for one flattened varlen batch per step (as ``llama.py`` is for the Llama family).

What differs from Llama, each in transformers' order (``Gemma2DecoderLayer``): the embedding is
scaled by sqrt(hidden) (transformers' embedding module does it; we reuse it), RMSNorm multiplies by
``1 + weight`` in float32 before casting back, four norms per layer (the attention and MLP outputs
are normed too, before the residual add), the attention scale is ``query_pre_attn_scalar ** -0.5``,
attention logits are soft-capped (``attn_logit_softcapping``), "sliding_attention" layers (every
other one) see a window of ``sliding_window`` keys, and the logits are soft-capped
(``final_logit_softcapping``). The variants go to the ops as runtime arguments.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..attention import layer_sliding_window, variant_kwargs, window_left
from .llama import Attention, apply_rope, fuse

ARCHITECTURES = ("Gemma2ForCausalLM",)


class GemmaRMSNorm(nn.Module):
    """Gemma2RMSNorm's math: ``(x_f32 * rsqrt(mean(x_f32^2) + eps)) * (1 + w_f32)``, cast to x's dtype
    last (Llama casts before the weight). ``1 + w`` is computed once here, the same float32 values."""

    def __init__(self, hf_norm):
        super().__init__()
        self.scale = nn.Buffer(1.0 + hf_norm.weight.detach().float())
        self.eps = hf_norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).type_as(x)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    # transformers' order: divide, tanh, multiply
    return x if not cap else torch.tanh(x / cap) * cap


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer, config):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size, self.scale = attn.head_dim, attn.scaling  # query_pre_attn_scalar ** -0.5
        self.qkv_proj, self.o_proj = fuse(attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj
        self.gate_up_proj, self.down_proj = fuse(mlp.gate_proj, mlp.up_proj), mlp.down_proj
        self.act = ACT2FN[config.hidden_activation]
        self.input_norm = GemmaRMSNorm(hf_layer.input_layernorm)
        self.post_attention_norm = GemmaRMSNorm(hf_layer.post_attention_layernorm)
        self.pre_feedforward_norm = GemmaRMSNorm(hf_layer.pre_feedforward_layernorm)
        self.post_feedforward_norm = GemmaRMSNorm(hf_layer.post_feedforward_layernorm)
        self.variants = variant_kwargs(softcap=attn.attn_logit_softcapping,
                                       window=window_left(layer_sliding_window(attn, config)))

    def forward(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        # x: [T, hidden]
        T, D = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(self.input_norm(x)).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q = apply_rope(q.view(T, self.num_heads, D), cos, sin)
        k = apply_rope(k.view(T, self.num_kv_heads, D), cos, sin)
        o = attention(layer_idx, q, k, v.view(T, self.num_kv_heads, D), self.scale, **self.variants)  # [T, H, D]
        x = x + self.post_attention_norm(self.o_proj(o.reshape(T, -1)))
        gate, up = self.gate_up_proj(self.pre_feedforward_norm(x)).chunk(2, dim=-1)
        return x + self.post_feedforward_norm(self.down_proj(self.act(gate) * up))


class Gemma2ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], attention) -> hidden [T, hidden]``; ``logits(hidden)``."""

    def __init__(self, hf_model):
        super().__init__()
        cfg, base = hf_model.config, hf_model.model
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 2 with use_bidirectional_attention is not a causal decoder")
        self.embed_tokens, self.rotary = base.embed_tokens, base.rotary_emb  # embed_tokens scales by sqrt(hidden)
        self.layers = nn.ModuleList(DecoderLayer(layer, cfg) for layer in base.layers)
        self.norm = GemmaRMSNorm(base.norm)
        self.lm_head = hf_model.lm_head
        self.final_logit_softcapping = cfg.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(x, positions[None])  # [1, T, D] each, in x's dtype
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.final_logit_softcapping)

"""The Llama family (Llama, Mistral, Qwen2) written for one flattened varlen batch per step.

Same math as transformers' modeling code, in the order it does it (so greedy outputs stay
token-for-token equal to ``generate``), minus what a serving step does not need: q/k/v are one
matmul, gate/up are one matmul, there are no masks, no cache objects and no [batch, seq] axes.
On the benchmark model transformers' per-module Python is a large share of a decode step, which
is why the engine prefers this path for these architectures (engine/README.md).

Weights come from the transformers model loaded from the checkpoint (the constructor takes it): its loader
already handles sharding, tied embeddings and dtypes, and its rotary module every RoPE scaling
variant, so nothing here parses checkpoint files or re-implements RoPE scaling.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..attention import layer_sliding_window, variant_kwargs, window_left

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# attention(layer_idx, q [T, H, D], k [T, KVH, D], v [T, KVH, D], scale, **variants) -> [T, H, D],
# variants being the ops' keyword-only arguments (attention.variant_kwargs)
Attention = Callable[..., torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # in float32, then back to the model dtype before the weight, as LlamaRMSNorm does
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D]
    return x * cos + rotate_half(x) * sin


def fuse(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs concatenated."""
    w = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.data.copy_(w)
    if has_bias:
        fused.bias.data.copy_(torch.cat([lin.bias.detach() for lin in linears]))
    return fused


class DecoderLayer(nn.Module):
    # The norm and RoPE of the family; gpt_oss.py's layer swaps in its own and keeps the rest.
    rms_norm = staticmethod(rms_norm)
    apply_rope = staticmethod(apply_rope)

    def __init__(self, hf_layer, config):
        super().__init__()
        mlp = hf_layer.mlp
        self.init_attention(hf_layer, config)
        self.gate_up_proj, self.down_proj = fuse(mlp.gate_proj, mlp.up_proj), mlp.down_proj
        self.act = ACT2FN[config.hidden_act]

    def init_attention(self, hf_layer, config, **variants) -> None:
        """The pre-norm self-attention half: fused q/k/v, o_proj, the two norms' weights and the
        layer's variants (its window, plus what the caller adds, e.g. gpt-oss's sinks)."""
        attn = hf_layer.self_attn
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size, self.scale = attn.head_dim, attn.scaling
        self.qkv_proj, self.o_proj = fuse(attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj
        self.input_norm = hf_layer.input_layernorm.weight
        self.post_attention_norm = hf_layer.post_attention_layernorm.weight
        self.eps = config.rms_norm_eps
        # Mistral: a window on every layer; Qwen2 / gpt-oss: on the layers layer_types make sliding
        self.variants = variant_kwargs(window=window_left(layer_sliding_window(attn, config)), **variants)

    def attend(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attention: Attention) -> torch.Tensor:
        """x + self-attention of norm(x); x: [T, hidden]."""
        T, D = x.shape[0], self.head_size
        q, k, v = self.qkv_proj(self.rms_norm(x, self.input_norm, self.eps)).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q = self.apply_rope(q.view(T, self.num_heads, D), cos, sin)
        k = self.apply_rope(k.view(T, self.num_kv_heads, D), cos, sin)
        o = attention(layer_idx, q, k, v.view(T, self.num_kv_heads, D), self.scale, **self.variants)  # [T, H, D]
        return x + self.o_proj(o.reshape(T, -1))

    def forward(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        # x: [T, hidden]
        x = self.attend(layer_idx, x, cos, sin, attention)
        gate, up = self.gate_up_proj(rms_norm(x, self.post_attention_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down_proj(self.act(gate) * up)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], attention) -> hidden [T, hidden]``; ``logits(hidden)``."""

    def __init__(self, hf_model):  # one of ARCHITECTURES (the runner checks)
        super().__init__()
        cfg, base = hf_model.config, hf_model.model
        self.embed_tokens, self.rotary = base.embed_tokens, base.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, cfg) for layer in base.layers)
        self.norm, self.eps = base.norm.weight, cfg.rms_norm_eps
        self.lm_head = hf_model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(x, positions[None])  # [1, T, D] each, in x's dtype
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return rms_norm(x, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

"""gpt-oss written for one flattened varlen batch per step (as ``llama.py`` is for the Llama family).

The attention is native: q/k/v one matmul (with biases), RoPE on the two halves of each head,
per-head sink logits (``self_attn.sinks``) and a window of ``sliding_window`` keys on the
"sliding_attention" layers (every other one), both passed to the ops as runtime arguments. The
mixture-of-experts MLP is transformers' own module (router + experts), called on the flat
``[T, hidden]`` batch: re-implementing its routing would only duplicate it, and its cost does not
depend on how the batch is laid out.
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import Attention
from .llama import DecoderLayer as LlamaDecoderLayer

ARCHITECTURES = ("GptOssForCausalLM",)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # GptOssRMSNorm: the weight multiplies the float32 normalized x, then the cast (Llama casts first)
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D / 2] (gpt-oss's rotary returns half-width tables)
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class DecoderLayer(LlamaDecoderLayer):
    """Llama's attention half with gpt-oss's norm, half-width RoPE and sinks; MoE MLP."""
    rms_norm = staticmethod(rms_norm)
    apply_rope = staticmethod(apply_rope)

    def __init__(self, hf_layer, config):
        nn.Module.__init__(self)
        self.init_attention(hf_layer, config, sinks=hf_layer.self_attn.sinks)
        self.mlp = hf_layer.mlp  # router + experts: [1, T, hidden] -> ([1, T, hidden], router scores)

    def forward(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        # x: [T, hidden]
        x = self.attend(layer_idx, x, cos, sin, attention)
        h, _ = self.mlp(rms_norm(x, self.post_attention_norm, self.eps)[None])
        return x + h[0]


class GptOssForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], attention) -> hidden [T, hidden]``; ``logits(hidden)``."""

    def __init__(self, hf_model):
        super().__init__()
        cfg, base = hf_model.config, hf_model.model
        self.embed_tokens, self.rotary = base.embed_tokens, base.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, cfg) for layer in base.layers)
        self.norm, self.eps = base.norm.weight, cfg.rms_norm_eps
        self.lm_head = hf_model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(x, positions[None])  # [1, T, D / 2] each, in x's dtype
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D / 2]
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return rms_norm(x, self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

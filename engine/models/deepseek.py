"""DeepSeek-V2 / V3 (multi-head latent attention) written for one flattened varlen batch per step.

MLA compresses each token's keys and values into one latent: ``kv_a_proj_with_mqa`` gives
``[c | k_pe]`` (``kv_lora_rank`` + ``qk_rope_head_dim``, 512 + 64 at DeepSeek's sizes), ``c`` is
normed (``kv_a_layernorm``) and ``k_pe`` rotated (one RoPE key shared by every head); per head,
``kv_b_proj`` expands ``c`` into ``[k_nope | v]``. The engine caches only ``[c | k_pe]``
(``attention.cache_layout``: one 576-wide row per token and layer) and ``attention.mla_attention``
attends over it: absorbed decode, non-absorbed prefill (its docstring says how and why).

Everything else is transformers' own: the query path (``q_proj``, or ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``), the norms, the rotary module and its RoPE functions (V2's
complex rotation, V3's interleaved or half-split one), the softmax scale (``self_attn.scaling``:
``qk_head_dim ** -0.5`` times yarn's mscale squared when ``rope_parameters`` asks for it) and the
MLPs: dense on the first ``first_k_dense_replace`` layers, routed experts plus shared experts on
the others (the MoE modules, called on the flat ``[T, hidden]`` batch, as gpt_oss.py does).
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention import mla_attention

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

# mla(layer_idx, q_nope, q_pe, latent, k_pe, module) -> [T, H, v_head]: attention.mla_attention
# with the step's metadata bound. transformers' DeepSeek modules are imported when a model is
# built: the engine's other models keep working with a transformers that has no DeepSeek.


def rope_v2(q_pe, k_pe, freqs_cis):
    # q_pe [T, H, r], k_pe [T, 1, r]; freqs_cis complex [1, T, r / 2]. transformers' function wants
    # [batch, heads, seq, r]: rotation of adjacent pairs in float32, output interleaved as the input
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    q, k = v2.apply_rotary_emb(q_pe.transpose(0, 1)[None], k_pe.transpose(0, 1)[None], freqs_cis)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def rope_v3(interleave: bool):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    apply = v3.apply_rotary_pos_emb_interleave if interleave else v3.apply_rotary_pos_emb

    def rope(q_pe, k_pe, cos_sin):
        # q_pe [T, H, r], k_pe [T, 1, r]; cos, sin [1, T, r] -> [T, 1, r] by unsqueeze_dim=1
        cos, sin = cos_sin
        return apply(q_pe, k_pe, cos[0], sin[0], unsqueeze_dim=1)
    return rope


class MLAttention(nn.Module):
    """One layer's MLA: the projections, and kv_b_proj's weight split per head for the absorbed
    decode (``w_uk`` [H, qk_nope, rank], ``w_uv`` [H, v_head, rank])."""

    def __init__(self, attn, config, rope):
        super().__init__()
        self.num_heads, self.rank = config.num_attention_heads, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_head = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_proj, self.q_a_proj, self.q_a_layernorm, self.q_b_proj = (
            attn.q_proj, attn.q_a_proj, attn.q_a_layernorm, attn.q_b_proj)  # q_proj None when q_lora_rank is set
        self.kv_a_proj, self.kv_a_layernorm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
        self.kv_b_proj = attn.kv_b_proj
        self.o_proj, self.scale, self.rope = attn.o_proj, attn.scaling, rope
        w = attn.kv_b_proj.weight.detach().view(self.num_heads, self.nope + self.v_head, self.rank)
        self.w_uk = nn.Buffer(w[:, :self.nope].contiguous())
        self.w_uv = nn.Buffer(w[:, self.nope:].contiguous())

    def forward(self, layer_idx: int, x: torch.Tensor, pos, mla) -> torch.Tensor:
        # x: [T, hidden] (normed) -> [T, hidden]
        T = x.shape[0]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj(x).split([self.rank, self.rope_dim], dim=-1)  # [T, rank], [T, rope]
        q_pe, k_pe = self.rope(q_pe, k_pe[:, None], pos)  # [T, H, rope], [T, 1, rope]
        o = mla(layer_idx, q_nope, q_pe.contiguous(), self.kv_a_layernorm(latent), k_pe[:, 0].contiguous(), self)
        return self.o_proj(o.reshape(T, -1))  # o: [T, H, v_head]


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer, config, rope):
        super().__init__()
        self.self_attn = MLAttention(hf_layer.self_attn, config, rope)
        self.mlp = hf_layer.mlp  # dense MLP, or MoE (router, routed experts, shared experts): [T, hidden] in and out
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm

    def forward(self, layer_idx: int, x: torch.Tensor, pos, mla) -> torch.Tensor:
        x = x + self.self_attn(layer_idx, self.input_layernorm(x), pos, mla)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], mla) -> hidden [T, hidden]``; ``logits(hidden)``.
    ``attention_op``: the runner binds the step's metadata to it and passes it as ``mla``."""
    attention_op = staticmethod(mla_attention)

    def __init__(self, hf_model):
        super().__init__()
        cfg, base = hf_model.config, hf_model.model
        rope = rope_v2 if cfg.model_type == "deepseek_v2" else rope_v3(cfg.rope_interleave)
        self.embed_tokens, self.rotary = base.embed_tokens, base.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, cfg, rope) for layer in base.layers[:cfg.num_hidden_layers])
        self.norm, self.lm_head = base.norm, hf_model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mla) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        pos = self.rotary(x, positions[None])  # V3: (cos, sin) [1, T, rope]; V2: complex [1, T, rope / 2]
        for i, layer in enumerate(self.layers):
            x = layer(i, x, pos, mla)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

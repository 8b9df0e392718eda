"""Tiny random Llama / Qwen2 / Mistral checkpoints written with save_pretrained (no hub access).

Sizes: 2 layers, hidden 128, 4 query / 2 KV heads of head size 32 (GQA), vocab 512. The weights
are drawn with initializer_range 0.2 (not transformers' 0.02) so the next-token logits are spread
out: with near-uniform logits the greedy choice would hinge on differences at float32 rounding
level, and equal tokens would test the tie-breaking, not the attention.
"""
from __future__ import annotations

import os

import torch

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, initializer_range=0.2,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make(kind: str, path: str, seed: int = 0) -> str:
    import transformers
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[kind]
    extra = {"sliding_window": None} if kind in ("qwen2", "mistral") else {}
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**COMMON, **extra), dtype=torch.float32)
    model.save_pretrained(path)
    return path

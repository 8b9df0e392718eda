"""Tiny random Llama / Qwen2 / Mistral / Gemma 2 / gpt-oss checkpoints written with save_pretrained
(no hub access), and a tiny byte-level BPE tokenizer for runs that take text prompts.

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


# The attention variants (#13): windows shorter than the test prompts (up to ~300 tokens) and not a
# multiple of the block size, so the window starts mid-block and vLLM frees blocks behind it.
WINDOW = 40
VARIANT_KINDS = {
    # Mistral with every layer windowed.
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    # Gemma 2: soft-capped logits (a cap low enough to bind at these weights) and alternating
    # windowed / global layers; query_pre_attn_scalar = head_dim keeps the usual 1/sqrt(d) scale.
    # vLLM's Gemma 2 always ties the embeddings (it refuses an lm_head).
    "gemma2": ("gemma2", dict(head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                              final_logit_softcapping=30.0, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"], bos_token_id=1,
                              eos_token_id=2, tie_word_embeddings=True)),
    # gpt-oss: a sink per head, alternating windowed / global layers, a tiny mixture of experts.
    "gpt-oss": ("gpt_oss", dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"])),
    # BLOOM: ALiBi (vLLM passes the slopes as a list); no GQA, so 4 query and 4 KV heads; vLLM
    # ties its embeddings.
    "bloom": ("bloom", dict(n_layer=2, n_head=4, num_key_value_heads=4, num_attention_heads=4,
                            tie_word_embeddings=True)),
}


def make(kind: str, path: str, seed: int = 0) -> str:
    import transformers
    base, variant = VARIANT_KINDS.get(kind, (kind, {}))
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
               "gpt_oss": transformers.GptOssConfig, "bloom": transformers.BloomConfig}[base]
    extra = {"sliding_window": None} if base in ("qwen2", "mistral") else {}
    extra |= variant
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**(COMMON | extra)), dtype=torch.float32)
    if base == "gemma2":
        # Gemma scales embeddings by sqrt(hidden_size) and normalizes each layer's output to unit
        # RMS, so with tied embeddings and these weights the residual stream is mostly the input
        # token's own embedding and greedy decoding repeats one token; smaller embeddings and
        # layer outputs of RMS 3 (Gemma's norm scales by 1 + weight) let the layers, and so the
        # attention, decide the next token.
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.25)
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.fill_(2.0)
                layer.post_feedforward_layernorm.weight.fill_(2.0)
    if base == "gpt_oss":
        # transformers initialises the sinks to zero; spread them so they change the softmax.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


# Text for the tokenizer's merges: any text does, the model's weights are random.
_CORPUS = ["The capital of France is Paris.", "Hello, my name is", "paged attention reads the KV cache block by block",
           "vLLM runs the model; paged_ops computes its attention.", "one two three four five six seven eight nine ten"]


def make_tokenizer(path: str) -> str:
    """Write a byte-level BPE tokenizer (ids < COMMON's vocab_size; pad 0, bos 1, eos 2, as COMMON)
    into the model directory path, so vLLM can take text prompts there. Idempotent."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=COMMON["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 10, trainer)
    assert tok.get_vocab_size() <= COMMON["vocab_size"] and tok.token_to_id("</s>") == 2
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


# MLA (#24 item 5): tiny DeepSeek-V2 / V3 whose latent row is DeepSeek's own, kv_lora_rank 512 +
# RoPE 64 = 576 (vLLM's CPU_MLA backend takes no other width), with small heads around it (4
# heads, qk_nope 32, v_head 32). V2: no query LoRA, dense MLPs; V3: query LoRA, a mixture of
# experts on layer 1 (sigmoid routing, a shared expert), interleaved RoPE, YaRN scaling (mscale
# moves the softmax scale).
MLA_COMMON = dict(COMMON, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                  v_head_dim=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
MLA_KINDS = {
    "deepseek_v2": ("DeepseekV2Config", dict(q_lora_rank=None, first_k_dense_replace=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=32, first_k_dense_replace=1, n_group=2, topk_group=1,
                                             topk_method="noaux_tc",  # vLLM then loads e_score_correction_bias
                                             n_shared_experts=1, num_mtp_layers=0, rope_interleave=True,
                                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                                  mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
                                                                  beta_slow=1.0, original_max_position_embeddings=256))),
}


def make_mla(kind: str, path: str, seed: int = 0) -> str:
    """A tiny random DeepSeek checkpoint (MLA_KINDS) saved with save_pretrained. Idempotent."""
    import transformers
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg_name, extra = MLA_KINDS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**(MLA_COMMON | extra))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return path

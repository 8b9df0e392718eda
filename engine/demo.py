"""Tiny random checkpoints (for ``python -m engine demo`` and the tests), saved with
transformers' save_pretrained so they load like any local HF checkpoint."""
from __future__ import annotations

import torch
import transformers  # DeepSeek's configs looked up when asked for: older transformers have none
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
            # large init: logits far apart, so greedy argmax is robust to float rounding
            initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY, use_sliding_window=False),  # q/k/v bias
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    # sliding windows of 8 keys: the tests' prompts are longer than that
    "mistral_sw": lambda: MistralConfig(**TINY, sliding_window=8),
    # max_window_layers=1: layer 0 full, layer 1 "sliding_attention"
    "qwen2_sw": lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # layer 0 "sliding_attention", layer 1 full; soft-caps low enough that the random logits reach
    # them; query_pre_attn_scalar apart from head_dim so a wrong attention scale shows
    "gemma2": lambda: Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # sinks + window 8 on layer 0; 4 experts, 2 per token
    "gpt_oss": lambda: GptOssConfig(**TINY, head_dim=16, sliding_window=8, num_local_experts=4,
                                    num_experts_per_tok=2,
                                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                         original_max_position_embeddings=16)),
    # MLA: latent 32 + RoPE 16 (absorbed decode: keys 48, values 32), per-head keys 16 + 16 and
    # values 24 (prefill); LoRA queries; layer 0 dense, layer 1 MoE (4 routed experts in 2 groups,
    # 2 per token, 1 shared); yarn RoPE with mscale_all_dim, so the softmax scale is not
    # qk_head_dim ** -0.5; interleaved RoPE; biases on the attention projections
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **TINY | dict(num_key_value_heads=4), q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1, attention_bias=True,
        num_mtp_layers=0, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                             beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=128)),
    # DeepSeek-V2(-Lite) style: no query LoRA, values 16 next to keys 32, V2's complex RoPE, softmax
    # routing (greedy top-2 of 4, 2 shared experts) on layer 1, mscale != mscale_all_dim
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **TINY | dict(num_key_value_heads=4), q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        topk_method="greedy", moe_intermediate_size=32, n_shared_experts=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=1.0,
                             beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=128)),
}


def randomize_biases_and_norms(model: torch.nn.Module) -> torch.nn.Module:
    """transformers initializes biases to 0 and norm weights to 1, which would let a model
    implementation that drops a bias or a norm weight pass an equality test: make them random."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def save_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, with_tokenizer: bool = False) -> str:
    """A 2-layer, hidden-64, 4/2-head (GQA), vocab-128 random model saved at path; returns path."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    randomize_biases_and_norms(model).save_pretrained(path)
    if with_tokenizer:
        save_char_tokenizer(path)
    return str(path)


def save_char_tokenizer(path) -> None:
    """A character-level tokenizer: printable ASCII -> ids 0..94, <unk> = 95."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"<unk>": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a token
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)

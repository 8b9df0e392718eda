"""Tiny random checkpoints for the engine tests (and ``python -m engine demo``), saved with
transformers' save_pretrained, and the transformers-generate oracle."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
            # large init: logits far apart, so greedy argmax is robust to float rounding
            initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY, use_sliding_window=False),  # q/k/v bias
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
}


def save_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, with_tokenizer: bool = False) -> str:
    """A 2-layer, hidden-64, 4/2-head (GQA) random model saved at path; returns path."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    model.save_pretrained(path)
    if with_tokenizer:
        save_char_tokenizer(path)
    return str(path)


def save_char_tokenizer(path) -> None:
    """A character-level tokenizer over printable ASCII (ids 0..95 of the 128-token vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab["<unk>"] = 95
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    from tokenizers import decoders
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (the oracle)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs

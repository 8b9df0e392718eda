"""The transformers oracles of the engine tests: greedy generate, logprobs, fp8-rounded K/V.
The checkpoints they run on are tests/conftest.py's ckpt fixture (engine.demo.save_tiny_checkpoint)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def _greedy_each(model, prompts: list[list[int]], max_tokens: int, new_cache=None) -> list[list[int]]:
    """Greedy generate one prompt at a time, exactly max_tokens new tokens (no EOS stop).
    new_cache: makes each prompt's transformers cache (default: generate's own)."""
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            cache = {} if new_cache is None else {"cache": new_cache()}
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, **cache)
            outs.append(gen[0, len(p):].tolist())
    return outs


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (the oracle)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return _greedy_each(model, prompts, max_tokens)


def hf_greedy_fake_fp8(model_dir: str, prompts: list[list[int]], max_tokens: int, fp8_dtype: torch.dtype,
                       k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
                       dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy generate of hf_fake_fp8_model: the oracle of an fp8 KV cache's tokens."""
    return _greedy_each(hf_fake_fp8_model(model_dir, fp8_dtype, k_scales, v_scales, dtype), prompts, max_tokens)


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation).eval()


def hf_fake_fp8_model(model_dir: str, fp8_dtype: torch.dtype, k_scales: list[torch.Tensor],
                      v_scales: list[torch.Tensor], dtype: torch.dtype = torch.float32):
    """transformers' eager attention on K/V rounded through fp8 with the engine's scales
    (saturating cast, as the contract specifies): the oracle for an fp8 KV cache."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward
    from paged_ops.reference import saturating_fp8_cast

    def fake_quant(x, scale):  # x: [batch, num_kv_heads, seq, head_size]; scale: [1] or [num_kv_heads]
        s = scale.float().reshape(-1).expand(x.shape[1]).reshape(1, -1, 1, 1)
        return (saturating_fp8_cast(x, s, fp8_dtype).float() * s).to(x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        i = module.layer_idx
        return eager_attention_forward(module, query, fake_quant(key, k_scales[i]),
                                       fake_quant(value, v_scales[i]), *args, **kwargs)

    AttentionInterface.register("fake_fp8", attention)
    AttentionMaskInterface.register("fake_fp8", eager_mask)
    return hf_model(model_dir, dtype, "fake_fp8")


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of transformers' logits at every position of token_ids: row i is the
    distribution of token i + 1. [len(token_ids), vocab]"""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)

"""Logprobs as the end-to-end numeric check (#15 item 1): the engine's prompt and sample
logprobs equal the log-softmax of transformers' logits on the same tokens, under every
scheduling regime, to a per-dtype tolerance. Greedy token equality hides drift until a token
flips; logprobs show it at once.

Tolerances (absolute, on natural-log probabilities):
- float32: 1e-4. Same weights and math as transformers; only the attention kernel's summation
  order (paged, split KV, online softmax) differs, which moves fp32 logits by ~1e-6 relative.
- bfloat16: 0.25, against transformers' own bf16 model. Both round activations to 8 mantissa
  bits (relative 2^-9), at different points (fused q/k/v, fp32 accumulation in the kernel then
  one rounding); on this tiny model's large logits transformers' bf16 logprobs differ from its
  fp32 ones by up to ~0.5 on these tokens, the engine's from transformers' bf16 by ~0.2.
- fp8 KV: compared with transformers on K/V rounded through fp8 with the engine's scales, so the
  rounding is the same on both sides: float32's tolerance.
"""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_oracles import hf_fake_fp8_model, hf_logprobs, hf_model

TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}
PROMPTS = [[5, 9], [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 37)), list(range(40, 74)) + [1, 2, 3],
           list(range(40, 74)) + [7, 7]]
K = 3


def params(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": K,
                             "prompt_logprobs": K, **kw})


def check(outs, ref_model, tol, prompt_logprobs=True, same_top=True):
    """Every logprob the engine reported equals transformers' log-softmax at that position; with
    same_top, the top-K tokens and ranks are transformers' too (bf16's near-ties may swap)."""
    worst = 0.0
    for o in outs:
        assert o.error is None
        for c in o.outputs:
            ids = o.prompt_token_ids + c.token_ids
            ref = hf_logprobs(ref_model, ids)            # row i: distribution of token i + 1
            positions = list(enumerate(c.logprobs, start=len(o.prompt_token_ids)))
            if prompt_logprobs:
                assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
                positions += list(enumerate(o.prompt_logprobs))[1:]
            cumulative = 0.0
            for pos, entries in positions:
                row = ref[pos - 1]
                assert ids[pos] in entries and len(entries) in (K, K + 1)
                top = row.topk(K).indices.tolist()
                assert set(top) <= set(entries) or not same_top, (pos, top, entries)
                for t, lp in entries.items():
                    worst = max(worst, abs(lp.logprob - float(row[t])))
                    assert not same_top or lp.rank == int((row > row[t]).sum()) + 1 or abs(lp.logprob - float(row[t])) < tol
                if pos >= len(o.prompt_token_ids):
                    cumulative += entries[ids[pos]].logprob
            assert c.cumulative_logprob == pytest.approx(cumulative, abs=1e-6)
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("arch, block_size", [("llama", 1), ("llama", 16), ("qwen2", 16), ("mistral", 1)])
def test_logprobs_match_transformers(ckpt, arch, block_size, model_impl):
    llm = LLM(ckpt(arch), block_size=block_size, num_kv_blocks=1024 // block_size, model_impl=model_impl)
    check(llm.generate(PROMPTS, params()), hf_model(ckpt(arch)), TOL[torch.float32])


@pytest.mark.parametrize("regime", ["chunked_prefill", "prefix_cache_hits", "recompute", "swap"])
def test_logprobs_under_scheduling_regimes(ckpt, regime):
    kw = {"chunked_prefill": dict(max_num_batched_tokens=5),
          "prefix_cache_hits": dict(max_num_seqs=1),
          "recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
          "swap": dict(num_kv_blocks=12, preemption_mode="swap", num_cpu_blocks=64)}[regime]
    llm = LLM(ckpt("llama"), block_size=4, **{"num_kv_blocks": 64, **kw})
    ref = hf_model(ckpt("llama"))
    if regime == "prefix_cache_hits":
        # prompt logprobs need every prompt position computed, so only sample logprobs can hit
        llm.generate(PROMPTS, params(prompt_logprobs=None))
        outs = llm.generate(PROMPTS, params(prompt_logprobs=None))
        assert llm.last_stats.prefix_cache_hit_rate > 0.5
        check(outs, ref, TOL[torch.float32], prompt_logprobs=False)
        return
    # 12 blocks of 4: the longest request (45 tokens with 8 outputs) alone barely fits
    check(llm.generate(PROMPTS, params(max_tokens=8)), ref, TOL[torch.float32])
    if regime in ("recompute", "swap"):
        assert llm.last_stats.preemptions[regime] > 0
    if regime == "chunked_prefill":
        assert llm.last_stats.num_steps > 80 // 5


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_logprobs_fp8_kv_cache(ckpt, kv_cache_dtype):
    llm = LLM(ckpt("llama"), block_size=16, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(PROMPTS, params())
    kv = llm.runner.kv
    ref = hf_fake_fp8_model(ckpt("llama"), kv.key_caches[0].dtype, kv.k_scales, kv.v_scales)
    check(outs, ref, TOL[torch.float32])


def test_logprobs_bfloat16(ckpt):
    llm = LLM(ckpt("llama"), dtype="bfloat16", block_size=16, num_kv_blocks=64)
    outs = llm.generate(PROMPTS, params())
    # the tolerance is bf16's; the engine's logprobs of a bf16 model are float32 of its float32 logits
    check(outs, hf_model(ckpt("llama"), torch.bfloat16), TOL[torch.bfloat16], same_top=False)


def test_logprobs_options(ckpt):
    """vLLM's shapes: logprobs=0 gives only the chosen token; -1 the whole vocabulary; sampled
    (not greedy) tokens report their own rank; no logprobs -> None everywhere."""
    llm = LLM(ckpt("llama"), block_size=16, num_kv_blocks=64)
    o = llm.generate([PROMPTS[1]], params(logprobs=0, prompt_logprobs=None))[0]
    assert o.prompt_logprobs is None
    assert all(list(e) == [t] for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids))
    o = llm.generate([PROMPTS[1]], params(logprobs=-1, prompt_logprobs=-1, max_tokens=2))[0]
    assert all(len(e) == 128 for e in o.outputs[0].logprobs + o.prompt_logprobs[1:])
    o = llm.generate([PROMPTS[1]], params(temperature=1.0, seed=3))[0]
    check([o], hf_model(ckpt("llama")), TOL[torch.float32])
    o = llm.generate([PROMPTS[2]], params(n=3, temperature=1.0, seed=5))[0]  # forked samples: their own logprobs
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1
    check([o], hf_model(ckpt("llama")), TOL[torch.float32])
    o = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))[0]
    assert o.prompt_logprobs is None and o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None

"""Run vLLM in a process of its own (so VLLM_PLUGINS decides which attention backend vLLM
registers) and print its greedy outputs as one JSON line.

    python -m tests_vllm.run_llm '[{"model": DIR, "prompts": [[ids...], ...], "max_tokens": N, ...}, ...]'

Each run: model, prompts (token id lists), max_tokens, rounds (generate the prompts this many
times; later rounds hit the prefix cache), logprobs (top-k per output token), dtype, and LLM
keyword arguments under "llm". The runs share the process (vLLM is imported once). Output line:
``RESULT {"backend": class path registered for CPU_ATTN, "backends": {CPU_ATTN, CPU_MLA, AMX_MLA: class
path}, "runs": [[round: [{"tokens", "logprobs",
"cached"}, ...]], ...]}``.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    # A fixed KV budget: by default vLLM's CPU worker reserves a share of all host memory, which
    # fails on a shared machine. Eager mode: compilation would cost minutes per start on 2 cores
    # and changes neither backend's attention.
    kwargs = dict(kv_cache_memory_bytes=128 << 20, enforce_eager=True, max_model_len=1024) | spec.get("llm", {})
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"), detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    rounds, seconds = [], []
    for _ in range(spec.get("rounds", 1)):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        rounds.append([{
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])],
            "cached": o.num_cached_tokens or 0,
        } for o in outs])
    del llm
    gc.collect()
    return {"rounds": rounds, "seconds": seconds}


def main(specs: list[dict]) -> dict:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    runs = [run(s) for s in specs]
    # Plugins are loaded when the engine starts; the override is visible only afterwards.
    return {"backend": AttentionBackendEnum.CPU_ATTN.get_path(), "plugins": os.environ.get("VLLM_PLUGINS"),
            "backends": {m.name: m.get_path() for m in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CPU_MLA,
                                                       AttentionBackendEnum.AMX_MLA)},
            "runs": runs}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)

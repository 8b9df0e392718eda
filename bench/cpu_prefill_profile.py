"""CPU prefill on each ISA build (issue #14 item 2): causal bf16 prefill, head 128, 32/8 heads,
block 16, the two shapes of bench/vllm_kernels.py (2 x 512, 1 x 2048), TFLOP/s per ISA and the
error against the float64 reference on the last rows of sequence 0.

  .venv/bin/python -m bench.cpu_prefill_profile [--threads 2] [--isas avx512,avx512_bf16] [--repeat 5]
      [--caches bf16,e4m3fn,e5m2]

--isas: default every supported ISA but amx_emulated (a software model, ~20x slower).

--caches: the KV cache dtypes (the query stays bf16; fp8 caches with a per-tensor scale, which
the avx512_bf16 build widens to bf16 for its dot products).

TFLOP/s counts 4 * heads * head_size flops per attended (query, key) pair (QK and PV), causal,
as bench/kernels.py does. Best of --repeat calls (a shared machine's load only slows a call);
"per CPU s" divides by the process's CPU time instead of wall time, which a loaded machine's
time slicing moves less (with --threads 1 it is the kernel's own single-core rate).
"""
from __future__ import annotations

import argparse
import time

import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from paged_ops import reference
from paged_ops.testing import make_case, rel_err

ops = torch.ops.paged_cpu
SHAPES = ((2, 512), (1, 2048))


def flops(num_seqs: int, context: int, heads: int, head_size: int) -> float:
    pairs = num_seqs * context * (context + 1) / 2
    return 4.0 * heads * head_size * pairs


CACHES = {"bf16": None, "e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def run(isa: str, num_seqs: int, context: int, repeat: int, heads=32, kv_heads=8, head_size=128, cache="bf16"):
    """(TFLOP/s by wall time, TFLOP/s per CPU second of the process, rel err)."""
    c = make_case([context] * num_seqs, [context] * num_seqs, num_heads=heads, num_kv_heads=kv_heads,
                  head_size=head_size, block_size=16, dtype=torch.bfloat16, cache_dtype=CACHES[cache],
                  poison_unused=False, seed=1)
    out = torch.empty_like(c.query)
    args = (out, c.query, c.key_cache, c.value_cache, c.block_tables, c.cu_seqlens_q, c.seq_lens,
            context, c.scale, True, c.k_scale, c.v_scale)
    previous = ops.set_isa(isa)
    try:
        ops.prefill_attention(*args)  # warm-up (page faults, OpenMP threads)
        best, best_cpu = float("inf"), float("inf")
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            ops.prefill_attention(*args)
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
    finally:
        ops.set_isa(previous)
    # The last 64 rows of sequence 0 against the float64 reference (the whole context as keys).
    rows = slice(context - 64, context)
    q0 = c.query[rows]
    ref = torch.empty(64, heads, head_size, dtype=torch.float64)
    reference.prefill_attention(ref, q0.double(), c.key_cache.double(), c.value_cache.double(),
                                c.block_tables[:1], torch.tensor([0, 64], dtype=torch.int32),
                                c.seq_lens[:1], 64, c.scale, True, c.k_scale, c.v_scale)
    err = rel_err(out[rows], ref)
    f = flops(num_seqs, context, heads, head_size)
    return f / best / 1e12, f / best_cpu / 1e12, err


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    # amx_emulated runs the AMX kernels through a software model of the tiles (a test build):
    # its speed means nothing, so it is left out unless named.
    ap.add_argument("--isas", default=",".join(i for i in ops.supported_isas() if i != "amx_emulated"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--caches", default="bf16", help=f"comma-separated, of {','.join(CACHES)}")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"threads {a.threads}; causal bf16 prefill, 32/8 heads, head 128, block 16")
    print(f"{'isa':<12} {'cache':<7} {'shape':<10} {'TFLOP/s':>8} {'per CPU s':>9} {'rel err':>9}")
    for isa in a.isas.split(","):
        for cache in a.caches.split(","):
            for s, n in SHAPES:
                tf, tf_cpu, err = run(isa, s, n, a.repeat, cache=cache)
                print(f"{isa:<12} {cache:<7} {f'{s} x {n}':<10} {tf:8.3f} {tf_cpu:9.3f} {err:9.2e}")


if __name__ == "__main__":
    main()

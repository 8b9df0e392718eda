"""CPU decode on each ISA build (issue #14 items 2 and 3, decode rows): bf16, 16 sequences x
2048 tokens, block 16, head 128, 8 KV heads with 8 / 32 / 64 query heads (the shapes of
bench/vllm_kernels.py), GB/s of K+V read per ISA, next to two ceilings measured in the same
process on the same thread count: copy (bench.common, read + write) and a read-only pass over
the same caches (a bf16 sum of both, what a kernel that only streams the bytes could reach).

  .venv/bin/python -m bench.cpu_decode_profile [--threads 1] [--isas avx512,avx512_bf16] [--repeat 9] [--heads 8/8,32/8,64/8]

"per CPU s" divides by the process's CPU time instead of wall time, which a loaded machine's
time slicing moves less (with --threads 1 it is the kernel's own single-core rate). Inputs:
paged_ops.testing.make_case (blocks in random pool order), one set per shape; each call reads
32 MiB of K+V (the L3 holds part of it: rates are not DRAM-only).
"""
from __future__ import annotations

import argparse
import time

import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from bench import common
from paged_ops import reference
from paged_ops.testing import make_case, rel_err

ops = torch.ops.paged_cpu


def best_of(fn, repeat):
    fn()  # warm-up (page faults, OpenMP threads)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def case_for(heads, kv_heads, num_seqs=16, context=2048, head_size=128):
    return make_case([context] * num_seqs, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                     block_size=16, dtype=torch.bfloat16, poison_unused=False, seed=1)


def kv_bytes(c) -> int:
    per_token = 2 * c.key_cache.shape[2] * c.key_cache.shape[3] * c.key_cache.element_size()
    return int(c.seq_lens.sum()) * per_token


def run(isas, c, repeat):
    """{isa: (GB/s by wall time, GB/s per CPU second, rel err of sequence 0)}. The ISAs take turns
    call by call (best of repeat each), so a load that comes and goes on a shared machine hits
    them alike."""
    out = torch.empty_like(c.query)
    best = {isa: (float("inf"), float("inf")) for isa in isas}
    err = {}
    ref = torch.empty(c.query[:1].shape, dtype=torch.float64)
    reference.decode_attention(ref, c.query[:1].double(), c.key_cache, c.value_cache, c.block_tables[:1],
                               c.seq_lens[:1], c.scale, None, None)
    for i in range(repeat + 1):
        for isa in isas:
            previous = ops.set_isa(isa)
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                ops.decode_attention(*c.decode_args(out))
                t, t_cpu = time.perf_counter() - t0, time.process_time() - c0
            finally:
                ops.set_isa(previous)
            if i == 0:  # warm-up (page faults, OpenMP threads)
                err[isa] = rel_err(out[:1], ref)
            else:
                best[isa] = (min(best[isa][0], t), min(best[isa][1], t_cpu))
    nbytes = kv_bytes(c)
    return {isa: (nbytes / best[isa][0] / 1e9, nbytes / best[isa][1] / 1e9, err[isa]) for isa in isas}


def read_ceiling(c, repeat):
    """GB/s of a bf16 sum over both caches' whole pools (read only; the pool is the used blocks
    and a few spare ones)."""
    kc, vc = c.key_cache, c.value_cache
    t, _ = best_of(lambda: (kc.sum(), vc.sum()), repeat)
    return (kc.numel() + vc.numel()) * kc.element_size() / t / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    # amx_emulated is a correctness model of the AMX build (scalar tiles): its speed means nothing.
    ap.add_argument("--isas", default=",".join(i for i in ops.supported_isas() if i != "amx_emulated"))
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--heads", default="8/8,32/8,64/8", help="query/KV head pairs")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    copy = common.copy_peak_gbps()
    print(f"threads {a.threads}; bf16 decode 16 x 2048, head 128, block 16; copy peak {copy:.1f} GB/s (read + write)")
    print(f"{'isa':<12} {'heads':<6} {'GB/s':>6} {'of copy':>7} {'per CPU s':>9} {'read-only':>9} {'rel err':>9}")
    for heads, kv_heads in (tuple(int(x) for x in pair.split("/")) for pair in a.heads.split(",")):
        c = case_for(heads, kv_heads)
        ceiling = read_ceiling(c, a.repeat)
        for isa, (gbs, gbs_cpu, err) in run(a.isas.split(","), c, a.repeat).items():
            print(f"{isa:<12} {f'{heads}/{kv_heads}':<6} {gbs:6.1f} {gbs / copy:7.2f} {gbs_cpu:9.1f} {ceiling:9.1f} {err:9.2e}")


if __name__ == "__main__":
    main()

"""GPU timings of the Triton attention kernels, for the numbers the interpreter cannot give.

    python -m paged_ops.triton.bench                 # default + tuned configs, Llama-3-8B-like heads
    python -m paged_ops.triton.bench --no-tune --json

Decode is memory-bound: reported as achieved KV-cache read bandwidth (GB/s). Prefill is
compute-bound: reported as attention TFLOP/s (causal counts half the score matrix).
Each shape is checked against the float64 reference first, so a fast wrong kernel shows up.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch


def _paged_batch(seq_lens, num_kv_heads, head_size, block_size, dtype, device):
    """Random caches holding seq_lens tokens each, blocks shuffled across sequences."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, device=device).to(dtype)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(blocks):
        table[s, :nb] = perm[start:start + nb]
        start += nb
    return key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check(out, ref, dtype):
    budget = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    err = _rel_err(out, ref)
    if not err <= budget:
        raise AssertionError(f"relative error {err:.3g} > {budget:g}")
    return err


def bench_decode(batch, context, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    from triton.testing import do_bench

    from .. import reference
    from . import decode, last_config
    key_cache, value_cache, table, seq_lens = _paged_batch([context] * batch, num_kv_heads, head_size,
                                                           block_size, dtype, device)
    query = torch.randn(batch, num_heads, head_size, device=device).to(dtype)
    out = torch.empty_like(query)
    scale = head_size ** -0.5
    args = (out, query, key_cache, value_cache, table, seq_lens, scale)
    decode.decode_attention(*args)  # tunes here on a first call (if enabled)
    config = last_config("decode_attention")
    sub = slice(0, min(batch, 2))  # the float64 reference is slow: check two sequences
    ref = torch.empty(query[sub].shape, dtype=torch.float64, device=device)
    reference.decode_attention(ref, query[sub].double(), key_cache, value_cache, table[sub], seq_lens[sub], scale)
    err = _check(out[sub], ref, dtype)
    ms = do_bench(lambda: decode.decode_attention(*args), warmup=25, rep=100, return_mode="median")
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * key_cache.element_size()
    return {"op": "decode", "batch": batch, "context": context, "ms": ms, "GB/s": kv_bytes / ms / 1e6,
            "rel_err": err, "config": config["config"], "source": config["source"]}


def bench_prefill(q_len, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    from triton.testing import do_bench

    from .. import reference
    from . import last_config, prefill
    key_cache, value_cache, table, seq_lens = _paged_batch([q_len], num_kv_heads, head_size,
                                                           block_size, dtype, device)
    query = torch.randn(q_len, num_heads, head_size, device=device).to(dtype)
    out = torch.empty_like(query)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    scale = head_size ** -0.5
    args = (out, query, key_cache, value_cache, table, cu, seq_lens, q_len, scale, True)
    prefill.prefill_attention(*args)
    config = last_config("prefill_attention")
    rows = slice(q_len - 64, q_len)  # check the last 64 queries (they see the whole context)
    ref_full = torch.empty(query.shape, dtype=torch.float64, device=device)
    reference.prefill_attention(ref_full, query.double(), *args[2:])
    err = _check(out[rows], ref_full[rows], dtype)
    ms = do_bench(lambda: prefill.prefill_attention(*args), warmup=25, rep=100, return_mode="median")
    flops = 4 * q_len * q_len * num_heads * head_size / 2  # QK^T and PV, causal half
    return {"op": "prefill", "q_len": q_len, "ms": ms, "TFLOP/s": flops / ms / 1e9, "rel_err": err,
            "config": config["config"], "source": config["source"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tune", action="store_true", help="default configs only")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("needs a CUDA GPU and no TRITON_INTERPRET", file=sys.stderr)
        return 2
    if args.no_tune:
        os.environ["PAGED_OPS_TRITON_AUTOTUNE"] = "0"
    dtype = getattr(torch, args.dtype)
    shape = (args.heads, args.kv_heads, args.head_size, args.block_size, dtype, "cuda")
    rows = []
    for batch, context in ((1, 4096), (1, 32768), (8, 4096), (64, 2048), (256, 1024)):
        rows.append(bench_decode(batch, context, *shape))
    for q_len in (1024, 4096):
        rows.append(bench_prefill(q_len, *shape))
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{torch.cuda.get_device_name()}  {args.dtype}  heads {args.heads}/{args.kv_heads}  "
              f"head_size {args.head_size}  block {args.block_size}")
        for r in rows:
            what = (f"decode  batch {r['batch']:4d} ctx {r['context']:6d}: {r['ms']:.3f} ms  {r['GB/s']:7.0f} GB/s"
                    if r["op"] == "decode" else
                    f"prefill q_len {r['q_len']:5d}:            {r['ms']:.3f} ms  {r['TFLOP/s']:7.1f} TFLOP/s")
            print(f"{what}  err {r['rel_err']:.1e}  {r['source']} {r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

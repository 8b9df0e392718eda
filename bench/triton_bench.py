"""GPU timings of the Triton attention kernels, for the numbers the interpreter cannot give.

    python -m bench.triton_bench                 # default + tuned configs, Llama-3-8B-like heads
    python -m bench.triton_bench --no-tune --json

Decode is memory-bound: reported as achieved KV-cache read bandwidth (GB/s). Prefill is
compute-bound: reported as attention TFLOP/s (causal counts half the score matrix).
Each shape is checked against the float64 reference first, so a fast wrong kernel shows up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from paged_ops.testing import assert_close, make_case


def _paged_batch(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device, q_lens=None):
    """Random caches holding seq_lens tokens each (the whole pool random, built on the device),
    blocks shuffled across sequences, and the query."""
    return make_case(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     block_size=block_size, dtype=dtype, device=device, poison_unused=False, spare_blocks=0,
                     spare_columns=0)


def bench_decode(batch, context, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    from triton.testing import do_bench

    from paged_ops import reference
    from paged_ops.triton import decode, last_config
    case = _paged_batch([context] * batch, num_heads, num_kv_heads, head_size, block_size, dtype, device)
    key_cache, table, seq_lens, query = case.key_cache, case.block_tables, case.seq_lens, case.query
    out = torch.empty_like(query)
    scale = case.scale
    args = (out, query, key_cache, case.value_cache, table, seq_lens, scale)
    decode.decode_attention(*args)  # tunes here on a first call (if enabled)
    config = last_config("decode_attention")
    sub = slice(0, min(batch, 2))  # the float64 reference is slow: check two sequences
    ref = torch.empty(query[sub].shape, dtype=torch.float64, device=device)
    reference.decode_attention(ref, query[sub].double(), key_cache, case.value_cache, table[sub], seq_lens[sub], scale)
    err = assert_close(out[sub], ref, dtype)
    ms = do_bench(lambda: decode.decode_attention(*args), warmup=25, rep=100, return_mode="median")
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * key_cache.element_size()
    return {"op": "decode", "batch": batch, "context": context, "ms": ms, "GB/s": kv_bytes / ms / 1e6,
            "rel_err": err, "config": config["config"], "source": config["source"]}


def bench_prefill(q_len, num_heads, num_kv_heads, head_size, block_size, dtype, device):
    from triton.testing import do_bench

    from paged_ops import reference
    from paged_ops.triton import last_config, prefill
    case = _paged_batch([q_len], num_heads, num_kv_heads, head_size, block_size, dtype, device, q_lens=[q_len])
    query = case.query
    out = torch.empty_like(query)
    args = case.prefill_args(out)[:10]
    prefill.prefill_attention(*args)
    config = last_config("prefill_attention")
    rows = slice(q_len - 64, q_len)  # check the last 64 queries (they see the whole context)
    ref_full = torch.empty(query.shape, dtype=torch.float64, device=device)
    reference.prefill_attention(ref_full, query.double(), *args[2:])
    err = assert_close(out[rows], ref_full[rows], dtype)
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
        os.environ["PAGED_OPS_AUTOTUNE"] = "0"
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

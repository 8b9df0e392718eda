"""``python -m bench.decode_table``: a quick CPU decode benchmark across block sizes (``make demo``
prints it), bandwidth next to this machine's memory-copy bandwidth measured in the same run
(read + write bytes / time, the STREAM convention), so the ratio means something on a noisy box;
the load average before and after says how noisy.

Its shape is fixed (bf16, 16 seqs x 2048 tokens, 32/8 heads, head 128, blocks 1/16/64/256). For a
shape of your own (vLLM's benchmark_paged_attention.py arguments): ``python -m bench.paged_attention
--help``. The measurement suite proper is ``make bench`` (bench/test_kernels.py), whose case matrix
PAGED_BENCH_PROFILE picks: cpu (default without a GPU), gpu (default with one), smoke (tiny shapes,
seconds), cpu-small, device-check (bench/README.md).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import paged_ops
from bench.common import loadavg_text
from paged_ops.testing import make_case


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Best-of-5 memory-copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * nbytes / best / 1e9


def decode_table(block_sizes=(1, 16, 64, 256), num_seqs=16, seq_len=2048, num_heads=32, num_kv_heads=8,
                 head_size=128, dtype=torch.bfloat16):
    """(block size, ms, GB/s) per block size: decode time, and KV bytes read / time."""
    rows = []
    for block_size in block_sizes:
        # the whole pool random (no NaN slots), blocks in random order, exact table rows
        case = make_case([seq_len] * num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                         block_size=block_size, dtype=dtype, spare_blocks=0, spare_columns=0, poison_unused=False)
        args = case.decode_args(torch.empty_like(case.query))
        torch.ops.paged.decode_attention(*args)
        best = min(_timed(lambda: torch.ops.paged.decode_attention(*args)) for _ in range(5))
        kv_bytes = 2 * case.key_cache.numel() * case.key_cache.element_size()
        rows.append((block_size, best * 1e3, kv_bytes / best / 1e9))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    cli = parser.parse_args(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    load_start = os.getloadavg()
    copy_bw = copy_bandwidth()
    rows = decode_table()
    load_end = os.getloadavg()
    print(f"== paged_ops {paged_ops.selected_backend('cpu')!r} decode, bf16, 16 seqs x 2048 tokens, 32/8 heads, "
          f"head 128 ({torch.get_num_threads()} threads) ==")
    print(f"load average (1/5/15 min): {loadavg_text(load_start)} at the start, {loadavg_text(load_end)} at the end")
    print(f"memory copy bandwidth (read+write): {copy_bw:.1f} GB/s")
    print(f"{'block':>6}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    for block_size, ms, gbs in rows:
        print(f"{block_size:>6}{ms:>9.2f}{gbs:>9.2f}{gbs / copy_bw:>9.0%}")


if __name__ == "__main__":
    main()

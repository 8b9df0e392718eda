"""Launch tuning of the ``cuda`` backend's attention kernels.

A call's *shape key* (op, dtypes, head size, query group, KV heads, block size, and power-of-two
buckets of the batch and of the context / query length) is computed by the extension
(``torch.ops.paged_cuda.tuning_key``), so the key the kernels look up and the key tuned here can
never disagree. ``tune_decode`` / ``tune_prefill`` time every candidate configuration once on the
caller's real inputs (CUDA events, after a warm-up), record the fastest in the extension's registry
(``torch.ops.paged_cuda.set_tuned_config``) and persist it to ``CACHE_PATH`` (plus a flat ``.tsv``
twin that the extension loads by itself at its first lookup), so later processes reuse the choice
without timing again, whether or not they import this module.

``maybe_tune_decode`` / ``maybe_tune_prefill`` tune only keys not seen yet: that is the once-per-
shape hook for a caller (router or engine) that wants autotuning on first use.

Inspect a choice with ``tuned_config_for_decode`` / ``tuned_config_for_prefill`` (None = the
kernels' built-in defaults). On the emulator (``cuda_emu``) there is no tuning: a fixed default.
Candidates are timed by setting ``PAGED_CUDA_CONFIG``, which the extension reads at every call.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# PAGED_OPS_CACHE_DIR moves it (the extension reads the same variable for its .tsv twin).
CACHE_PATH = Path(os.environ.get("PAGED_OPS_CACHE_DIR", Path.home() / ".cache" / "paged_ops")) / "cuda_tuning.json"

# threads per block x split-KV partition size (tokens); partition -1 = one-pass kernel only.
DECODE_CANDIDATES = [dict(threads=t, partition=p) for t in (64, 128, 256) for p in (256, 512, 1024, -1)]
# KV tokens per shared-memory staging step of the decode kernel for query groups > 8.
DECODE_SHARED_KV_TILES = (32, 64)
# The tensor-core kernel (fixed 128 threads, 64 x 32 tiles; fp16/bf16 only), then the CUDA-core
# kernel's threads per block (rows per block = threads / 8) x KV tokens per shared-memory tile.
PREFILL_CANDIDATES = [dict(tc=1)] + [dict(tc=-1, threads=t, kv_tile=k) for t in (64, 128, 256) for k in (16, 32, 64)]


def _ops():
    return torch.ops.paged_cuda


def _available() -> bool:
    try:
        _ops().tuning_key  # noqa: B018 - raises when the extension was built without CUDA
    except (AttributeError, RuntimeError):
        return False
    return True


def _env(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _time_ms(fn, reps: int) -> float:
    fn()  # warm-up (and the first launch's lazy module load)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _tune(key: str, candidates: list[dict], run, reps: int) -> dict:
    old = os.environ.get("PAGED_CUDA_CONFIG")
    timings = {}
    try:
        for cfg in candidates:
            os.environ["PAGED_CUDA_CONFIG"] = _env(cfg)
            try:
                timings[_env(cfg)] = (_time_ms(run, reps), cfg)
            except RuntimeError:  # e.g. a tile that does not fit shared memory at this head size
                continue
    finally:
        if old is None:
            os.environ.pop("PAGED_CUDA_CONFIG", None)
        else:
            os.environ["PAGED_CUDA_CONFIG"] = old
    if not timings:
        raise RuntimeError(f"cuda_tuning: no candidate ran for {key}")
    ms, best = min(timings.values(), key=lambda x: x[0])
    full = dict(threads=best.get("threads", 0), partition=best.get("partition", 0), kv_tile=best.get("kv_tile", 0),
                tc=best.get("tc", 0))
    _ops().set_tuned_config(key, full["threads"], full["partition"], full["kv_tile"], full["tc"])
    _save(key, full, ms)
    return full


def _load_file() -> dict:
    try:
        return json.loads(CACHE_PATH.read_text())
    except (OSError, ValueError):
        return {}


def _save(key: str, cfg: dict, ms: float) -> None:
    data = _load_file()
    data[key] = dict(cfg, ms=round(ms, 5), device=torch.cuda.get_device_name())
    CACHE_PATH.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(CACHE_PATH)  # atomic: concurrent processes never read half a file
    # The extension's own loader reads this flat twin at its first lookup (csrc/cuda/tuning.h).
    tsv = CACHE_PATH.with_suffix(".tsv")
    lines = [f"{k} {int(c.get('threads', 0))} {int(c.get('partition', 0))} {int(c.get('kv_tile', 0))} "
             f"{int(c.get('tc', 0))}" for k, c in sorted(data.items())]
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(tsv)


def load() -> int:
    """Load the persisted choices into the extension's registry; returns how many."""
    if not _available():
        return 0
    data = _load_file()
    for key, cfg in data.items():
        _ops().set_tuned_config(key, int(cfg.get("threads", 0)), int(cfg.get("partition", 0)),
                                int(cfg.get("kv_tile", 0)), int(cfg.get("tc", 0)))
    return len(data)


def decode_key(query, key_cache, block_tables) -> str:
    return _ops().tuning_key(query, key_cache, block_tables, 0, True)


def prefill_key(query, key_cache, block_tables, max_seqlen_q: int) -> str:
    return _ops().tuning_key(query, key_cache, block_tables, int(max_seqlen_q), False)


def _lookup(key: str) -> dict | None:
    threads, partition, kv_tile, tc, tuned = _ops().tuned_config(key)
    return dict(threads=threads, partition=partition, kv_tile=kv_tile, tc=tc) if tuned else None


def tuned_config_for_decode(query, key_cache, block_tables) -> dict | None:
    return _lookup(decode_key(query, key_cache, block_tables))


def tuned_config_for_prefill(query, key_cache, block_tables, max_seqlen_q: int) -> dict | None:
    return _lookup(prefill_key(query, key_cache, block_tables, max_seqlen_q))


def tune_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                reps: int = 10) -> dict:
    """Time DECODE_CANDIDATES on these inputs (``out`` is overwritten) and record the fastest."""
    key = decode_key(query, key_cache, block_tables)
    run = lambda: _ops().decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,  # noqa: E731
                                          scale, k_scale, v_scale)
    candidates = DECODE_CANDIDATES
    if query.size(1) // key_cache.size(2) > 8:
        # Groups > 8 run the shared-KV kernel, whose staging chunk (kv_tile) trades shared memory
        # (blocks per SM) against barriers per token.
        candidates = [dict(c, kv_tile=k) for c in DECODE_CANDIDATES for k in DECODE_SHARED_KV_TILES]
    return _tune(key, candidates, run, reps)


def tune_prefill(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
                 causal, k_scale=None, v_scale=None, reps: int = 10) -> dict:
    """Time PREFILL_CANDIDATES on these inputs (``out`` is overwritten) and record the fastest."""
    key = prefill_key(query, key_cache, block_tables, max_seqlen_q)
    run = lambda: _ops().prefill_attention(out, query, key_cache, value_cache, block_tables,  # noqa: E731
                                           cu_seqlens_q, seq_lens, max_seqlen_q, scale, causal, k_scale, v_scale)
    return _tune(key, PREFILL_CANDIDATES, run, reps)


def maybe_tune_decode(*args, **kw) -> dict | None:
    """tune_decode unless this shape key already has a recorded choice (then return it)."""
    out, query, key_cache, value_cache, block_tables = args[:5]
    return tuned_config_for_decode(query, key_cache, block_tables) or tune_decode(*args, **kw)


def maybe_tune_prefill(*args, **kw) -> dict | None:
    out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q = args[:8]
    return (tuned_config_for_prefill(query, key_cache, block_tables, max_seqlen_q)
            or tune_prefill(*args, **kw))


load()


def _bench_case(num_seqs, ctx, q_len, heads, kv_heads, dtype, cache_dtype, head_size=128, block_size=16):
    """Random full-length paged inputs on the GPU (no reference needed: timing only)."""
    dev = "cuda"
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_size)
    kc = (torch.randn(shape, device=dev) * 0.5).to(cache_dtype)
    vc = (torch.randn(shape, device=dev) * 0.5).to(cache_dtype)
    bt = torch.randperm(num_blocks, device=dev, dtype=torch.int32).reshape(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.randn(num_seqs * q_len, heads, head_size, device=dev).to(dtype)
    scales = (None, None)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scales = (torch.ones(1, device=dev), torch.ones(1, device=dev))
    return q, kc, vc, bt, seq_lens, cu, scales


def _bench_main() -> None:
    """``python -m paged_ops.cuda_tuning``: tune and report a few standard shapes on this GPU.

    Prints, per shape, the chosen configuration, its time and the achieved KV-read bandwidth
    (decode) or attention FLOP rate (prefill), and persists the choices. These are the numbers a
    session without a GPU owes.
    """
    rows = []
    for num_seqs, ctx, heads, kv_heads, dt, cache in [(1, 32768, 32, 8, torch.float16, None),
                                                      (64, 2048, 32, 8, torch.bfloat16, None),
                                                      (256, 1024, 32, 32, torch.float16, None),
                                                      (64, 4096, 64, 8, torch.bfloat16, torch.float8_e4m3fn)]:
        q, kc, vc, bt, sl, _, (ks, vs) = _bench_case(num_seqs, ctx, 1, heads, kv_heads, dt, cache)
        out = torch.empty_like(q)
        cfg = tune_decode(out, q, kc, vc, bt, sl, 128 ** -0.5, ks, vs, reps=20)
        ms = _load_file()[decode_key(q, kc, bt)]["ms"]
        kv_bytes = 2 * kc.numel() * kc.element_size()
        rows.append((f"decode n={num_seqs} ctx={ctx} h={heads}/{kv_heads} {dt} {cache}", cfg, ms,
                     f"{kv_bytes / ms / 1e6:.0f} GB/s"))
    for num_seqs, qlen, heads, kv_heads, dt in [(4, 2048, 32, 8, torch.float16), (16, 512, 32, 8, torch.bfloat16)]:
        q, kc, vc, bt, sl, cu, (ks, vs) = _bench_case(num_seqs, qlen, qlen, heads, kv_heads, dt, None)
        out = torch.empty_like(q)
        cfg = tune_prefill(out, q, kc, vc, bt, cu, sl, qlen, 128 ** -0.5, True, ks, vs, reps=5)
        ms = _load_file()[prefill_key(q, kc, bt, qlen)]["ms"]
        flops = 4 * num_seqs * heads * 128 * qlen * qlen / 2  # causal: half the square
        rows.append((f"prefill n={num_seqs} q={qlen} h={heads}/{kv_heads} {dt}", cfg, ms,
                     f"{flops / ms / 1e9:.1f} TFLOP/s"))
    for name, cfg, ms, rate in rows:
        print(f"{name:60s} {ms:9.4f} ms  {rate:>14s}  {cfg}")


if __name__ == "__main__":
    _bench_main()

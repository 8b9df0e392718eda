"""Kernel benchmark cases: which shapes are timed, how their inputs are built, what they move.

A case is a frozen dataclass; ``cases(profile)`` lists them as one-factor sweeps around a base
shape per op (block size, context length, batch, GQA group, dtype) rather than the full product,
which would not fit the CPU budget (``make bench`` ~10 min on 2 cores). Inputs are built as
several independent sets (caches, queries, block tables) cycled round by round, with enough of
them to overflow the last-level cache, so a round never finds the previous round's data cached.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

import paged_ops
from paged_ops.testing import make_case, random_tensor
from bench.common import CORRECTNESS_ONLY, last_level_cache_bytes, rotation_count

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# DeepSeek's MLA rows: a 512-wide latent plus 64 RoPE dimensions (576 = the case's head_size).
MLA_ROPE_DIM = 64
MLA_HEAD_SIZE = 576


def mla_rope_dim(head_size: int) -> int:
    """The RoPE part of a latent row of head_size numbers (64, or an eighth of a small row)."""
    return MLA_ROPE_DIM if head_size > 2 * MLA_ROPE_DIM else max(8, head_size // 8 // 8 * 8)


@dataclass(frozen=True)
class Case:
    """One timed shape. For prefill, every sequence's whole context is the query (q_len = context).
    For reshape_and_cache, num_seqs x context_len tokens are written (concat_and_cache_mla: the same
    tokens' latent rows of head_size numbers, MLA_ROPE_DIM of them the RoPE part, one KV head); for copy/swap_blocks,
    a quarter of the pool's blocks are copied; for (de)quantize, the same number of K rows."""
    op: str
    sweep: str              # the axis this case varies ("base" for the shared base shape)
    block_size: int = 16
    num_seqs: int = 16
    context_len: int = 2048
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    cache_dtype: str | None = None  # an fp8 cache (None: same as dtype)
    num_layers: int = 1             # copy_blocks only

    @property
    def id(self) -> str:
        cd = f"-kv{self.cache_dtype}" if self.cache_dtype else ""
        return (f"{self.op}-{self.sweep}-bs{self.block_size}-s{self.num_seqs}-L{self.context_len}"
                f"-h{self.num_heads}/{self.num_kv_heads}-d{self.head_size}-{self.dtype}{cd}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.cache_dtype or self.dtype]

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.context_len


# ---------------------------------------------------------------- the case matrix

def _sweeps(base: Case, block_sizes=BLOCK_SIZES, contexts=(), batches=(), kv_heads=(),
            dtypes=()) -> list[Case]:
    """The base shape plus one-factor variations of it (duplicates of the base dropped)."""
    out = [replace(base, sweep="block_size", block_size=b) for b in block_sizes]
    out += [replace(base, sweep="context", context_len=c) for c in contexts]
    out += [replace(base, sweep="batch", num_seqs=s) for s in batches]
    out += [replace(base, sweep="gqa", num_kv_heads=k) for k in kv_heads]
    for d in dtypes:
        out.append(replace(base, sweep="dtype", cache_dtype=d) if d.startswith("fp8")
                   else replace(base, sweep="dtype", dtype=d))
    seen, unique = set(), []
    for c in out:
        key = replace(c, sweep="")
        if key not in seen or c.sweep == "block_size":
            seen.add(key)
            unique.append(c)
    return unique


def headline_case(profile: str) -> Case:
    """The foundation issue's headline decode shape (CPU) / the device check's (GPU)."""
    if profile == "gpu":
        return Case("decode_attention", "base", num_seqs=32, context_len=8192)
    if profile == "smoke":
        return Case("decode_attention", "base", num_seqs=2, context_len=64, num_heads=4, num_kv_heads=2, head_size=32)
    return Case("decode_attention", "base")  # 16 seqs x 2048 tokens, 32/8 heads, d128, bf16, block 16


MERGED_STATES = 4  # merge_states' partial results per row


def device_check_cases() -> list[Case]:
    """The device check's headline shapes (bench/headline.py's HEADLINE_SHAPES, the one definition),
    each a one-point block sweep at block 16: bench/test_references.py times FlexAttention on the
    block-16 points of decode's block sweeps and SDPA flash on prefill's, so every headline shape
    gets its reference beside it."""
    from bench.headline import HEADLINE_SHAPES
    return [Case(sweep="block_size", **fields) for _, _, fields in HEADLINE_SHAPES]


def cases(profile: str) -> list[Case]:
    """Every timed case of a profile: 'cpu' (make bench here), 'device-check' (device_check.sh on a
    GPU: the headline shapes only), 'gpu' (the GPU sweeps), 'cpu-small' (device_check.sh without a
    GPU), 'smoke' (tests/test_bench_smoke.py)."""
    if profile == "device-check":
        return device_check_cases()
    dec = headline_case(profile)
    if profile == "smoke":
        small = dict(num_heads=4, num_kv_heads=2, head_size=32, num_seqs=2, context_len=64)
        bs = (1, 16)
        return (_sweeps(dec, bs, contexts=(32,), batches=(1,), kv_heads=(4,), dtypes=("float32", "fp8_e4m3"))
                + _sweeps(Case("prefill_attention", "base", **small), bs, dtypes=("float32",))
                + _sweeps(Case("reshape_and_cache", "base", **small), bs, dtypes=("fp8_e4m3",))
                + _sweeps(Case("concat_and_cache_mla", "base", **small), bs, dtypes=("fp8_e4m3",))
                + _sweeps(Case("copy_blocks", "base", num_layers=2, **small), bs)
                + _sweeps(Case("swap_blocks", "base", **small), bs)
                + [Case("quantize_fp8", "dtype", **small), Case("dequantize_fp8", "dtype", **small),
                   Case("merge_attention_states", "dtype", **small), Case("merge_states", "dtype", **small)])
    if profile == "gpu":  # device_check.sh: ~3 minutes for cuda + triton, Triton JIT and tuning included
        few = (1, 16, 256)
        # kv_heads 2 and 1: groups 16 and 32, the CUDA decode's shared-KV kernel (one block per KV head)
        return (_sweeps(dec, contexts=(1024, 32768), batches=(128,), kv_heads=(32, 2, 1), dtypes=("fp8_e4m3",))
                + _sweeps(Case("prefill_attention", "base", num_seqs=8, context_len=2048), contexts=(8192,),
                          dtypes=("float16",))
                + _sweeps(Case("reshape_and_cache", "base", num_seqs=32, context_len=1024), few, dtypes=("fp8_e4m3",))
                + _sweeps(Case("concat_and_cache_mla", "base", num_seqs=32, context_len=1024, num_kv_heads=1,
                               head_size=MLA_HEAD_SIZE), few, dtypes=("fp8_e4m3",))
                + _sweeps(Case("copy_blocks", "base", num_seqs=32, context_len=2048, num_layers=8), few)
                + _sweeps(Case("swap_blocks", "base", num_seqs=32, context_len=2048), few)
                + [Case(op, "dtype", num_seqs=32, context_len=1024)
                   for op in ("quantize_fp8", "dequantize_fp8", "merge_attention_states", "merge_states")])
    if profile == "cpu-small":  # device_check.sh on a machine without a GPU: about a minute
        return (_sweeps(dec, (1, 16, 256), dtypes=("fp8_e4m3",))
                + _sweeps(Case("prefill_attention", "base", num_seqs=1, context_len=512), (16,))
                + [Case(op, "block_size", num_seqs=16, context_len=256, num_layers=2)
                   for op in ("reshape_and_cache", "copy_blocks", "swap_blocks")]
                + [Case("concat_and_cache_mla", "block_size", num_seqs=16, context_len=256, num_kv_heads=1,
                        head_size=MLA_HEAD_SIZE)]
                + [Case(op, "dtype", num_seqs=16, context_len=256)
                   for op in ("quantize_fp8", "dequantize_fp8", "merge_attention_states", "merge_states")])
    # cpu: sized for ~10 minutes of `make bench` on 2 shared cores
    return (_sweeps(dec, contexts=(256, 1024, 4096), batches=(1, 4, 64), kv_heads=(32, 16, 4),
                    dtypes=("float32", "float16", "fp8_e4m3"))
            + _sweeps(Case("prefill_attention", "base", num_seqs=2, context_len=512), contexts=(128, 1024),
                      kv_heads=(32,), dtypes=("float32",))
            + _sweeps(Case("reshape_and_cache", "base", num_seqs=16, context_len=256), dtypes=("float32", "fp8_e4m3"))
            + _sweeps(Case("concat_and_cache_mla", "base", num_seqs=16, context_len=256, num_kv_heads=1,
                           head_size=MLA_HEAD_SIZE), (1, 16, 64), dtypes=("bfloat16", "fp8_e4m3"))
            + _sweeps(Case("copy_blocks", "base", num_seqs=16, context_len=1024, num_layers=4))
            + _sweeps(Case("swap_blocks", "base", num_seqs=16, context_len=1024))
            + [Case(op, "dtype", num_seqs=16, context_len=256, dtype=d)
               for op in ("quantize_fp8", "dequantize_fp8", "merge_attention_states", "merge_states") for d in ("bfloat16", "float32")])


def default_profile() -> str:
    return os.environ.get("PAGED_BENCH_PROFILE") or ("gpu" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------- backends

def timed_backends() -> tuple[list[str], dict[str, str]]:
    """(backends to time, {excluded name: why}). cuda_emu and the Triton interpreter run here but
    are correctness tools: their times say nothing about the kernels."""
    timed, excluded = [], {}
    for name in paged_ops.available_backends():
        if name == "cpu" and default_profile() == "device-check":
            excluded[name] = "not timed in the device-check profile (its shapes are the GPU's headline)"
        elif name == "cuda_emu":
            excluded[name] = CORRECTNESS_ONLY["cuda_emu"]
        elif name == "triton" and (os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()):
            excluded[name] = CORRECTNESS_ONLY["triton-interpreter"]
        else:
            timed.append(name)
    return timed, excluded


def device_of(backend: str) -> str:
    return "cpu" if backend == "cpu" else "cuda"


def kernel(backend: str, op: str) -> Callable:
    """The backend's op without the Python argument validation: on a GPU the validation costs
    tens of microseconds, the size of a small kernel. Every case is validated once before timing
    (validated_kernel), so the timed calls are known to be well-formed."""
    return paged_ops.backend(backend).unchecked(op)


# Seconds of tuning each backend may spend in this process (PAGED_BENCH_TUNE_S; unset: no limit).
# The device check has one 10-minute command: the Triton tuner compiles every candidate of every
# new shape bucket, which unbounded could take the benchmark's whole budget. Per backend, so that
# Triton's compiles do not leave the cuda tuner (timing only, no compiles) without its seconds.
_tuning = {"spent_s": {}, "last": {}}


def tune_budget_s() -> float:
    v = os.environ.get("PAGED_BENCH_TUNE_S")
    return float(v) if v not in (None, "") else math.inf


def tune(backend: str, op: str, args: tuple) -> None:
    """Let the backend pick its launch configuration for this shape before timing: the cuda
    backend tunes attention only when asked (paged_ops.tuning.tune_cuda_*, persisted per shape
    bucket); the triton backend tunes by itself on a shape's first call, made here once.

    Bounded by PAGED_BENCH_TUNE_S, the seconds of tuning per backend in this process: once a
    backend has spent them, its remaining shapes run their default config (for triton
    PAGED_OPS_AUTOTUNE=0 from then on, the tuner's own switch). A tuning already started runs to
    its end, so the budget can be overrun by one shape's sweep. What each shape got is in its row's
    ``tuning`` field (record)."""
    if backend not in ("cuda", "triton") or op not in ("decode_attention", "prefill_attention"):
        return
    from paged_ops import tuning
    if _tuning["spent_s"].get(backend, 0.0) >= tune_budget_s():
        if backend == "triton":
            os.environ["PAGED_OPS_AUTOTUNE"] = "0"
        _tuning["last"][(backend, op)] = "not tuned here (tuning budget spent)"
        return
    if backend == "triton" and not tuning.tuning_enabled():  # interpreter, PAGED_OPS_AUTOTUNE=0, no GPU
        _tuning["last"][(backend, op)] = "default (tuning off)"
        return
    t = time.perf_counter()
    if backend == "cuda":
        getattr(tuning, "tune_cuda_" + op.split("_")[0])(*args, force=True)
    else:
        validated_kernel(backend, op)(*args)
        torch.cuda.synchronize()
    _tuning["spent_s"][backend] = _tuning["spent_s"].get(backend, 0.0) + time.perf_counter() - t
    last = tuning.last_config(backend, op) or {}
    _tuning["last"][(backend, op)] = last.get("source", "?")


def validated_kernel(backend: str, op: str) -> Callable:
    return getattr(paged_ops.backend(backend), op)


# ---------------------------------------------------------------- inputs

def _rand(shape, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return random_tensor(shape, dtype, gen, device)


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _pool(case: Case, device: str, gen: torch.Generator):
    """Random K and V caches of num_seqs x context_len tokens (copy/swap sources)."""
    per_seq = math.ceil(case.context_len / case.block_size)
    shape = (case.num_seqs * per_seq, case.block_size, case.num_kv_heads, case.head_size)
    return _rand(shape, case.cache_torch_dtype, device, gen), _rand(shape, case.cache_torch_dtype, device, gen)


def _paged(case: Case, device: str, seed: int, q_lens=None, spare_blocks: float = 0.0):
    """num_seqs sequences of context_len cached tokens (paged_ops.testing.make_case): the whole pool
    random (no NaN slow paths), each sequence's blocks drawn from a random permutation of the
    pool, as in a long-running engine (consecutive blocks of a sequence are not adjacent)."""
    c = case
    return make_case([c.context_len] * c.num_seqs, q_lens, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                     head_size=c.head_size, block_size=c.block_size, dtype=c.torch_dtype,
                     cache_dtype=c.cache_torch_dtype, device=device, seed=seed, poison_unused=False,
                     spare_blocks=spare_blocks, spare_columns=0)


def _slots(p, c: Case, device: str) -> torch.Tensor:
    """int64 [num_seqs * context_len]: the cache slot of every token of every sequence of p."""
    bt = p.block_tables.long()
    pos = torch.arange(c.context_len, device=device)
    return (bt[:, pos // c.block_size] * c.block_size + pos % c.block_size).reshape(-1)


def build_args(case: Case, device: str, seed: int) -> tuple:
    """One input set: the op's positional arguments, freshly allocated."""
    g = _gen(device, seed)
    dt, c = case.torch_dtype, case
    if c.op == "decode_attention":
        p = _paged(c, device, seed)
        return p.decode_args(torch.empty_like(p.query))
    if c.op == "prefill_attention":
        p = _paged(c, device, seed, q_lens=[c.context_len] * c.num_seqs)  # every token of the context a query
        return p.prefill_args(torch.empty_like(p.query), True)
    if c.op == "reshape_and_cache":
        p = _paged(c, device, seed, spare_blocks=1.0)  # half the pool unused, as in a running engine
        slots = _slots(p, c, device)
        k = _rand((c.num_tokens, c.num_kv_heads, c.head_size), dt, device, g)
        return (k, torch.empty_like(k).copy_(k), p.key_cache, p.value_cache, slots, p.k_scale, p.v_scale)
    if c.op == "concat_and_cache_mla":
        # one latent row per token into a one-head cache, half the pool unused
        p = _paged(replace(c, num_kv_heads=1), device, seed, spare_blocks=1.0)
        slots = _slots(p, c, device)
        rope_dim = mla_rope_dim(c.head_size)
        latent = _rand((c.num_tokens, c.head_size - rope_dim), dt, device, g)
        rope = _rand((c.num_tokens, rope_dim), dt, device, g)
        return (latent, rope, p.key_cache, slots, p.k_scale)
    if c.op == "copy_blocks":
        layers = [_pool(c, device, g) for _ in range(c.num_layers)]
        return ([k for k, _ in layers], [v for _, v in layers], _copy_mapping(layers[0][0].shape[0], seed).to(device))
    if c.op == "swap_blocks":
        src, _ = _pool(c, device, g)
        dst = torch.empty_like(src)
        return (src, dst, _copy_mapping(src.shape[0], seed))  # the contract wants the mapping on the CPU
    if c.op == "merge_attention_states":
        # num_seqs x context_len query rows merged from two partial results (cascade attention);
        # lses: float32 [num_tokens, num_heads], finite, spread so both sides weigh in
        parts = [_rand((c.num_tokens, c.num_heads, c.head_size), dt, device, g) for _ in range(2)]
        lses = [torch.randn(c.num_tokens, c.num_heads, device=device, generator=g).mul_(4) for _ in range(2)]
        return (torch.empty_like(parts[0]), torch.empty_like(lses[0]), parts[0], lses[0], parts[1], lses[1])
    if c.op == "merge_states":
        # the same rows merged from MERGED_STATES partial results (split-KV, context parallelism)
        states = _rand((c.num_tokens, MERGED_STATES, c.num_heads, c.head_size), dt, device, g)
        lse = torch.randn(c.num_tokens, MERGED_STATES, c.num_heads, device=device, generator=g).mul_(4)
        return (torch.empty_like(states[:, 0]), torch.empty_like(lse[:, 0]), states, lse)
    if c.op in ("quantize_fp8", "dequantize_fp8"):
        x = _rand((c.num_tokens, c.num_kv_heads, c.head_size), dt, device, g)
        f8 = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        scale = torch.ones(1, dtype=torch.float32, device=device)
        return (f8, x, scale) if c.op == "quantize_fp8" else (x, f8.copy_(x), scale)
    raise ValueError(c.op)


def _copy_mapping(num_blocks: int, seed: int) -> torch.Tensor:
    """(src, dst) pairs for a quarter of the pool: distinct random blocks, int64 on the CPU."""
    n = max(1, num_blocks // 4)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    dst = perm[n:2 * n] if 2 * n <= num_blocks else perm[:n]
    return torch.stack([perm[:n], dst], 1)


def set_bytes(args) -> int:
    """Bytes of every tensor in one input set (to size the rotation)."""
    total = 0
    for a in args:
        for t in (a if isinstance(a, list) else [a]):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------- what each op moves / computes

def bytes_moved(case: Case) -> int:
    """Bytes the op must move: for attention the KV read (the roofline-relevant traffic), for the
    cache ops everything read plus everything written."""
    c = case
    row = c.num_kv_heads * c.head_size  # elements of one token's K (or V)
    cache_el = c.cache_torch_dtype.itemsize
    el = c.torch_dtype.itemsize
    if c.op in ("decode_attention", "prefill_attention"):
        return 2 * c.num_tokens * row * cache_el
    if c.op == "reshape_and_cache":
        return 2 * c.num_tokens * row * (el + cache_el) + c.num_tokens * 8
    if c.op == "concat_and_cache_mla":  # one latent row per token, one KV head
        return c.num_tokens * c.head_size * (el + cache_el) + c.num_tokens * 8
    if c.op in ("copy_blocks", "swap_blocks"):
        per_seq = math.ceil(c.context_len / c.block_size)
        n = max(1, c.num_seqs * per_seq // 4)
        block = c.block_size * row * cache_el
        tensors = 2 * c.num_layers if c.op == "copy_blocks" else 1
        return 2 * n * block * tensors  # read + write
    if c.op in ("quantize_fp8", "dequantize_fp8"):
        return c.num_tokens * row * (el + 1)
    if c.op == "merge_attention_states":  # read two partial outs and lses, write the out and its lse
        return 3 * c.num_tokens * c.num_heads * (c.head_size * el + 4)
    if c.op == "merge_states":  # read the states and their lses, write the out and its lse
        return (MERGED_STATES + 1) * c.num_tokens * c.num_heads * (c.head_size * el + 4)
    raise ValueError(c.op)


def flops(case: Case) -> int:
    """Attention FLOPs (QK^T and PV, 2 per multiply-add), causal: query i of a sequence of L
    attends to i + 1 keys. Decode is the q_len = 1 case."""
    c = case
    if c.op == "prefill_attention":
        attended = c.num_seqs * c.context_len * (c.context_len + 1) // 2
    elif c.op == "decode_attention":
        attended = c.num_seqs * c.context_len
    else:
        return 0
    return 4 * c.num_heads * c.head_size * attended


def record(case: Case, backend: str, seconds: float, rounds: int, num_sets: int) -> dict:
    """One result row: the case's shape, its time (fastest round) and the achieved rates."""
    r = asdict(case) | {"backend": backend, "group": case.group, "id": case.id,
                        "seconds": seconds, "rounds": rounds, "input_sets": num_sets,
                        "bytes": bytes_moved(case), "flops": flops(case)}
    if (backend, case.op) in _tuning["last"]:  # the config's origin: tuned / cache / memo / default
        r["tuning"] = _tuning["last"][(backend, case.op)]
    if backend == "cpu":  # which build of the cpu kernels (csrc/cpu/isa.h) the time is of, on how many threads
        from bench.common import cpu_isa
        r["cpu_isa"], r["threads"] = cpu_isa(), torch.get_num_threads()
    r["gbps"] = r["bytes"] / seconds / 1e9
    r["tflops"] = r["flops"] / seconds / 1e12
    return r


def num_sets_for(case: Case, device: str, one_set_bytes: int) -> int:
    """Input sets to rotate: sized by the bytes a call touches (bytes_moved; a cache op touches
    a fraction of its pool), so the sets together are several times the last-level cache."""
    budget = (16 << 30) if device == "cuda" else (3 << 30)
    touched = min(one_set_bytes, bytes_moved(case))
    return min(rotation_count(touched, device), max(1, budget // max(one_set_bytes, 1)))


__all__ = ["BLOCK_SIZES", "Case", "cases", "default_profile", "headline_case", "timed_backends",
           "device_of", "kernel", "tune", "validated_kernel", "build_args", "set_bytes", "bytes_moved",
           "flops", "record", "num_sets_for", "last_level_cache_bytes"]


# ---------------------------------------------------------------- the session summary

def share_of_peak(row: dict, peaks: dict) -> float:
    """Prefill: share of the measured matmul TFLOP/s; every other op: of the copy GB/s."""
    p = peaks.get(row.get("device", "cpu"), {})
    if row["op"] == "prefill_attention":
        return row["tflops"] / p["matmul_tflops"] if p.get("matmul_tflops") else float("nan")
    return row["gbps"] / p["copy_gbps"] if p.get("copy_gbps") else float("nan")


def headline_line(rows: list[dict], peaks: dict) -> str | None:
    """The foundation issue's headline: CPU decode bf16 16 seqs x 2048, 32/8 heads, d128, block 16."""
    want = replace(headline_case("cpu"), sweep="block_size")
    for r in rows:
        if r["backend"] == "cpu" and r["id"] == want.id:
            share = share_of_peak(r, peaks)
            verdict = "MET" if share >= 0.60 else "NOT MET"
            return (f"headline (cpu decode bf16, 16 seqs x 2048 tokens, 32/8 heads, d128, block 16): "
                    f"{r['gbps']:.2f} GB/s = {share:.2f} of copy bandwidth "
                    f"{peaks['cpu']['copy_gbps']:.2f} GB/s (target >= 0.60: {verdict})")
    return None


def reference_lines(rows: list[dict]) -> list[str]:
    """For every shape timed by a torch reference (backend torch-*): each backend's rate against it."""
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    lines = []
    for case_id, group in by_id.items():
        for ref in (r for r in group if r["backend"].startswith("torch-")):
            key = "tflops" if ref["op"] == "prefill_attention" else "gbps"
            unit = "TFLOP/s" if key == "tflops" else "GB/s"
            others = ", ".join(f"{r['backend']} {r[key]:.3g} {unit} = {r[key] / ref[key]:.2f}x"
                               for r in group if not r["backend"].startswith("torch-"))
            lines.append(f"vs {ref['backend']} ({ref[key]:.3g} {unit}) on {case_id}: {others or 'no backend timed'}")
    return lines


def kernel_summary(rows: list[dict], peaks: dict, excluded: dict) -> tuple[dict, str]:
    """(JSON payload, printable text) of a kernel session: rows with their share of the peaks."""
    from bench.common import STREAM_NOTE, cpu_isa, table
    for r in rows:
        r["share_of_peak"] = share_of_peak(r, peaks)
    cols = ["op", "backend", "sweep", "block_size", "num_seqs", "context_len", "num_heads", "num_kv_heads",
            "head_size", "dtype", "cache_dtype", "seconds", "gbps", "tflops", "share_of_peak"]
    lines = [f"cpu ISA {cpu_isa()}, {torch.get_num_threads()} threads",
             f"peaks: " + "; ".join(f"{d}: copy {p.get('copy_gbps', float('nan')):.2f} GB/s"
                                    + (f", matmul {p['matmul_tflops']:.3g} TFLOP/s ({p['matmul_dtype']})"
                                       if p.get("matmul_tflops") else "")
                                    for d, p in peaks.items()),
             STREAM_NOTE + " (best of the session's start and end measurements); share_of_peak: prefill vs "
             "matmul TFLOP/s, everything else vs copy GB/s; times: fastest round over rotating inputs",
             "excluded from timing: " + ("; ".join(f"{k} ({v})" for k, v in excluded.items()) or "none"),
             table(rows, cols)]
    lines += reference_lines(rows)
    head = headline_line(rows, peaks)
    if head:
        lines.append(head)
    payload = {"peaks": peaks, "excluded_backends": excluded, "stream_convention": STREAM_NOTE,
               "headline": head, "rows": rows}
    return payload, "\n".join(lines)

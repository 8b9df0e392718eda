"""The op contract, once for every backend: each op x each of ``paged_ops.available_backends()``
against ``paged_ops.reference`` in float64 (GPU backends on CUDA tensors when a GPU is present;
Triton under the interpreter on CPU tensors otherwise).

Inputs come from ``paged_ops.testing``: fresh random batches whose output rows, unused cache
slots and blocks hold NaN and whose block tables hold garbage ids past each sequence's length,
so a kernel that reads or skips anything it should not fails the budget.

Each backend runs the attention grid its cost allows (``TIER``): cpu and cuda the full grid; the
CUDA emulator (every GPU thread a fiber) a pairwise cover of the same axes; Triton a smaller
hand-picked cover (under the interpreter every case is numpy, on a GPU every new shape is a JIT
compile). Every case of the small grid runs on every backend, and the full grid holds every axis
value of the pairwise one. What is specific to one backend (forced split paths and launch
configurations, tuners, the emulator's self-tests, fp8 bit probes of vectorized code) stays in
that backend's file.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_ops
from paged_ops import reference
from paged_ops.testing import (FP8_DTYPES, GARBAGE_BLOCK_ID, assert_bits_equal, assert_close, assert_lse_close, bits,
                               empty_cache, make_case, make_variants, nan_like, poison, ragged_lens, random_tensor)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = (F32, F16, BF16)
HEAD_SIZES = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 7, 8)

BACKENDS = paged_ops.available_backends()


def device_of(name: str) -> str:
    """CUDA tensors for a backend that runs them when a GPU is present, else CPU tensors."""
    return "cuda" if torch.cuda.is_available() and "cuda" in paged_ops.backend(name).devices else "cpu"


TIER = {name: {"cuda_emu": "pairwise", "triton": "small"}.get(name, "full") for name in BACKENDS}


# The contract is checked with the default configs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("untuned_configs")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# attention cases

@dataclass(frozen=True)
class Attn:
    """One attention batch: q_lens None = decode (one query per sequence)."""

    seq_lens: tuple
    q_lens: tuple | None = None
    group: int = 1
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = F32
    cache_dtype: torch.dtype | None = None
    layout: str = "NHD"
    scale_kind: str = "tensor"
    causal: bool = True
    seed: int = 0

    def build(self, device: str, extra_lens: tuple = ()):
        seq_lens = list(self.seq_lens) + list(extra_lens)
        q_lens = None if self.q_lens is None else list(self.q_lens) + [1] * len(extra_lens)
        return make_case(seq_lens, q_lens, num_heads=self.group * self.num_kv_heads, num_kv_heads=self.num_kv_heads,
                         head_size=self.head_size, block_size=self.block_size, dtype=self.dtype,
                         cache_dtype=self.cache_dtype, layout=self.layout, scale_kind=self.scale_kind,
                         device=device, seed=self.seed)

    @property
    def id(self) -> str:
        cd = "" if self.cache_dtype in (None, self.dtype) else f"-{str(self.cache_dtype)[6:]}-{self.scale_kind}"
        q = "" if self.q_lens is None else f"-q{list(self.q_lens)}"
        causal = "" if self.causal else "-noncausal"
        return (f"bs{self.block_size}-g{self.group}x{self.num_kv_heads}-d{self.head_size}-{str(self.dtype)[6:]}{cd}"
                f"-{self.layout}-L{list(self.seq_lens)}{q}{causal}".replace(" ", ""))


def _rotate(seq, i):
    return seq[i % len(seq)]


# -- decode --
# The small cover (Triton's): block size x group x head size x dtype x layout x fp8 format/scale.
DECODE_SMALL = [Attn(tuple(lens), None, g, kvh, d, bs, dt, cd, lay, sk or "tensor")
                 for dt, cd, bs, kvh, g, d, lay, lens, sk in [
                     (F32, F32, 16, 2, 1, 64, "NHD", [1, 16, 33], None),
                     (F16, F16, 1, 1, 2, 80, "HND", [1, 5, 9], None),
                     (BF16, BF16, 3, 2, 4, 96, "NHD", [3, 7, 20], None),
                     (F32, F32, 256, 1, 7, 128, "HND", [1, 256, 300], None),
                     (F16, F16, 16, 1, 8, 256, "NHD", [32, 17], None),
                     (BF16, BF16, 16, 2, 1, 128, "HND", [48, 2], None),
                     (F32, F32, 3, 4, 2, 256, "NHD", [6, 13, 1, 30], None),
                     (F16, F16, 16, 2, 7, 96, "HND", [16, 64, 5], None),
                     (F16, E4M3, 16, 2, 2, 64, "NHD", [20, 33], "tensor"),
                     (BF16, E5M2, 3, 2, 4, 80, "HND", [9, 1, 24], "head"),
                     (F32, E4M3, 1, 1, 7, 96, "NHD", [7, 12], "head"),
                     (F16, E5M2, 256, 2, 8, 128, "NHD", [256, 100], "tensor"),
                     (BF16, E4M3, 16, 1, 2, 256, "HND", [40, 3], "head"),
                     (F32, E5M2, 16, 2, 1, 80, "HND", [33], "tensor"),
                     (F16, F16, 3, 2, 2, 8, "NHD", [4, 20], None),  # head 8: below tensor-core tile widths
                     (BF16, E4M3, 1, 1, 4, 16, "HND", [3, 2], "tensor"),
                 ]]

# The emulator's pairwise cover: every block size x group, dtype / head size / layout rotating
# (the full grid below covers each of these combinations with more lengths).
DECODE_PAIRWISE_CORE = (
    [Attn(tuple(ragged_lens(bs)[:3] + [37] if bs < 256 else [1, 256, 300]), None, g, 2, _rotate(HEAD_SIZES, i), bs,
          _rotate(DTYPES, i), layout=_rotate(("NHD", "HND"), i), seed=bs * 100 + g)
     for i, (bs, g) in enumerate(itertools.product((1, 3, 16, 256), GROUPS))]
    + [Attn((5, 16, 33), None, 4, 2, d, 16, dt, layout=("NHD", "HND")[d % 3 == 0], seed=d)
       for d, dt in itertools.product(HEAD_SIZES, DTYPES)]
)
# Axis values the full grid does not reach otherwise, run by the emulator too.
DECODE_WIDE = (
    # head sizes off the common ones: any multiple of 8 up to 256
    [Attn((7, 20), None, 4, 1, d, 8, F32, seed=d) for d in (8, 24, 136, 200)]
    # fp8 caches: both formats x per-tensor / per-head scales
    + [Attn((1, 16, 37), None, _rotate(GROUPS, i), 2, 128, 16, _rotate(DTYPES, i), cd, _rotate(("NHD", "HND"), i), sk,
            seed=_rotate(GROUPS, i))
       for i, (cd, sk) in enumerate(itertools.product(FP8_DTYPES, ("tensor", "head")))]
    # groups > 8 (the CUDA kernels' shared-KV path, heads in chunks of 64): lengths around 64-token chunks
    + [Attn(tuple([1, 256, 300] if bs == 256 else [1, bs, 2 * bs + 1, 65, 130]), None, g, kvh, d, bs, dt, layout=lay,
            seed=g + d)
       for g, kvh, d, dt, lay, bs in [
           (12, 2, 128, BF16, "NHD", 16), (16, 2, 64, F32, "HND", 3), (16, 1, 256, F16, "NHD", 1),
           (24, 1, 96, F32, "NHD", 16), (32, 2, 80, F16, "HND", 16), (32, 1, 128, BF16, "NHD", 256),
           (64, 1, 128, F32, "HND", 16), (64, 2, 256, BF16, "NHD", 7), (72, 1, 64, F32, "NHD", 16),
           (80, 1, 64, F16, "HND", 16), (96, 1, 128, BF16, "NHD", 5)]]
    + [Attn((1, 16, 33, 100), None, g, 2, d, 16, dt, cd, ("NHD", "HND")[g % 3 == 0], sk, seed=g)
       for g, cd, sk, d, dt in [(16, E4M3, "tensor", 128, BF16), (32, E5M2, "head", 64, F16),
                                (64, E4M3, "head", 256, F32), (20, E5M2, "tensor", 24, F16)]]
)

# The full grid: every block size x group x dtype, head sizes and layouts rotating through them.
DECODE_FULL = (
    [Attn(tuple(ragged_lens(bs)), None, g, 2, _rotate(HEAD_SIZES, i), bs, dt, layout=_rotate(("NHD", "HND"), i),
          seed=bs * 100 + g)
     for i, (bs, g, dt) in enumerate(itertools.product((1, 3, 8, 16, 32, 64, 256), GROUPS, DTYPES))]
    + [Attn((5, 16, 33), None, 4, 2, d, 16, dt, layout=lay, seed=d)
       for d, dt, lay in itertools.product(HEAD_SIZES, DTYPES, ("NHD", "HND"))]
    + [Attn((1, 17, 80), None, 2, 4, 64, bs, dt, cd, scale_kind=sk)
       for cd, sk, dt, bs in [(E4M3, "tensor", BF16, 16), (E4M3, "head", F16, 3), (E5M2, "tensor", F32, 1),
                              (E5M2, "head", BF16, 64)]]
)

# -- prefill: fresh prompts (q_len = seq_len), chunked prefill over cached context, decode rows
# (q_len = 1) and sequences with nothing to compute (q_len = 0), in one varlen batch --
PREFILL_SMALL = [Attn(tuple(lens), tuple(q), g, kvh, d, bs, dt, cd, lay, sk or "tensor", causal, seed=1)
                  for dt, cd, bs, kvh, g, d, lay, lens, q, causal, sk in [
                      (F32, F32, 16, 2, 1, 64, "NHD", [16, 40, 5], [16, 40, 5], True, None),
                      (F16, F16, 1, 1, 2, 80, "HND", [9, 30], [9, 12], True, None),
                      (BF16, BF16, 3, 2, 4, 96, "NHD", [20, 7, 33], [1, 7, 20], True, None),
                      (F32, F32, 256, 1, 7, 128, "HND", [256, 300, 3], [256, 1, 2], True, None),
                      (F16, F16, 16, 1, 8, 256, "NHD", [32, 17], [32, 17], False, None),
                      (BF16, BF16, 16, 2, 1, 128, "HND", [48, 9], [20, 0], False, None),
                      (F32, F32, 3, 4, 2, 256, "NHD", [6, 13, 1], [6, 1, 1], True, None),
                      (F16, F16, 16, 2, 7, 96, "HND", [64, 5], [33, 5], True, None),
                      (F16, E4M3, 16, 2, 2, 64, "NHD", [20, 33], [20, 1], True, "tensor"),
                      (BF16, E5M2, 3, 2, 4, 80, "HND", [9, 24], [9, 10], True, "head"),
                      (F32, E4M3, 1, 1, 7, 96, "NHD", [12, 7], [5, 7], False, "head"),
                      (F16, E5M2, 256, 2, 8, 128, "NHD", [256, 100], [40, 1], True, "tensor"),
                      (BF16, E4M3, 16, 1, 2, 256, "HND", [40, 3], [40, 3], True, "head"),
                      (F32, F32, 1, 2, 1, 8, "HND", [7, 20], [7, 4], True, None),
                      (F16, E5M2, 3, 1, 7, 16, "NHD", [10, 1], [10, 1], False, "head"),
                      # many sequences, empty and 1-token queries among them
                      (F16, F16, 3, 2, 2, 64, "NHD", [9, 4, 30, 1, 17, 8, 40], [9, 0, 1, 1, 17, 3, 0], True, None),
                  ]]

PREFILL_PAIRWISE = (
    [Attn((1, 2 * bs, 21, 9, 6), (1, bs, 5, 9, 0), g, 2, _rotate(HEAD_SIZES, i), bs, _rotate(DTYPES, i),
          layout=_rotate(("NHD", "HND"), i), causal=bool(i % 4), seed=bs * 10 + g)
     for i, (bs, g) in enumerate(itertools.product((1, 3, 16), GROUPS))]
    + [Attn((5, 20), (5, 7), _rotate(GROUPS, i), 2, 64, 3, _rotate(DTYPES, i), cd, _rotate(("NHD", "HND"), i), sk,
            seed=_rotate(GROUPS, i))
       for i, (cd, sk) in enumerate(itertools.product(FP8_DTYPES, ("tensor", "head")))]
    # head sizes that are not multiples of 16 (tensor-core paths pad the k-steps)
    + [Attn((7, 20), (7, 9), 3, 2, d, 8, BF16, seed=d) for d in (8, 24, 136, 200)]
)

PREFILL_FULL = (
    [Attn((40, 70, 9, 1, 2 * bs), (40, 23, 1, 1, bs), g, 2, _rotate(HEAD_SIZES, i), bs, dt,
          layout=("NHD", "HND")[(i // 3) % 2], seed=bs + g)
     for i, (bs, g, dt) in enumerate(itertools.product((1, 3, 16, 64, 256), (1, 4, 7), DTYPES))]
    + [Attn((50, 17), (20, 17), 4, 2, 96, 8, dt, causal=False) for dt in DTYPES]
    # a long context behind a few queries: backends that split the KV across threads/blocks do
    + [Attn((2600,), (3,), 8, 1, 128, 32)]
    + [Attn(lens, q, 2, 4, 128, bs, dt, cd, scale_kind=sk)
       for cd, sk, dt, bs in [(E4M3, "tensor", BF16, 16), (E4M3, "head", F16, 3), (E5M2, "tensor", F32, 1),
                              (E5M2, "head", BF16, 64)]
       for lens, q in (((1, 17, 80), (1, 1, 1)), ((5, 17, 80), (5, 1, 30)))]
)


def _unique(cases):
    seen, out = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


GRIDS = {
    "decode": {"small": DECODE_SMALL, "pairwise": _unique(DECODE_SMALL + DECODE_PAIRWISE_CORE + DECODE_WIDE),
               "full": _unique(DECODE_SMALL + DECODE_WIDE + DECODE_FULL)},
    "prefill": {"small": PREFILL_SMALL, "pairwise": _unique(PREFILL_SMALL + PREFILL_PAIRWISE),
                "full": _unique(PREFILL_SMALL + PREFILL_PAIRWISE + PREFILL_FULL)},
}


def by_backend(grid: str):
    return [pytest.param(b, c, id=f"{b}-{c.id}") for b in BACKENDS for c in GRIDS[grid][TIER[b]]]


def _name(v) -> str:
    return str(v)[6:] if isinstance(v, torch.dtype) else str(v)


def with_backends(*axes, known_bugs: dict[str, str] | None = None):
    """Every backend with every combination of the axes (an axis of tuples adds several
    parameters at once). known_bugs: {backend: what is wrong}, run as strict xfails, so the
    test starts failing the day the bug is fixed and the entry must go."""
    params = []
    for b in BACKENDS:
        marks = [pytest.mark.xfail(reason=known_bugs[b], strict=True)] if known_bugs and b in known_bugs else []
        for combo in itertools.product(*axes):
            row = [x for v in combo for x in (v if isinstance(v, tuple) else (v,))]
            params.append(pytest.param(b, *row, id="-".join(_name(x) for x in [b, *row]), marks=marks))
    return params


@pytest.mark.parametrize("backend,case", by_backend("decode"))
def test_decode_attention(backend, case):
    device = device_of(backend)
    # on a GPU, a long sequence too: the split-KV paths take over past a few thousand tokens
    c = case.build(device, extra_lens=(1500,) if device == "cuda" else ())
    out = nan_like(c.query)
    paged_ops.backend(backend).decode_attention(*c.decode_args(out))
    sync(device)
    assert_close(out, c.reference_decode(), c.dtype)


@pytest.mark.parametrize("backend,case", by_backend("prefill"))
def test_prefill_attention(backend, case):
    device = device_of(backend)
    c = case.build(device)
    out = nan_like(c.query)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out, case.causal))
    sync(device)
    assert_close(out, c.reference_prefill(case.causal), c.dtype)


FUZZ_EXAMPLES = {"small": int(os.environ.get("PAGED_OPS_HYPOTHESIS_EXAMPLES", 12)), "pairwise": 8, "full": 25}


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_shapes_decode_and_prefill(backend):
    """Property test over the grids' axes combined at random (derandomized: reproducible):
    decode and prefill on one random batch. PAGED_OPS_HYPOTHESIS_EXAMPLES sets Triton's count
    (12) for a longer hunt."""
    device, small = device_of(backend), TIER[backend] == "small"
    ops = paged_ops.backend(backend)

    @settings(max_examples=FUZZ_EXAMPLES[TIER[backend]], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        dtype = data.draw(st.sampled_from(DTYPES), "dtype")
        cache_dtype = data.draw(st.sampled_from([dtype, E4M3, E5M2]), "cache_dtype")
        num_kv_heads = data.draw(st.integers(1, 3), "num_kv_heads")
        group = data.draw(st.sampled_from([1, 2, 3, 4, 7, 8]), "group")
        block_size = data.draw(st.sampled_from([1, 2, 3, 5, 8, 16, 32]), "block_size")
        head_size = data.draw(st.sampled_from([8, 24, 64, 80, 96, 128] + ([] if small else [256])), "head_size")
        seq_lens = data.draw(st.lists(st.integers(1, 48 if small else 90), min_size=1, max_size=4), "seq_lens")
        q_lens = [data.draw(st.integers(0, n), "q_len") for n in seq_lens]
        kw = dict(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_size=head_size,
                  block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                  layout=data.draw(st.sampled_from(["NHD", "HND"]), "layout"),
                  scale_kind=data.draw(st.sampled_from(["tensor", "head"]), "scale_kind"),
                  device=device, seed=data.draw(st.integers(0, 99), "seed"))
        c = make_case(seq_lens, **kw)
        out = nan_like(c.query)
        ops.decode_attention(*c.decode_args(out))
        sync(device)
        assert_close(out, c.reference_decode(), dtype, "decode")
        if sum(q_lens) == 0:
            return
        causal = data.draw(st.booleans(), "causal")
        c = make_case(seq_lens, q_lens, **kw)
        out = nan_like(c.query)
        ops.prefill_attention(*c.prefill_args(out, causal))
        sync(device)
        assert_close(out, c.reference_prefill(causal), dtype, "prefill")

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_variants(backend):
    """The property test with the attention variants drawn too (soft-cap, window, sinks, ALiBi,
    lse, each on or off), decode and prefill on one random batch, lse against the reference."""
    device, small = device_of(backend), TIER[backend] == "small"
    ops = paged_ops.backend(backend)

    @settings(max_examples=FUZZ_EXAMPLES[TIER[backend]], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        dtype = data.draw(st.sampled_from(DTYPES), "dtype")
        num_kv_heads = data.draw(st.integers(1, 3), "num_kv_heads")
        num_heads = num_kv_heads * data.draw(st.sampled_from([1, 2, 4, 7]), "group")
        seq_lens = data.draw(st.lists(st.integers(1, 48 if small else 90), min_size=1, max_size=4), "seq_lens")
        q_lens = [data.draw(st.integers(0, n), "q_len") for n in seq_lens]
        kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_size=data.draw(st.sampled_from([8, 64, 80, 128]), "head_size"),
                  block_size=data.draw(st.sampled_from([1, 3, 8, 16]), "block_size"), dtype=dtype,
                  cache_dtype=data.draw(st.sampled_from([dtype, E4M3, E5M2]), "cache_dtype"),
                  layout=data.draw(st.sampled_from(["NHD", "HND"]), "layout"), device=device,
                  seed=data.draw(st.integers(0, 99), "seed"))
        variants = dict(softcap=data.draw(st.sampled_from([0.0, 0.5, 2.0, 30.0]), "softcap"),
                        window_left=data.draw(st.sampled_from([-1, 0, 1, 4, 17, 60]), "window_left"),
                        sinks=data.draw(st.booleans(), "sinks"), alibi=data.draw(st.booleans(), "alibi"))
        with_lse = data.draw(st.booleans(), "lse")
        for kind in ("decode", "prefill"):
            if kind == "prefill" and sum(q_lens) == 0:
                return
            c = make_case(seq_lens, None if kind == "decode" else q_lens, **kw)
            v = make_variants(num_heads, **variants, lse_rows=c.query.shape[0] if with_lse else None,
                              seed=kw["seed"], device=device)
            out = nan_like(c.query)
            if kind == "decode":
                ops.decode_attention(*c.decode_args(out), **v)
                ref, ref_lse = c.reference_decode_lse(**v)
            else:
                causal = data.draw(st.booleans(), "causal")
                ops.prefill_attention(*c.prefill_args(out, causal), **v)
                ref, ref_lse = c.reference_prefill_lse(causal, **v)
            sync(device)
            assert_close(out, ref, dtype, kind)
            if with_lse:
                assert_lse_close(v["lse"], ref_lse, dtype, kind)

    check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_with_no_queries(backend):
    # Every q_len 0: nothing to compute, nothing read, and an empty output is fine.
    device = device_of(backend)
    c = make_case([4, 6], [0, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=4, device=device)
    out = torch.empty(0, 4, 64, device=device)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out))
    sync(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_seqlen_q", [0, 1, 7])
def test_prefill_max_seqlen_q_is_only_a_hint(backend, max_seqlen_q):
    # On CUDA tensors nothing checks max_seqlen_q unless PAGED_OPS_CHECK=1 (it would cost a sync),
    # so a kernel handed too small a value must still compute every row (docs/CONTRACT_NOTES.md).
    # Called through the backend's own kernel entry point, which trusts its caller.
    device = device_of(backend)
    c = make_case([40, 9, 3], [40, 1, 3], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                  seed=13, device=device)
    out = nan_like(c.query)
    args = list(c.prefill_args(out))
    args[7] = max_seqlen_q
    paged_ops.backend(backend).unchecked("prefill_attention")(*args)
    sync(device)
    assert_close(out, c.reference_prefill(), c.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_query_and_out(backend):
    # Rows of query and out strided (a wider buffer's halves; only stride(-1) == 1 is promised):
    # the result is right and nothing outside out's view is written.
    device = device_of(backend)
    c = make_case([9, 30], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, seed=5, device=device)
    wide = torch.randn(c.query.shape[0], c.query.shape[1], 128, device=device)
    wide[..., :64] = c.query
    c.query = wide[..., :64]
    out_wide = poison(torch.empty(wide.shape, device=device))
    out = out_wide[..., 64:]
    paged_ops.backend(backend).decode_attention(*c.decode_args(out))
    sync(device)
    assert_close(out, c.reference_decode(), c.dtype)
    assert torch.isnan(out_wide[..., :64]).all(), "wrote outside out's view"


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_op_with_backend_forced(backend):
    # torch.ops.paged.* with use_backend: the public entry point reaches this backend's kernels.
    device = device_of(backend)
    c = make_case([9, 30], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                  cache_dtype=E4M3, scale_kind="head", seed=9, device=device)
    out = nan_like(c.query)
    with paged_ops.use_backend(backend):
        torch.ops.paged.decode_attention(*c.decode_args(out))
    sync(device)
    assert_close(out, c.reference_decode(), F16)


@pytest.mark.parametrize("layout,cache_dtype", [("NHD", None), ("HND", E4M3)])
def test_make_case_poisons_what_no_sequence_reads(layout, cache_dtype):
    # The premise of every attention test above: exactly the slots of tokens < seq_len hold
    # numbers; every other slot is NaN and every table entry past a sequence's length is garbage.
    block_size = 16
    c = make_case([1, 16, 33], [1, 5, 33], num_heads=4, num_kv_heads=2, block_size=block_size, dtype=BF16,
                  cache_dtype=cache_dtype, layout=layout, scale_kind="head")
    used = torch.zeros(c.key_cache.shape[:2], dtype=torch.bool)
    for s, n in enumerate(c.seq_lens.tolist()):
        pos = torch.arange(n)
        used[c.block_tables[s, pos // block_size].long(), pos % block_size] = True
    assert (c.block_tables[:, -1] == GARBAGE_BLOCK_ID).all()
    assert used.sum() == c.seq_lens.sum(), "two tokens share a slot"
    for cache in (c.key_cache, c.value_cache):
        values = cache.float()
        assert values[~used].isnan().all() and not values[used].isnan().any()
    assert c.q_lens == [1, 5, 33] and c.max_seqlen_q == 33 and c.query.shape == (39, 4, 64)


# ---------------------------------------------------------------------------------------------
# attention variants (#13): soft-cap, sliding window, sinks, ALiBi, the log-sum-exp

@dataclass(frozen=True)
class Var:
    """A set of the keyword-only variants of decode/prefill (paged_ops.reference.attention)."""

    softcap: float = 0.0
    window_left: int = -1
    sinks: bool = False
    alibi: bool = False
    lse: bool = False

    def kwargs(self, case, device, seed=0) -> dict:
        return make_variants(case.query.shape[1], softcap=self.softcap, window_left=self.window_left,
                             sinks=self.sinks, alibi=self.alibi, lse_rows=case.query.shape[0] if self.lse else None,
                             seed=seed, device=device)

    @property
    def id(self) -> str:
        parts = ([f"cap{self.softcap:g}"] * bool(self.softcap) + [f"win{self.window_left}"] * (self.window_left >= 0)
                 + ["sinks"] * self.sinks + ["alibi"] * self.alibi + ["lse"] * self.lse)
        return "+".join(parts) or "plain"

    __str__ = id.fget  # test ids


# Each variant alone (windows: only the query itself, shorter than a block, across blocks), then
# pairs and triples so that every two variants meet, then all of them.
VARIANTS = [
    Var(softcap=1.5), Var(window_left=0), Var(window_left=5), Var(window_left=20), Var(sinks=True), Var(alibi=True),
    Var(lse=True),
    Var(softcap=2.0, window_left=7, lse=True), Var(sinks=True, alibi=True, lse=True), Var(window_left=3, sinks=True),
    Var(softcap=0.7, alibi=True), Var(window_left=12, alibi=True, lse=True), Var(softcap=1.0, sinks=True, lse=True),
    Var(softcap=1.5, window_left=9, sinks=True, alibi=True, lse=True),
]
ALL_VARIANTS = VARIANTS[-1]

# Long contexts, so that every backend's split-KV path runs with the variants (cpu: a parallel call
# with fewer tasks than threads x 4 splits at >= 256 tokens; cuda/cuda_emu: past 512 tokens on few
# blocks; triton: few programs for the SM count), and windows far shorter than the sequence
# (blocks before the window skipped).
VARIANT_LONG = {
    "decode": [
        (Attn((2100, 40), None, 4, 2, 128, 16, BF16, seed=21), Var(window_left=100, sinks=True, lse=True)),
        (Attn((700,), None, 2, 2, 64, 3, F16, E4M3, "HND", "head", seed=22), Var(softcap=1.2, alibi=True, lse=True)),
        (Attn((1300, 9), None, 8, 1, 64, 16, F32, seed=23), ALL_VARIANTS),
        (Attn((600,), None, 1, 2, 64, 1, F32, seed=24), Var(window_left=31, alibi=True)),
    ],
    "prefill": [
        (Attn((2100,), (3,), 4, 2, 128, 16, BF16, seed=25), ALL_VARIANTS),
        (Attn((600, 90), (64, 90), 2, 2, 64, 16, F16, causal=False, seed=26), Var(window_left=40, alibi=True, lse=True)),
        (Attn((900, 30), (40, 30), 4, 1, 96, 3, F32, E5M2, "HND", "tensor", seed=27),
         Var(softcap=0.9, window_left=200, sinks=True, lse=True)),
    ],
}


def _variant_cases(kind: str, tier: str):
    """(case, variants) pairs: the small grid with the variants rotating through it (small: each
    case with two variant sets; pairwise: three; full: every case with every set), plus the long
    cases; the emulator and the full grid also take the wide axes (fp8 formats, big groups)."""
    base = GRIDS[kind]["small"]
    rounds = {"small": 2, "pairwise": 3, "full": len(VARIANTS)}[tier]
    pairs = [(c, VARIANTS[(i + 5 * r) % len(VARIANTS)]) for r in range(rounds) for i, c in enumerate(base)]
    if tier != "small":
        wide = DECODE_WIDE if kind == "decode" else PREFILL_PAIRWISE
        pairs += [(c, VARIANTS[i % len(VARIANTS)]) for i, c in enumerate(wide)]
    return _unique(pairs + VARIANT_LONG[kind])


def by_backend_variants(kind: str):
    return [pytest.param(b, c, v, id=f"{b}-{c.id}-{v.id}") for b in BACKENDS for c, v in _variant_cases(kind, TIER[b])]


@pytest.mark.parametrize("backend,case,var", by_backend_variants("decode"))
def test_decode_attention_variants(backend, case, var):
    device = device_of(backend)
    c = case.build(device)
    kw = var.kwargs(c, device, case.seed)
    c.poison_hidden(**kw)  # tokens outside every row's window hold inf: they must never be read in
    out = nan_like(c.query)
    paged_ops.backend(backend).decode_attention(*c.decode_args(out), **kw)
    sync(device)
    ref, ref_lse = c.reference_decode_lse(**kw)
    assert_close(out, ref, c.dtype)
    if var.lse:
        assert_lse_close(kw["lse"], ref_lse, c.dtype)


@pytest.mark.parametrize("backend,case,var", by_backend_variants("prefill"))
def test_prefill_attention_variants(backend, case, var):
    device = device_of(backend)
    c = case.build(device)
    kw = var.kwargs(c, device, case.seed)
    c.poison_hidden(case.causal, **kw)  # tokens outside every row's window hold inf
    out = nan_like(c.query)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out, case.causal), **kw)
    sync(device)
    ref, ref_lse = c.reference_prefill_lse(case.causal, **kw)
    assert_close(out, ref, c.dtype)
    if var.lse:
        assert_lse_close(kw["lse"], ref_lse, c.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_with_defaults_spelled_out_equal_the_plain_call(backend):
    # softcap=0, window_left=-1, sinks/alibi None are "no variant": the same bits as the old call.
    device = device_of(backend)
    c = make_case([9, 40], [9, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, seed=3,
                  device=device)
    plain, spelled = nan_like(c.query), nan_like(c.query)
    ops = paged_ops.backend(backend)
    ops.prefill_attention(*c.prefill_args(plain))
    ops.prefill_attention(*c.prefill_args(spelled), softcap=0.0, window_left=-1, sinks=None, alibi_slopes=None,
                          lse=None, batch_invariant=False)
    sync(device)
    assert_bits_equal(spelled, plain)


@pytest.mark.parametrize("backend,window_left", with_backends((0, 1, 15, 16, 17, 1000)))
def test_window_at_block_boundaries(backend, window_left):
    # Windows around the block size (16): the first visible key at every offset of its block, and
    # a window longer than the sequence (no effect); prefill rows at every position, decode rows.
    device = device_of(backend)
    c = make_case([70, 33, 1], [30, 1, 1], num_heads=4, num_kv_heads=1, head_size=64, block_size=16, seed=window_left,
                  device=device)
    kw = make_variants(4, window_left=window_left, lse_rows=c.query.shape[0], device=device)
    out = nan_like(c.query)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out), **kw)
    sync(device)
    ref, ref_lse = c.reference_prefill_lse(**kw)
    assert_close(out, ref, F32)
    assert_lse_close(kw["lse"], ref_lse, F32)


@pytest.mark.parametrize("backend,window_left", with_backends((2**31 - 1, 2**31, 2**63 - 1)))
def test_window_longer_than_any_sequence(backend, window_left):
    # A window past every length (an engine's "no window" spelled as a huge number, sizes past
    # int32, the int64 maximum: p - window_left and window_left + q_len must not wrap) is no window.
    device = device_of(backend)
    c = make_case([40, 7], [6, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=6, device=device)
    lse = poison(torch.empty(13, 4, device=device))
    out = nan_like(c.query)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out), window_left=window_left, lse=lse)
    decode_out = nan_like(c.query[:2])
    paged_ops.backend(backend).decode_attention(decode_out, c.query[[5, 12]], *c.decode_args(None)[2:],
                                                window_left=window_left)
    sync(device)
    ref, ref_lse = c.reference_prefill_lse()
    assert_close(out, ref, F32)
    assert_lse_close(lse, ref_lse, F32)
    assert_close(decode_out, ref[[5, 12]], F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_dominating_and_negligible(backend):
    # A sink far above every score (the row is nearly all sink: out ~ 0, lse ~ sink) and far below
    # (no effect); out is checked against the reference's tiny values, lse at the sink.
    device = device_of(backend)
    c = make_case([40, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=4, device=device)
    sinks = torch.tensor([30.0, -30.0, 0.0, 8.0], device=device)
    lse = poison(torch.empty(2, 4, device=device))
    out = nan_like(c.query)
    paged_ops.backend(backend).decode_attention(*c.decode_args(out), sinks=sinks, lse=lse)
    sync(device)
    ref, ref_lse = c.reference_decode_lse(sinks=sinks)
    assert_close(out, ref, F32)
    assert_lse_close(lse, ref_lse, F32)


# -- merge_attention_states --

def merge_inputs(dtype, num_tokens=9, num_heads=4, head_size=80, seed=0):
    """Random partial states with the special rows the contract names: a side at -inf (its out
    NaN, which must not matter), both sides -inf (out 0), sides far apart, +inf and NaN lses."""
    g = torch.Generator().manual_seed(seed)
    prefix_out = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    suffix_out = torch.randn(num_tokens, num_heads, head_size, generator=g).to(dtype)
    prefix_lse = torch.randn(num_tokens, num_heads, generator=g) * 4
    suffix_lse = torch.randn(num_tokens, num_heads, generator=g) * 4
    inf = float("inf")
    prefix_lse[0, :2] = -inf
    prefix_out[0, :2] = float("nan")  # no keys on that side: out NaN, lse -inf (reference.attention)
    suffix_lse[1, 1:3] = -inf
    suffix_out[1, 1:3] = float("nan")
    prefix_lse[2], suffix_lse[2] = -inf, -inf
    prefix_out[2], suffix_out[2] = float("nan"), float("nan")
    prefix_lse[3], suffix_lse[3] = torch.tensor([80.0, -80.0, 0.0, 1e-3]), torch.tensor([-80.0, 80.0, 0.0, -1e-3])
    prefix_lse[4, 0], suffix_lse[4, 1], prefix_lse[4, 2] = inf, float("nan"), -inf
    suffix_lse[4, 2] = inf
    return prefix_out, prefix_lse, suffix_out, suffix_lse


@pytest.mark.parametrize("backend,dtype,with_out_lse", with_backends(DTYPES, (True, False)))
def test_merge_attention_states(backend, dtype, with_out_lse):
    device = device_of(backend)
    inputs = merge_inputs(dtype, seed=len(str(dtype)))
    ref = torch.empty(inputs[0].shape, dtype=torch.float64)
    ref_lse = torch.empty(inputs[1].shape, dtype=torch.float64)
    reference.merge_attention_states(ref, ref_lse, *inputs)
    out = nan_like(inputs[0]).to(device)
    out_lse = poison(torch.empty(inputs[1].shape, device=device)) if with_out_lse else None
    paged_ops.backend(backend).merge_attention_states(out, out_lse, *(t.to(device) for t in inputs))
    sync(device)
    out = out.cpu()
    nan_rows = ref.isnan().any(-1)  # a +inf / NaN lse
    assert nan_rows[4, :3].all() and nan_rows.sum() == 3
    assert out[nan_rows].isnan().all(), "rows the contract makes NaN"
    assert (out[2] == 0).all(), "both sides -inf: attention over no key, out 0"
    assert_close(out[~nan_rows], ref[~nan_rows], dtype)
    if with_out_lse:
        out_lse = out_lse.cpu()
        assert (out_lse[2] == -float("inf")).all(), "both sides -inf: lse -inf"
        assert not out_lse[4, :3].isfinite().any(), "a +inf / NaN side: no finite lse"
        assert_lse_close(out_lse[~nan_rows], ref_lse[~nan_rows], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_attention_states_strided_outputs(backend):
    # out and the partial outs as strided views (stride(-1) == 1 only), many rows: nothing outside
    # out's view is written.
    device = device_of(backend)
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(300, 8, 2, 64, generator=g).to(BF16)
    prefix_out, suffix_out = wide[:, :, 0], wide[:, :, 1]
    prefix_lse, suffix_lse = torch.randn(300, 8, generator=g) * 3, torch.randn(300, 8, generator=g) * 3
    ref = torch.empty(300, 8, 64, dtype=torch.float64)
    reference.merge_attention_states(ref, None, prefix_out, prefix_lse, suffix_out, suffix_lse)
    out_wide = poison(torch.empty(300, 8, 128, dtype=BF16, device=device))
    out = out_wide[..., 32:96]
    paged_ops.backend(backend).merge_attention_states(
        out, None, prefix_out.to(device), prefix_lse.to(device), suffix_out.to(device), suffix_lse.to(device))
    sync(device)
    assert_close(out, ref, BF16)
    assert out_wide[..., :32].isnan().all() and out_wide[..., 96:].isnan().all(), "wrote outside out's view"


# -- the cascade identity: attention over a sequence == merge(attention over a shared prefix,
# attention over the rest), with real block tables --

def cascade_case(block_size, dtype, device, seed):
    """Three sequences whose first ``prefix_len`` tokens are one shared prefix (the same blocks in
    every table: the blocks make_case gave the other two sequences there are poisoned, unread)
    and query rows (a decode row, a chunk of 4, a chunk of 2) at their ends."""
    prefix_len = max(2, -(-8 // block_size)) * block_size  # whole blocks, >= 7 (the query rows: q_len <= seq_len)
    suffix_lens = [5, 23, 2 * block_size + 3]
    q_lens = [1, 4, 2]
    c = make_case([prefix_len + n for n in suffix_lens], q_lens, num_heads=8, num_kv_heads=2, head_size=64,
                  block_size=block_size, dtype=dtype, seed=seed)
    shared = prefix_len // block_size
    for s in (1, 2):
        for b in c.block_tables[s, :shared].tolist():
            poison(c.key_cache[b]), poison(c.value_cache[b])
        c.block_tables[s, :shared] = c.block_tables[0, :shared]
    return c.to(device), prefix_len, suffix_lens


@pytest.mark.parametrize("backend,block_size,dtype,var", with_backends(
    [(16, F32), (3, BF16), (1, F16)], [Var(), Var(softcap=1.3), Var(softcap=0.8, sinks=True)]))
def test_cascade_identity(backend, block_size, dtype, var):
    """Full attention == merge(prefix pass, suffix pass): the prefix pass takes every query row of
    the batch as ONE sequence over the shared prefix (computed once, causal=False: all its keys
    precede every query), the suffix pass each sequence over its own blocks after the prefix
    (causal, so positions line up bottom-right). Soft-cap applies in both passes; a sink is one
    logit per row, so it goes into exactly one pass (the prefix). ALiBi and windows depend on
    absolute positions, which a pass over part of the keys does not see: not part of the identity."""
    device = device_of(backend)
    c, prefix_len, suffix_lens = cascade_case(block_size, dtype, device, seed=block_size)
    ops = paged_ops.backend(backend)
    full_kw = var.kwargs(c, device, seed=7)
    total_q, num_heads = c.query.shape[:2]

    full, full_lse = nan_like(c.query), poison(torch.empty(total_q, num_heads, device=device))
    ops.prefill_attention(*c.prefill_args(full), **{**full_kw, "lse": full_lse})

    shared = prefix_len // block_size
    garbage = torch.full((1, 1), GARBAGE_BLOCK_ID, dtype=torch.int32, device=device)
    prefix_table = torch.cat([c.block_tables[:1, :shared], garbage], dim=1)
    prefix_out, prefix_lse = nan_like(c.query), poison(torch.empty(total_q, num_heads, device=device))
    ops.prefill_attention(prefix_out, c.query, c.key_cache, c.value_cache, prefix_table,
                          torch.tensor([0, total_q], dtype=torch.int32, device=device),
                          torch.tensor([prefix_len], dtype=torch.int32, device=device), total_q, c.scale, False,
                          c.k_scale, c.v_scale, softcap=var.softcap, sinks=full_kw.get("sinks"), lse=prefix_lse)

    suffix_out, suffix_lse = nan_like(c.query), poison(torch.empty(total_q, num_heads, device=device))
    ops.prefill_attention(suffix_out, c.query, c.key_cache, c.value_cache, c.block_tables[:, shared:].contiguous(),
                          c.cu_seqlens_q, torch.tensor(suffix_lens, dtype=torch.int32, device=device),
                          c.max_seqlen_q, c.scale, True, c.k_scale, c.v_scale, softcap=var.softcap, lse=suffix_lse)

    merged, merged_lse = nan_like(c.query), poison(torch.empty(total_q, num_heads, device=device))
    ops.merge_attention_states(merged, merged_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)
    sync(device)
    ref, ref_lse = c.reference_prefill_lse(**full_kw)
    assert_close(full, ref, dtype, "one pass")
    assert_close(merged, ref, dtype, "prefix pass merged with suffix pass")
    assert_lse_close(full_lse, ref_lse, dtype, "one pass")
    assert_lse_close(merged_lse, ref_lse, dtype, "merged")


# -- the batch-invariant mode: a row's bits do not depend on the rest of the batch --

# The target sequence is long enough that every backend splits its KV when the batch leaves
# threads / SMs idle (cpu: 2100 x 8 heads x 128 passes the parallel threshold and is split at
# 256+ tokens; cuda/cuda_emu: past 512 tokens; triton: few programs), and the other sequences
# change that: short and long neighbours, some long enough to split themselves.
TARGET_LEN = 2100
POOL_LENS = [TARGET_LEN, 37, 3000, 5, 1200, 700, 1]
# Batches as rows of the pool (index 0 = the target), each with its own block-table width.
BATCH_MIXES = [[0], [1, 0], [0, 2], [3, 4, 0, 5, 6], [2, 4, 5, 0, 1, 3]]


def invariance_pool(dtype, device, seed=0):
    """One cache holding the pool's sequences; decode queries for each, and for the target a
    chunk of 17 prefill query rows ending in its decode query (row 16 at position TARGET_LEN - 1)."""
    pool = make_case(POOL_LENS, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype, seed=seed)
    chunk = random_tensor((17, 8, 128), dtype, torch.Generator().manual_seed(seed + 5))
    chunk[-1] = pool.query[0]
    return pool.to(device), chunk.to(device)


def sub_batch(pool, rows, width_pad):
    """decode args of the pool's sequences ``rows``: the block table cut to their longest sequence
    plus ``width_pad`` garbage columns (engines pass tables of varying widths)."""
    rows_t = torch.tensor(rows, device=pool.device)
    blocks = -(-max(POOL_LENS[r] for r in rows) // pool.key_cache.shape[1])
    table = pool.block_tables[rows_t, :blocks]
    if width_pad:
        table = torch.cat([table, torch.full((len(rows), width_pad), GARBAGE_BLOCK_ID, dtype=torch.int32,
                                             device=pool.device)], dim=1)
    return (pool.query[rows_t], pool.key_cache, pool.value_cache, table.contiguous(), pool.seq_lens[rows_t],
            pool.scale, pool.k_scale, pool.v_scale)


def run_decode(ops, args, kw, num_rows):
    out = nan_like(args[0])
    lse = poison(torch.empty(num_rows, args[0].shape[1], device=args[0].device))
    ops.decode_attention(out, *args, **kw, lse=lse)
    return out, lse


def invariance_variants(var, device):
    return make_variants(8, softcap=var.softcap, window_left=var.window_left, sinks=var.sinks, alibi=var.alibi,
                         seed=3, device=device)


INVARIANCE_VARIANTS = [Var(), Var(softcap=1.5, window_left=500, sinks=True, alibi=True)]


@pytest.mark.parametrize("backend,dtype,var", with_backends([BF16, F32], INVARIANCE_VARIANTS))
def test_batch_invariant_decode_across_batches(backend, dtype, var):
    """(a) the target alone vs (b) inside batches of other lengths and table widths: out and lse
    bitwise equal in the mode, and right (against the reference)."""
    device = device_of(backend)
    pool, _ = invariance_pool(dtype, device)
    ops = paged_ops.backend(backend)
    kw = dict(invariance_variants(var, device), batch_invariant=True)
    results = []
    for i, rows in enumerate(BATCH_MIXES):
        out, lse = run_decode(ops, sub_batch(pool, rows, width_pad=i % 3), kw, len(rows))
        sync(device)
        results.append((rows, out[rows.index(0)], lse[rows.index(0)]))
    ref, ref_lse = pool_reference(pool, kw)
    assert_close(results[0][1], ref, dtype, "the target alone")
    assert_lse_close(results[0][2][None], ref_lse[None], dtype)
    for rows, out, lse in results[1:]:
        assert_bits_equal(out, results[0][1], f"out of the target in batch {rows} vs alone")
        assert_bits_equal(lse, results[0][2], f"lse of the target in batch {rows} vs alone")


def pool_reference(pool, kw, seq_len=TARGET_LEN, query=None):
    """The reference's out/lse row of the target at kv length seq_len (decode)."""
    q = pool.query[:1] if query is None else query[None]
    ref = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    variants = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items() if k != "batch_invariant"}
    reference.decode_attention(ref, q.cpu().double(), pool.key_cache.cpu(), pool.value_cache.cpu(),
                               pool.block_tables[:1].cpu(), torch.tensor([seq_len], dtype=torch.int32), pool.scale,
                               None if pool.k_scale is None else pool.k_scale.cpu(),
                               None if pool.v_scale is None else pool.v_scale.cpu(), lse=lse, **variants)
    return ref[0], lse[0]


@pytest.mark.parametrize("backend,dtype,var", with_backends([BF16], INVARIANCE_VARIANTS))
def test_batch_invariant_prefill_rows_equal_decode(backend, dtype, var):
    """(c) chunked prefill: row i of a causal prefill chunk of q_len rows (in a batch with other
    sequences' prefill and decode rows) has the bits of a decode at seq_len = its position + 1,
    for q_len 1, 3 and 17 (the first, middle and last row of each chunk: every decode is a
    2100-token call, and the Triton interpreter pays for each)."""
    device = device_of(backend)
    pool, chunk = invariance_pool(dtype, device)
    ops = paged_ops.backend(backend)
    kw = dict(invariance_variants(var, device), batch_invariant=True)
    decode_rows = {}
    for q_len in (1, 3, 17):
        rows = chunk[17 - q_len:]
        # with a long sequence's decode row, another sequence's 9-row chunk and a 1-token sequence
        query = torch.cat([pool.query[2:3], rows, random_tensor((9, 8, 128), dtype, torch.Generator().manual_seed(q_len),
                                                                device), pool.query[6:7]])
        lens = [POOL_LENS[2], TARGET_LEN, POOL_LENS[4], POOL_LENS[6]]
        q_lens = [1, q_len, 9, 1]
        table = pool.block_tables[torch.tensor([2, 0, 4, 6], device=device)]
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        out = nan_like(query)
        lse = poison(torch.empty(query.shape[:2], device=device))
        ops.prefill_attention(out, query, pool.key_cache, pool.value_cache, table, cu,
                              torch.tensor(lens, dtype=torch.int32, device=device), max(q_lens), pool.scale, True,
                              pool.k_scale, pool.v_scale, **kw, lse=lse)
        for i in sorted({0, q_len // 2, q_len - 1}):
            position = TARGET_LEN - q_len + i
            if position not in decode_rows:
                d_out, d_lse = run_decode(ops, (chunk[16 - (TARGET_LEN - 1 - position)][None], pool.key_cache,
                                                pool.value_cache, pool.block_tables[:1],
                                                torch.tensor([position + 1], dtype=torch.int32, device=device),
                                                pool.scale, pool.k_scale, pool.v_scale), kw, 1)
                decode_rows[position] = (d_out[0], d_lse[0])
            row = 1 + i
            want_out, want_lse = decode_rows[position]
            assert_bits_equal(out[row], want_out, f"prefill q_len {q_len} row {i} (position {position}) vs decode")
            assert_bits_equal(lse[row], want_lse, f"prefill q_len {q_len} row {i} lse vs decode")
    ref, ref_lse = pool_reference(pool, kw)
    assert_close(decode_rows[TARGET_LEN - 1][0], ref, dtype)
    assert_lse_close(decode_rows[TARGET_LEN - 1][1][None], ref_lse[None], dtype)


@pytest.mark.parametrize("backend,var", [p for p in with_backends(INVARIANCE_VARIANTS)
                                         if device_of(p.values[0]) == "cpu"])
def test_batch_invariant_thread_count(threads, backend, var):
    """(d) the same batches with 1 and 2 threads (backends on CPU tensors): the same bits."""
    device = device_of(backend)
    pool, _ = invariance_pool(BF16, device)
    ops = paged_ops.backend(backend)
    kw = dict(invariance_variants(var, device), batch_invariant=True)
    got = {}
    for n in (1, 2):
        threads(n)
        got[n] = [run_decode(ops, sub_batch(pool, rows, 0), kw, len(rows)) for rows in BATCH_MIXES[:3]]
    for (o1, l1), (o2, l2), rows in zip(got[1], got[2], BATCH_MIXES):
        assert_bits_equal(o1, o2, f"out, batch {rows}, 1 vs 2 threads")
        assert_bits_equal(l1, l2, f"lse, batch {rows}, 1 vs 2 threads")


def _row_vs_decode(ops, pool, chunk, target_len=TARGET_LEN, **kw):
    """(last row of a 17-row causal prefill chunk of the target, the decode at the same position)."""
    out = nan_like(chunk)
    device = chunk.device
    lens = torch.tensor([target_len], dtype=torch.int32, device=device)
    ops.prefill_attention(out, chunk, pool.key_cache, pool.value_cache, pool.block_tables[:1],
                          torch.tensor([0, 17], dtype=torch.int32, device=device), lens, 17, pool.scale, True,
                          pool.k_scale, pool.v_scale, **kw)
    d = nan_like(chunk[:1])
    ops.decode_attention(d, chunk[16:], pool.key_cache, pool.value_cache, pool.block_tables[:1], lens, pool.scale,
                         pool.k_scale, pool.v_scale, **kw)
    return out[16], d[0]


def test_batch_mixes_differ_without_the_mode():
    """The invariance tests above prove something only if, without the mode, a row's bits do
    depend on the batch somewhere: some available backend must show it (here: triton's split
    count follows the batch, cuda_emu's prefill kernel rounds otherwise than its decode kernel,
    cpu's split count follows the thread count). Cheapest backends first; stops at the first."""
    found = []
    for backend in sorted(BACKENDS, key=lambda b: b == "triton"):
        device = device_of(backend)
        ops = paged_ops.backend(backend)
        pool, chunk = invariance_pool(F32, device)
        row, decode = _row_vs_decode(ops, pool, chunk)
        if not torch.equal(bits(row), bits(decode)):
            found.append(f"{backend}: prefill row != decode")
            break
        alone = run_decode(ops, sub_batch(pool, [0], 0), {}, 1)[0][0]
        for i, rows in enumerate(BATCH_MIXES[1:]):
            mixed = run_decode(ops, sub_batch(pool, rows, i % 3), {}, len(rows))[0][rows.index(0)]
            if not torch.equal(bits(mixed), bits(alone)):
                found.append(f"{backend}: batch {rows} != alone")
                break
        if found:
            break
    assert found, "no backend's bits depend on the batch without the mode: the invariance tests prove nothing"


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_context_and_env_reach_the_kernels(backend, monkeypatch):
    """paged_ops.batch_invariant() and PAGED_OPS_BATCH_INVARIANT=1 give the bits of
    batch_invariant=True (the public op resolves them; the kernels see one flag), on torch.ops.paged
    routed to the backend, and the mode's prefill row equals its decode."""
    device = device_of(backend)
    pool, chunk = invariance_pool(F32, device, seed=8)
    ops = paged_ops.backend(backend)
    target_len = 700  # the target's first 700 tokens: still split (256-token splits in the mode), cheaper
    want = _row_vs_decode(ops, pool, chunk, target_len, batch_invariant=True)
    assert_bits_equal(want[0], want[1], "in the mode, the prefill row is the decode")
    with paged_ops.use_backend(backend):
        with paged_ops.batch_invariant():
            by_context = _row_vs_decode(torch.ops.paged, pool, chunk, target_len)
        monkeypatch.setenv("PAGED_OPS_BATCH_INVARIANT", "1")
        by_env = _row_vs_decode(torch.ops.paged, pool, chunk, target_len)
    for got, how in ((by_context, "paged_ops.batch_invariant()"), (by_env, "PAGED_OPS_BATCH_INVARIANT=1")):
        assert_bits_equal(got[0], want[0], f"prefill row, {how}")
        assert_bits_equal(got[1], want[1], f"decode, {how}")


# ---------------------------------------------------------------------------------------------
# reshape_and_cache

RESHAPE_CONFIGS = [(None, None, F32, "NHD"), (None, None, BF16, "HND"), (None, None, F16, "NHD"),
                   (E4M3, "tensor", BF16, "NHD"), (E4M3, "head", F32, "HND"), (E5M2, "tensor", F16, "HND"),
                   (E5M2, "head", BF16, "NHD")]


@pytest.mark.parametrize("backend,cache_dtype,scale_kind,dtype,layout,block_size",
                         with_backends(RESHAPE_CONFIGS, (1, 3, 16)))
def test_reshape_and_cache(backend, cache_dtype, scale_kind, dtype, layout, block_size):
    """Bit-identical to the reference; padding tokens (slot -1) and slots not written stay NaN."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(block_size)
    cache_dtype = cache_dtype or dtype
    num_tokens, num_kv_heads, head_size = 20, 3, 80
    num_blocks = -(-num_tokens // block_size) + 3
    # Spread over many binades: fp8 subnormals, ties, and outliers past the fp8 max (saturation).
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g)
           * torch.exp(torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 6))
    key[0, 0, :4] = torch.tensor([1e9, -1e9, float("inf"), 1e-12])
    key = key.to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 40).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1  # padding tokens: skipped
    k_scale = v_scale = None
    if cache_dtype in FP8_DTYPES:
        n = 1 if scale_kind == "tensor" else num_kv_heads
        k_scale, v_scale = torch.rand(n, generator=g) * 0.1 + 0.02, torch.rand(n, generator=g) * 0.1 + 0.02
    want = [empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout) for _ in range(2)]
    got = [empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout, device) for _ in range(2)]
    reference.reshape_and_cache(key, value, *want, slots, k_scale, v_scale)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    paged_ops.backend(backend).reshape_and_cache(to(key), to(value), *got, to(slots), to(k_scale), to(v_scale))
    sync(device)
    for name, g_, w in zip(("key_cache", "value_cache"), got, want):
        assert_bits_equal(g_, w, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_strided_key_value(backend):
    # key/value as strided views of one fused buffer (rows of a qkv projection's output).
    device = device_of(backend)
    kv = torch.randn(6, 2, 4, 32, generator=torch.Generator().manual_seed(1))
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 5, 9, 2, 7, 11])
    want = [empty_cache(3, 4, 4, 32, F32) for _ in range(2)]
    got = [empty_cache(3, 4, 4, 32, F32, device=device) for _ in range(2)]
    reference.reshape_and_cache(key, value, *want, slots)
    kv = kv.to(device)
    paged_ops.backend(backend).reshape_and_cache(kv[:, 0], kv[:, 1], *got, slots.to(device), None, None)
    sync(device)
    for g_, w in zip(got, want):
        assert_bits_equal(g_, w)


# ---------------------------------------------------------------------------------------------
# concat_and_cache_mla: MLA's latent cache (one KV head, latent + RoPE part per row)

# (kv_lora_rank, rope_dim): DeepSeek's 512 + 64, a small one, one with no RoPE part, one whose
# two parts have the same width (a kernel that writes one part over the other cannot pass).
MLA_CONFIGS = [(None, F32, 512, 64), (None, BF16, 64, 16), (E4M3, BF16, 512, 64), (E5M2, F16, 32, 0),
               (E4M3, F32, 24, 24), (None, F16, 16, 8)]


@pytest.mark.parametrize("backend,cache_dtype,dtype,rank,rope_dim,block_size",
                         with_backends(MLA_CONFIGS, (1, 16, 64)))
def test_concat_and_cache_mla(backend, cache_dtype, dtype, rank, rope_dim, block_size):
    """Bit-identical to the reference; padding tokens (slot -1) and slots not written stay NaN."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(block_size + rank)
    cache_dtype = cache_dtype or dtype
    num_tokens = 21
    num_blocks = -(-num_tokens // block_size) + 2
    # fp8: values over many binades (subnormals, saturation past the fp8 max)
    latent = (torch.randn(num_tokens, rank, generator=g)
              * torch.exp(torch.randn(num_tokens, rank, generator=g) * 5)).to(dtype)
    rope = (torch.randn(num_tokens, rope_dim, generator=g) * 30).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::4] = -1
    scale = torch.rand(1, generator=g) * 0.1 + 0.02 if cache_dtype in FP8_DTYPES else None
    want = empty_cache(num_blocks, block_size, 1, rank + rope_dim, cache_dtype)
    got = empty_cache(num_blocks, block_size, 1, rank + rope_dim, cache_dtype, device=device)
    reference.concat_and_cache_mla(latent, rope, want, slots, scale)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    paged_ops.backend(backend).concat_and_cache_mla(to(latent), to(rope), got, to(slots), to(scale))
    sync(device)
    assert_bits_equal(got, want, "latent_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_concat_and_cache_mla_strided_rows_and_the_cache_as_attention_input(backend):
    """latent and rope as column slices of one projection output (as in DeepSeek's kv_a_proj);
    then the latent cache read by decode_attention as key_cache with its first kv_lora_rank
    columns as value_cache (absorbed MLA), against the reference on the same views."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(7)
    rank, rope_dim, block_size, num_heads = 64, 16, 16, 4
    kv = torch.randn(40, rank + rope_dim + 8, generator=g)  # [tokens, latent | rope | other]
    latent, rope = kv[:, :rank], kv[:, rank:rank + rope_dim]
    num_blocks = 5
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    pos = torch.arange(40)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    want = empty_cache(num_blocks, block_size, 1, rank + rope_dim, F32)
    got = empty_cache(num_blocks, block_size, 1, rank + rope_dim, F32, device=device)
    reference.concat_and_cache_mla(latent, rope, want, slots)
    kv_d = kv.to(device)
    paged_ops.backend(backend).concat_and_cache_mla(kv_d[:, :rank], kv_d[:, rank:rank + rope_dim], got,
                                                    slots.to(device), None)
    sync(device)
    assert_bits_equal(got, want, "latent_cache")
    assert torch.equal(got.cpu()[3, :, 0, :rank], latent[:16]) and torch.equal(got.cpu()[4, 7, 0, rank:], rope[39])


def test_concat_and_cache_mla_bad_inputs_name_the_argument():
    latent, rope = torch.randn(3, 64), torch.randn(3, 16)
    cache, slots = empty_cache(2, 4, 1, 80, F32), torch.tensor([0, 1, 2])
    op = torch.ops.paged.concat_and_cache_mla
    cases = [
        ((latent, torch.randn(3, 12), cache, slots, None), "rope: rope_dim"),
        ((torch.randn(3, 60), torch.randn(3, 20), cache, slots, None), "latent: kv_lora_rank"),
        ((latent, rope.half(), cache, slots, None), "rope dtype"),
        ((latent, rope[:2], cache, slots, None), "rope has 2 tokens"),
        ((latent, rope, empty_cache(2, 4, 2, 80, F32), slots, None), "one KV head"),
        ((latent, rope, empty_cache(2, 4, 1, 88, F32), slots, None), "latent_cache rows hold 88"),
        ((latent, rope, cache, torch.tensor([0, 1, 8]), None), "slot_mapping holds slot 8"),
        ((latent, rope, cache, slots.int(), None), "slot_mapping"),
        ((latent, rope, cache, slots, torch.ones(1)), "scale is only for fp8"),
        ((latent, rope, empty_cache(2, 4, 1, 80, E4M3), slots, None), "scale is required"),
        ((latent, rope, empty_cache(2, 4, 1, 80, E4M3), slots, torch.ones(2)), "scale must be one"),
        ((latent, rope, empty_cache(2, 4, 1, 80, F16), slots, None), "latent_cache dtype"),
        ((latent, rope, poison(torch.empty(2, 4, 1, 160))[..., ::2], slots, None), "latent_cache must be contiguous in its last"),
    ]
    for args, message in cases:
        before = args[2].clone()
        with pytest.raises(ValueError, match=message):
            op(*args)
        assert_bits_equal(args[2], before, f"written despite the error ({message})")
    overlapping = torch.randn(2, 4, 1, 80)
    with pytest.raises(ValueError, match="latent_cache overlaps latent"):
        op(overlapping.view(8, 80)[:3, :64], rope, overlapping, slots, None)


# ---------------------------------------------------------------------------------------------
# quantize_fp8 / dequantize_fp8

def fp8_probe(dtype: torch.dtype, fp8: torch.dtype) -> torch.Tensor:
    """Every finite fp8 value, every midpoint between neighbours (ties: round-to-even) with its two
    float32 neighbours, out-of-range values and infinities (saturate), zeros of both signs, tiny
    values, random values over many binades and random bit patterns; no NaN (see
    test_quantize_fp8_nan_inputs)."""
    g = torch.Generator().manual_seed(5)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].unique()
    mids = ((values[1:].double() + values[:-1].double()) / 2).float()
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    special = torch.tensor([1e9, -1e9, float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30])
    spread = torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * 5)
    probe = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), special, spread])
    patterns = torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    patterns = patterns.view(F32) if dtype == F32 else patterns.view(torch.int16).view(dtype)  # 16-bit patterns too
    patterns = patterns[~patterns.isnan()]
    n = 19000 + (5 - probe.numel() - 19000) % 8  # a length of 5 mod 8: vector loops leave scalar tails
    return torch.cat([probe.to(dtype), patterns[:n]])


def nan_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Quiet NaNs of both signs with random payloads, torch's own NaN among them."""
    g = torch.Generator().manual_seed(9)
    width, exp_bits = {F32: (32, 8), F16: (16, 5), BF16: (16, 8)}[dtype]
    mant = width - 1 - exp_bits
    payload = torch.randint(0, 1 << mant, (64,), generator=g, dtype=torch.int64) | (1 << (mant - 1))  # quiet bit
    sign = torch.randint(0, 2, (64,), generator=g, dtype=torch.int64) << (width - 1)
    raw = sign | (((1 << exp_bits) - 1) << mant) | payload
    if width == 16:
        x = raw.to(torch.int32).to(torch.int16).view(dtype)
    else:
        x = raw.to(torch.int32).view(F32)
    return torch.cat([torch.tensor([float("nan"), -float("nan")], dtype=dtype), x])


def quantize(backend, x, fp8, scale_value=0.37):
    device = device_of(backend)
    scale = torch.tensor([scale_value])
    want = torch.empty(x.shape, dtype=fp8)
    reference.quantize_fp8(want, x, scale)
    got = torch.zeros(x.shape, dtype=fp8, device=device)
    paged_ops.backend(backend).quantize_fp8(got, x.to(device), scale.to(device))
    sync(device)
    return got.cpu(), want


@pytest.mark.parametrize("backend,fp8", with_backends(FP8_DTYPES))
def test_quantize_fp8_float32_nan_inputs(backend, fp8):
    """A float32 NaN gives the reference's (torch's cast's) NaN byte, sign included."""
    got, want = quantize(backend, nan_inputs(F32), fp8)
    assert_bits_equal(got, want)


@pytest.mark.parametrize("backend,dtype,fp8", with_backends((F16, BF16), FP8_DTYPES))
def test_quantize_fp8_16bit_nan_inputs(backend, dtype, fp8):
    """A 16-bit NaN gives an fp8 NaN. Its sign is not compared: torch's own fp16/bf16 -> float32
    conversion keeps it in vectorized loops and drops it in their scalar tails."""
    got, want = quantize(backend, nan_inputs(dtype), fp8)
    assert want.float().isnan().all()
    assert got.float().isnan().all(), got.view(torch.uint8)[~got.float().isnan()].tolist()


@pytest.mark.parametrize("backend,dtype,fp8", with_backends(DTYPES, FP8_DTYPES))
def test_quantize_dequantize(backend, dtype, fp8):
    """quantize: the reference's bytes exactly (saturating, round-to-nearest-even, NaN stays NaN);
    dequantize: its bits exactly, except that a NaN's payload is not part of the contract."""
    device = device_of(backend)
    ops = paged_ops.backend(backend)
    x = fp8_probe(dtype, fp8)
    for scale_value in (1.0, 0.37, 3e-3, 3.7):
        scale = torch.tensor([scale_value])
        want = torch.empty(x.shape, dtype=fp8)
        reference.quantize_fp8(want, x, scale)
        got = poison(torch.empty(x.shape, dtype=fp8, device=device))
        ops.quantize_fp8(got, x.to(device), scale.to(device))
        sync(device)
        assert_bits_equal(got, want, f"quantize {dtype}->{fp8} scale {scale_value}")

        back_want = torch.empty(x.shape, dtype=dtype)
        reference.dequantize_fp8(back_want, want, scale)
        back = nan_like(torch.empty(x.shape, dtype=dtype, device=device))
        ops.dequantize_fp8(back, want.to(device), scale.to(device))
        sync(device)
        nan = back_want.isnan()
        assert torch.equal(back.isnan().cpu(), nan), f"dequantize {fp8}->{dtype}: NaN positions"
        assert torch.equal(bits(back)[~nan], bits(back_want)[~nan]), f"dequantize {fp8}->{dtype} scale {scale_value}"


# ---------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks

def moved(cache: torch.Tensor, device, layout: str) -> torch.Tensor:
    """The cache on device with its layout (an HND cache stays head-major in memory)."""
    if layout == "NHD":
        return cache.to(device)
    return cache.transpose(1, 2).contiguous().to(device).transpose(1, 2)


def random_cache(num_blocks, block_size, heads, head_size, dtype, layout, g, device="cpu"):
    c = empty_cache(num_blocks, block_size, heads, head_size, dtype, layout)
    c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return moved(c, device, layout)


@pytest.mark.parametrize("backend,dtype,block_size",
                         with_backends([(F32, 4), (BF16, 16), (E4M3, 4), (F16, 16), (E5M2, 3), (F32, 1)]))
def test_copy_blocks(backend, dtype, block_size):
    """Every (src, dst) pair in every layer: NHD and HND layers and a non-dense view (every other
    head of a wider cache, whose other heads must stay untouched)."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(7)
    num_blocks, heads, head_size = 10, 2, 24
    wide = torch.randn(num_blocks, block_size, 2 * heads, head_size, generator=g).to(dtype).to(device)
    key_caches = [random_cache(num_blocks, block_size, heads, head_size, dtype, "NHD", g, device),
                  random_cache(num_blocks, block_size, heads, head_size, dtype, "HND", g, device), wide[:, :, ::2]]
    value_caches = [random_cache(num_blocks, block_size, heads, head_size, dtype, lay, g, device)
                    for lay in ("NHD", "HND", "NHD")]
    want = [c.cpu().clone() for c in key_caches + value_caches]
    wide_before = wide.clone()
    mapping = torch.tensor([[0, 5], [3, 7], [0, 9]])
    reference.copy_blocks(want[:3], want[3:], mapping)
    paged_ops.backend(backend).copy_blocks(key_caches, value_caches, mapping.to(device))
    sync(device)
    for got, w in zip(key_caches + value_caches, want):
        assert_bits_equal(got, w)
    assert_bits_equal(wide[:, :, 1::2], wide_before[:, :, 1::2], "unselected heads of the strided view")


@pytest.mark.parametrize("backend,layout", with_backends(("NHD", "HND")))
def test_copy_blocks_layers_of_different_dtypes(backend, layout):
    device = device_of(backend)
    g = torch.Generator().manual_seed(2)
    kcs, vcs = [], []
    for dt in (F16, E4M3, F32):
        for caches in (kcs, vcs):
            c = empty_cache(8, 3, 2, 24, dt, layout)
            c.view(torch.uint8).copy_(torch.randint(0, 120, c.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
            caches.append(c)
    mapping = torch.tensor([[0, 5], [2, 6], [1, 7]])
    want_k, want_v = [c.clone() for c in kcs], [c.clone() for c in vcs]
    reference.copy_blocks(want_k, want_v, mapping)
    kcs, vcs = [moved(c, device, layout) for c in kcs], [moved(c, device, layout) for c in vcs]
    paged_ops.backend(backend).copy_blocks(kcs, vcs, mapping.to(device))
    sync(device)
    for a, b in zip(kcs + vcs, want_k + want_v):
        assert_bits_equal(a, b)


SWAP_CONFIGS = [(F16, "NHD", "NHD"), (BF16, "NHD", "HND"), (E4M3, "HND", "NHD"), (E5M2, "HND", "HND"),
                (F32, "NHD", "NHD")]


@pytest.mark.parametrize("backend,dtype,src_layout,dst_layout", with_backends(SWAP_CONFIGS))
def test_swap_blocks(backend, dtype, src_layout, dst_layout):
    """Whole blocks between two caches; on a GPU also device -> host and host -> device. Blocks
    outside the mapping stay as they were (NaN)."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(8)
    src = random_cache(6, 3, 2, 16, dtype, src_layout, g)
    mapping = torch.tensor([[1, 6], [4, 0], [5, 3]])  # on the CPU, as the contract says
    want = empty_cache(7, 3, 2, 16, dtype, dst_layout)
    reference.swap_blocks(src, want, mapping)
    directions = [(device, device)] + ([("cuda", "cpu"), ("cpu", "cuda")] if device == "cuda" else [])
    for src_device, dst_device in directions:
        dst = empty_cache(7, 3, 2, 16, dtype, dst_layout, dst_device)
        paged_ops.backend(backend).swap_blocks(moved(src, src_device, src_layout), dst, mapping)
        sync(device)
        assert_bits_equal(dst, want, f"{src_device} -> {dst_device}")
        assert torch.isnan(dst[1].float()).all(), "a block outside the mapping was written"

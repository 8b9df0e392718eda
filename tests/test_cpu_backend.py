"""What is specific to the cpu backend: the split-KV path its thread scheduling takes, and bit
probes of its vectorized (AVX2/F16C) fp8 code. The op contract over the full grid runs in
tests/test_ops.py."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import FP8_DTYPES as FP8
from paged_ops.testing import (assert_bits_equal, assert_close, empty_cache, make_case, nan_like, poison,
                               random_tensor)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

cpu = paged_ops.backend("cpu")


@pytest.mark.parametrize("num_seqs,seq_len,dtype", [(1, 3000, torch.float32), (1, 2500, torch.bfloat16),
                                                    (2, 1800, torch.float16)])
def test_decode_split_path(num_seqs, seq_len, dtype):
    # One or two sequences with one KV head cannot occupy the threads: the KV gets split and
    # the partial results merged by log-sum-exp (work above the kernel's threshold for threads).
    assert torch.get_num_threads() > 1, "the split path needs more than one thread"
    case = make_case([seq_len - i * 7 for i in range(num_seqs)], num_heads=8, num_kv_heads=1, head_size=128,
                     block_size=16, dtype=dtype)
    out = nan_like(case.query)
    cpu.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_decode(), case.dtype)


# --- fp8 bit probes -------------------------------------------------------------------


# The fp8 quantization is vectorized (AVX2, 8 or 32 lanes, scalar tail): every input below goes
# through it and must give the reference's bytes exactly, NaN bytes included (0x7F | sign, as
# torch's cast). Scales: 1 and 2^-5 take the multiply-by-exact-reciprocal path, 0.37 and 3 the
# true division, 1e-40 (a subnormal: its reciprocal overflows) the division too.
QUANT_SCALES = (1.0, 0.37, 2.0 ** -5, 3.0, 1e-40)


def every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 fp16 or bf16 bit patterns: zeros, subnormals, normals, infinities, NaNs."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def fp8_rounding_probes(fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 values at every fp8 grid point and every rounding tie between neighbours (the
    one above the largest finite value too), each with its float32 neighbours, both signs, plus
    +-inf."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].double().unique()  # ascending, 0 included
    step = grid[-1] - grid[-2]
    ties = torch.cat([(grid[1:] + grid[:-1]) / 2, grid[-1:] + step / 2])  # exact in float32
    v = torch.cat([grid, ties]).float()
    v = torch.cat([v, torch.nextafter(v, torch.full_like(v, math.inf)), torch.nextafter(v, torch.zeros_like(v))])
    v = torch.cat([v, -v, torch.tensor([math.inf, -math.inf])])
    return v


def random_fp32_probes(n: int = 1 << 18) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2 ** 31), 2 ** 31, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    normal = torch.randn(n, generator=g) * torch.logspace(-12, 6, n, base=2.0)[torch.randperm(n, generator=g)]
    return torch.cat([bits.view(torch.float32), normal])


def quantize_both(x: torch.Tensor, fp8_dtype: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.tensor([scale], dtype=torch.float32)
    got, want = poison(torch.empty_like(x, dtype=fp8_dtype)), poison(torch.empty_like(x, dtype=fp8_dtype))
    cpu.quantize_fp8(got, x, s)
    reference.quantize_fp8(want, x, s)
    return got.view(torch.uint8), want.view(torch.uint8)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} bytes differ, e.g. input {x.flatten()[bad[:4]].tolist()} "
                              f"(bits {[hex(b) for b in x.flatten()[bad[:4]].float().view(torch.int32).tolist()]}): "
                              f"got {got.flatten()[bad[:4]].tolist()}, want {want.flatten()[bad[:4]].tolist()}")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("scale", QUANT_SCALES)
def test_quantize_fp8_every_16bit_input(fp8_dtype, dtype, scale):
    x = every_16bit_value(dtype)
    x = torch.cat([x, x[12345:12345 + 13]])  # 65549: a length that leaves an 8-lane and a scalar tail
    got, want = quantize_both(x, fp8_dtype, scale)
    assert_same_bytes(got, want, x)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("scale", QUANT_SCALES)
def test_quantize_fp8_fp32_ties_and_random(fp8_dtype, scale):
    ties = fp8_rounding_probes(fp8_dtype)
    # scaled so that x / scale lands on the ties again (exact for these scales but 0.37 and 1e-40)
    x = torch.cat([ties * scale if scale != 1e-40 else ties, random_fp32_probes()])
    got, want = quantize_both(x, fp8_dtype, scale)
    assert_same_bytes(got, want, x)

def test_fp8_rounding_probes_hit_the_ties():
    for fp8_dtype in FP8:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
        grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # byte k is grid[k]
        n = grid.numel()
        ties = fp8_rounding_probes(fp8_dtype)[n:2 * n - 1]  # the n - 1 ties between neighbours
        assert torch.equal(ties.double(), (grid[1:].double() + grid[:-1].double()) / 2)
        got, _ = quantize_both(ties, fp8_dtype, 1.0)
        assert (got & 1 == 0).all(), "a tie must round to the even mantissa"
        k = torch.arange(n - 1)
        assert ((got == k) | (got == k + 1)).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_fp8_every_byte(fp8_dtype, dtype):
    """Every fp8 byte, times scales that keep it exact, round it, overflow fp16 or make fp16/bf16
    subnormals, into each float dtype: the reference's bits exactly (NaN: NaN, either sign)."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)[:-5].view(fp8_dtype)  # 763: tails
    for scale in (1.0, 0.37, 1e6, 3e-35, 2.0 ** -20, 1 + 2.0 ** -8, 1 + 2.0 ** -11):  # the last two: ties
        s = torch.tensor([scale])
        got, want = nan_like(q.float()).to(dtype), nan_like(q.float()).to(dtype)
        cpu.dequantize_fp8(got, q, s)
        reference.dequantize_fp8(want, q, s)
        both_nan = got.isnan() & want.isnan()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        same = got.view(bits) == want.view(bits)
        assert (same | both_nan).all(), (scale, q.view(torch.uint8)[~(same | both_nan)][:4].tolist(),
                                         got[~(same | both_nan)][:4].tolist(), want[~(same | both_nan)][:4].tolist())


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_fp8_every_input(fp8_dtype, dtype):
    """Every 16-bit pattern (fp16/bf16) or the fp32 probes as K and V rows, per-head scales that
    take both the division and the exact-reciprocal paths, head_size 40 (a 32-lane step + an
    8-lane step per row)."""
    if dtype == torch.float32:
        x = torch.cat([fp8_rounding_probes(fp8_dtype), random_fp32_probes(1 << 14)])
    else:
        x = every_16bit_value(dtype)
    kvh, d, block_size = 4, 40, 16
    tokens = -(-x.numel() // (kvh * d))
    x = torch.cat([x, x[: tokens * kvh * d - x.numel()]]).view(tokens, kvh, d)
    num_blocks = -(-tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(7))[:tokens]
    k_scale, v_scale = torch.tensor([0.37, 1.0, 2.0 ** -5, 3.0]), torch.tensor([1.0, 1e-40, 0.37, 2.0 ** 7])
    got = [empty_cache(num_blocks, block_size, kvh, d, fp8_dtype) for _ in range(2)]
    want = [empty_cache(num_blocks, block_size, kvh, d, fp8_dtype) for _ in range(2)]
    value = x.flip(0)
    cpu.reshape_and_cache(x, value, *got, slots, k_scale, v_scale)
    reference.reshape_and_cache(x, value, *want, slots, k_scale, v_scale)
    for g, w in zip(got, want):
        assert_same_bytes(g.view(torch.uint8), w.view(torch.uint8), g)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_attention_reads_every_fp8_value(fp8_dtype):
    """Every finite fp8 byte pattern (normals, subnormals, both zeros) as K and V, widened exactly."""
    finite = [b for b in range(256) if torch.isfinite(torch.tensor([b], dtype=torch.uint8).view(fp8_dtype).float())]
    num_blocks, block_size, kvh, d = 4, 16, 1, 64
    pattern = torch.tensor(finite, dtype=torch.uint8).repeat(num_blocks * block_size * d // len(finite) + 1)
    kc = pattern[: num_blocks * block_size * kvh * d].view(num_blocks, block_size, kvh, d).view(fp8_dtype)
    vc = pattern.roll(17)[: kc.numel()].view(kc.shape).view(fp8_dtype)
    # Scales keep e5m2's 57344 from dominating every softmax row.
    k_scale, v_scale = torch.tensor([1 / 4096]), torch.tensor([1 / 512])
    q = torch.randn(2, 4, d)  # float32: its 1e-5 budget catches a widening off by one part in 256
    tables = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([64, 50], dtype=torch.int32)
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    cpu.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5, k_scale, v_scale)
    reference.decode_attention(ref, q.double(), kc, vc, tables, lens, d ** -0.5, k_scale, v_scale)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("fp8_dtype,byte", [(torch.float8_e4m3fn, 0x7F), (torch.float8_e4m3fn, 0xFF),
                                            (torch.float8_e5m2, 0x7C), (torch.float8_e5m2, 0xFC),
                                            (torch.float8_e5m2, 0x7E)])
@pytest.mark.parametrize("which", ["k", "v"])
def test_attention_fp8_nan_and_inf_bytes(fp8_dtype, byte, which):
    """One NaN (e4m3fn 0x7F/0xFF, e5m2 0x7E) or infinity (e5m2 0x7C/0xFC) byte among finite ones:
    its tile takes the exact widening (e4m3fn tiles without NaN bytes skip the NaN fix-up), and the
    rows that see it are NaN (a NaN or +inf score, a NaN V) or inf exactly where the reference's
    are. First, middle and last tile positions; 600 tokens split the sequence's KV across tasks."""
    num_blocks, block_size, kvh, d, kv_head = 80, 16, 2, 64, 1
    gen = torch.Generator().manual_seed(byte)
    for seq_len, pos in ((40, 0), (40, 39), (600, 300), (600, 599)):
        kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(fp8_dtype)
        vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(fp8_dtype)
        (kc if which == "k" else vc).view(torch.uint8)[pos // block_size, pos % block_size, kv_head, 5] = byte
        tables = torch.arange(num_blocks, dtype=torch.int32).view(2, 40)
        lens = torch.tensor([seq_len, 40], dtype=torch.int32)
        q = torch.randn(2, 8, d, generator=gen)
        scale = torch.tensor([0.5])
        out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
        cpu.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5, scale, scale)
        reference.decode_attention(ref, q.double(), kc, vc, tables, lens, d ** -0.5, scale, scale)
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan), (seq_len, pos, out.isnan().any(-1), nan.any(-1))
        if byte in (0x7F, 0xFF, 0x7E):  # a NaN: every head of the KV head's group sees it
            assert nan[0, kv_head * 4:].any(-1).all() and not nan[:, :kv_head * 4].any() and not nan[1].any()
        assert torch.equal(out.isinf(), ref.isinf()), (seq_len, pos)
        finite = ref.isfinite().all(-1)
        assert_close(out[finite], ref[finite], torch.float32)


@pytest.mark.parametrize("seq_len", [40, 600])  # 600: the sequence's KV is split across tasks
def test_attention_all_minus_inf_keys_give_empty_rows_like_the_reference(seq_len):
    """Every visible K element -inf (e5m2 0xFC): every score is -inf, the row's lse -inf, and the
    reference's probabilities 0 there (#27: an empty row is 0, not (-inf) - (-inf) = NaN)."""
    num_blocks, block_size, kvh, d = 80, 16, 2, 64
    gen = torch.Generator().manual_seed(seq_len)
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(torch.float8_e5m2)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(torch.float8_e5m2)
    kc.view(torch.uint8)[:, :, 1] = 0xFC  # KV head 1 only
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, 40)
    lens = torch.tensor([seq_len, 40], dtype=torch.int32)
    q = torch.rand(2, 8, d, generator=gen) + 0.5  # q > 0: every score is -inf, none NaN
    scale = torch.tensor([0.5])
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    cpu.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5, scale, scale)
    reference.decode_attention(ref, q.double(), kc, vc, tables, lens, d ** -0.5, scale, scale)
    assert (ref[:, 4:] == 0).all() and not ref.isnan().any()
    assert (out[:, 4:] == 0).all()
    assert_close(out, ref, torch.float32)


# --- attention variants (#13): the cpu core's own paths ---------------------------------------
# tests/test_ops.py holds the contract grid for every backend; here: the split-KV merge with the
# variants, the window skipping unseen blocks, the batch-invariant mode's thread counts and its
# two ways of folding chunks (in one task, or as tasks of their own merged after), on every ISA
# (the isa fixture, tests/conftest.py).


def variant_kwargs(num_heads, softcap=0.0, window_left=-1, sinks=False, alibi=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(softcap=softcap, window_left=window_left)
    if sinks:
        kw["sinks"] = torch.randn(num_heads, generator=g) * 2
    if alibi:
        kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.1
    return kw


def reference_rows(case, kw, causal=True, decode=False):
    """The float64 reference's out and lse for the case's query rows."""
    ref = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    kw = {k: v for k, v in kw.items() if k != "batch_invariant"}
    if decode:
        reference.decode_attention(ref, case.query.double(), case.key_cache, case.value_cache, case.block_tables,
                                   case.seq_lens, case.scale, case.k_scale, case.v_scale, lse=lse, **kw)
    else:
        reference.prefill_attention(ref, case.query.double(), case.key_cache, case.value_cache, case.block_tables,
                                    case.cu_seqlens_q, case.seq_lens, case.max_seqlen_q, case.scale, causal,
                                    case.k_scale, case.v_scale, lse=lse, **kw)
    return ref, lse


def run_cpu(case, kw, causal=True, decode=False):
    out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
    if decode:
        cpu.decode_attention(*case.decode_args(out), lse=lse, **kw)
    else:
        cpu.prefill_attention(*case.prefill_args(out, causal), lse=lse, **kw)
    return out, lse


def assert_lse(lse, ref_lse):
    # Each lse is ln of a sum of exps computed in fp32 with fp64 sums, whatever the query dtype.
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ref_lse.isfinite()
    assert finite.any()
    err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
    assert err <= 1e-5 * (1 + ref_lse[finite].abs().max().item()), f"lse off by {err:.3g}"


SPLIT_VARIANTS = [dict(softcap=2.0), dict(window_left=300), dict(sinks=True), dict(alibi=True),
                  dict(softcap=1.5, window_left=700, sinks=True, alibi=True)]


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("var", SPLIT_VARIANTS, ids=lambda v: "+".join(v))
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, torch.float8_e4m3fn)])
def test_variants_decode_split_path(var, dtype, cache_dtype, batch_invariant):
    # One sequence with one KV head and two threads: its KV is split across tasks (plain mode:
    # >= 256-token splits; batch-invariant mode: 512-token chunks), so the sink must be counted
    # once in the merge, and the lse comes out of the merge. The short second sequence never splits.
    assert torch.get_num_threads() > 1, "the split path needs more than one thread"
    case = make_case([3000, 9], num_heads=8, num_kv_heads=1, head_size=128, block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, scale_kind="head")
    kw = dict(variant_kwargs(8, seed=1, **var), batch_invariant=batch_invariant)
    out, lse = run_cpu(case, kw, decode=True)
    ref, ref_lse = reference_rows(case, kw, decode=True)
    assert_close(out, ref, dtype)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("var", SPLIT_VARIANTS, ids=lambda v: "+".join(v))
def test_variants_prefill_long(var, causal, batch_invariant):
    # A long chunked prefill (query tiles of 64 / group rows, each with its own window range) next
    # to decode rows and a sequence with no query rows; GQA group 3; fp8 e5m2 cache.
    case = make_case([1900, 620, 40, 1], q_lens=[150, 1, 0, 1], num_heads=6, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=torch.float16, cache_dtype=torch.float8_e5m2, seed=3)
    kw = dict(variant_kwargs(6, seed=2, **var), batch_invariant=batch_invariant)
    out, lse = run_cpu(case, kw, causal=causal)
    ref, ref_lse = reference_rows(case, kw, causal=causal)
    assert_close(out, ref, torch.float16)
    assert_lse(lse, ref_lse)


def test_sink_without_visible_keys_and_minus_inf_sink():
    # Every key -inf (e5m2 0xFC, scores -inf): no sink -> 0 and lse -inf; a sink -> 0 and lse = sink,
    # also through the split merge (600 tokens); a sink of -inf is no sink.
    num_blocks, block_size, d = 80, 16, 64
    kc = torch.full((num_blocks, block_size, 1, d), 1.0).to(torch.float8_e5m2)
    kc.view(torch.uint8).fill_(0xFC)
    vc = torch.randn(num_blocks, block_size, 1, d).to(torch.float8_e5m2)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, 40)
    lens = torch.tensor([600, 40], dtype=torch.int32)
    q = torch.rand(2, 4, d) + 0.5  # q > 0: every score -inf
    scale = torch.tensor([0.5])
    sinks = torch.tensor([0.5, -3.0, float("-inf"), 2.0])
    out, lse = nan_like(q), poison(torch.empty(2, 4))
    cpu.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5, scale, scale, sinks=sinks, lse=lse)
    assert (out == 0).all()
    assert torch.equal(lse, sinks.expand(2, 4))


# --- the window skips what it cannot see --------------------------------------------------------

def poison_outside(case, keep):
    """A copy of the case whose caches hold NaN wherever the kernel must not read: each sequence s
    keeps positions keep[s] = (lo, hi) and its blocks wholly outside point at a spare NaN block."""
    bs = case.key_cache.shape[1]
    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    nan_block = kc.shape[0]  # one more block, all NaN
    kc = torch.cat([kc, poison(kc[:1].clone())])
    vc = torch.cat([vc, poison(vc[:1].clone())])
    tables = case.block_tables.clone()
    for s, (lo, hi) in enumerate(keep):
        n = int(case.seq_lens[s])
        for pos in range(n):
            if lo <= pos <= hi:
                continue
            b = int(tables[s, pos // bs])
            if b == nan_block:
                continue
            if pos // bs < lo // bs or pos // bs > hi // bs:
                tables[s, pos // bs] = nan_block
            else:
                poison(kc[b, pos % bs]), poison(vc[b, pos % bs])
    return replace(case, key_cache=kc, value_cache=vc, block_tables=tables)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("block_size,window_left", [(16, 100), (16, 0), (7, 45), (1, 33)])
def test_window_reads_only_the_window_decode(block_size, window_left, batch_invariant):
    """Decode with a window: every key outside [p - window_left, p] is NaN (K and V; blocks wholly
    outside swapped for a NaN block): a kernel that read any of them (even with probability 0:
    0 * NaN) would give NaN. Long enough to split (plain mode) and to cross chunks (the mode)."""
    lens = [3000, 1100, 60]
    case = make_case(lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=block_size, dtype=torch.float32)
    kw = dict(window_left=window_left, sinks=torch.randn(4), batch_invariant=batch_invariant)
    ref, ref_lse = reference_rows(case, kw, decode=True)
    blind = poison_outside(case, [(max(0, n - 1 - window_left), n - 1) for n in lens])
    out, lse = run_cpu(blind, kw, decode=True)
    assert_close(out, ref, torch.float32)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_window_reads_only_the_window_prefill(causal, batch_invariant):
    # A 90-row chunk at the end of 2500 tokens, window 200: nothing before the first row's window
    # is read (and with causal, nothing after the last position, as always).
    lens, q_lens, window = [2500, 300], [90, 1], 200
    case = make_case(lens, q_lens, num_heads=4, num_kv_heads=1, head_size=64, block_size=16, dtype=torch.float32)
    kw = dict(window_left=window, alibi_slopes=torch.rand(4) * 0.05, batch_invariant=batch_invariant)
    ref, ref_lse = reference_rows(case, kw, causal=causal)
    keep = [(n - q - window, n - 1) for n, q in zip(lens, q_lens)]
    out, lse = run_cpu(poison_outside(case, keep), kw, causal=causal)
    assert_close(out, ref, torch.float32)
    assert_lse(lse, ref_lse)


# --- batch-invariant mode -------------------------------------------------------------------------

BI_VARIANTS = [dict(), dict(softcap=1.5, window_left=1300, sinks=True, alibi=True)]


def bi_pool(dtype, cache_dtype=None):
    # Sequence 0 is the target (2600 tokens: 6 chunks of 512); the others are neighbours.
    return make_case([2600, 3100, 37, 1, 1500, 700], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=dtype, cache_dtype=cache_dtype, seed=5)


def decode_row(pool, query, seq_len, kw):
    """Decode of the target sequence (pool row 0) at kv length seq_len with one query row."""
    out, lse = nan_like(query[None]), poison(torch.empty(1, query.shape[0]))
    cpu.decode_attention(out, query[None], pool.key_cache, pool.value_cache, pool.block_tables[:1],
                         torch.tensor([seq_len], dtype=torch.int32), pool.scale, pool.k_scale, pool.v_scale,
                         lse=lse, **kw)
    return out[0], lse[0]


@pytest.mark.parametrize("var", BI_VARIANTS, ids=["plain", "all"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, None), (torch.float16, torch.float8_e4m3fn)])
def test_batch_invariant_threads_and_batches(isa, threads, var, dtype, cache_dtype):
    """The target's decode row: bitwise the same alone or in batches (which change how many tasks
    there are, so whether its chunks run as tasks of their own or folded in one task), with 1, 2
    and 3 threads; and right."""
    pool = bi_pool(dtype, cache_dtype)
    kw = dict(variant_kwargs(8, seed=4, **var), batch_invariant=True)
    mixes = [[0], [0, 1], [2, 0, 3], [4, 5, 1, 0, 2, 3], [0] + [1, 4, 5] * 6]
    want = None
    for n in (1, 2, 3):
        threads(n)
        for rows in mixes:
            r = torch.tensor(rows)
            out, lse = nan_like(pool.query[r]), poison(torch.empty(len(rows), 8))
            cpu.decode_attention(out, pool.query[r], pool.key_cache, pool.value_cache, pool.block_tables[r],
                                 pool.seq_lens[r], pool.scale, pool.k_scale, pool.v_scale, lse=lse, **kw)
            got = (out[rows.index(0)], lse[rows.index(0)])
            if want is None:
                want = got
                sub = replace_rows(pool, [0])
                ref, ref_lse = reference_rows(sub, kw, decode=True)
                assert_close(got[0][None], ref, dtype)
                assert_lse(got[1][None], ref_lse)
            assert_bits_equal(got[0], want[0], f"out, {n} threads, batch {rows}")
            assert_bits_equal(got[1], want[1], f"lse, {n} threads, batch {rows}")


def replace_rows(case, rows):
    r = torch.tensor(rows)
    cu = torch.arange(len(rows) + 1, dtype=torch.int32)
    return replace(case, query=case.query[r], block_tables=case.block_tables[r], seq_lens=case.seq_lens[r],
                   cu_seqlens_q=cu)


@pytest.mark.parametrize("var", BI_VARIANTS, ids=["plain", "all"])
def test_batch_invariant_prefill_rows_equal_decode_at_chunk_edges(isa, threads, var):
    """Rows of causal prefills of q_len 1..130 (tiles of 16 rows at group 4, spanning chunk edges at
    multiples of 512) == decode at each row's position, bitwise, with 1 and 3 threads: the decode
    splits its chunks over tasks, the prefill tile folds them in one task."""
    pool = bi_pool(torch.bfloat16)
    kw = dict(variant_kwargs(8, seed=6, **var), batch_invariant=True)
    g = torch.Generator().manual_seed(9)
    target_len = 1537  # positions 1407..1536 cross the chunk edge at 1536 and the tile edges
    rows = random_tensor((130, 8, 128), torch.bfloat16, g)
    decoded = {}
    for n in (1, 3):
        threads(n)
        for q_len in (1, 2, 17, 130):
            q = rows[130 - q_len:]
            # with a neighbour's decode row before and a neighbour's prefill chunk after
            query = torch.cat([pool.query[1:2], q, random_tensor((20, 8, 128), torch.bfloat16, g)])
            cu = torch.tensor([0, 1, 1 + q_len, 21 + q_len], dtype=torch.int32)
            lens = torch.tensor([3100, target_len, 700], dtype=torch.int32)
            table = pool.block_tables[torch.tensor([1, 0, 5])]
            out, lse = nan_like(query), poison(torch.empty(query.shape[:2]))
            cpu.prefill_attention(out, query, pool.key_cache, pool.value_cache, table, cu, lens, q_len + 20,
                                  pool.scale, True, pool.k_scale, pool.v_scale, lse=lse, **kw)
            for i in range(q_len):
                position = target_len - q_len + i
                if position not in decoded:
                    decoded[position] = decode_row(pool, q[i], position + 1, kw)
                assert_bits_equal(out[1 + i], decoded[position][0], f"q_len {q_len} row {i}, {n} threads")
                assert_bits_equal(lse[1 + i], decoded[position][1], f"q_len {q_len} row {i} lse, {n} threads")
    sub = replace_rows(pool, [0])
    sub = replace(sub, query=rows[-1:], seq_lens=torch.tensor([target_len], dtype=torch.int32))
    ref, ref_lse = reference_rows(sub, kw, decode=True)
    assert_close(decoded[target_len - 1][0][None], ref, torch.bfloat16)


def test_batch_invariant_off_is_the_plain_path_and_both_are_right():
    # The mode changes the schedule, not the values beyond rounding: both match the reference.
    case = make_case([2600, 50], num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.float32, seed=8)
    kw = variant_kwargs(8, softcap=3.0, sinks=True, seed=8)
    ref, ref_lse = reference_rows(case, kw, decode=True)
    for mode in (False, True):
        out, lse = run_cpu(case, dict(kw, batch_invariant=mode), decode=True)
        assert_close(out, ref, torch.float32)
        assert_lse(lse, ref_lse)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_variants_on_every_isa(isa, batch_invariant):
    # Every variant at once through each ISA build's kernels: a split decode, a windowed prefill
    # with GQA, fp8 e4m3 (its NaN-free fast widening) and the window skip.
    for causal in (True, False):
        case = make_case([2300, 700, 5], q_lens=[1, 70, 5], num_heads=8, num_kv_heads=2, head_size=80,
                         block_size=16, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn, seed=11)
        kw = dict(variant_kwargs(8, softcap=1.5, window_left=600, sinks=True, alibi=True, seed=12),
                  batch_invariant=batch_invariant)
        out, lse = run_cpu(case, kw, causal=causal)
        ref, ref_lse = reference_rows(case, kw, causal=causal)
        assert_close(out, ref, torch.bfloat16, f"{isa}, causal={causal}")
        assert_lse(lse, ref_lse)


def test_softcap_both_tanh_branches_and_infinite_scores(isa):
    # Scores up to ~+-60 against caps 0.5..30 take both branches of the vectorized tanh (below and
    # above |s / cap| = 0.625); keys of -inf / +inf (e5m2 0xFC / 0x7C) give scores -inf / +inf,
    # which the cap makes -cap / +cap (finite), as in the reference.
    for cap in (0.5, 1.5, 30.0):
        case = make_case([300, 41], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=13)
        case.query.mul_(8)
        out, lse = run_cpu(case, dict(softcap=cap), decode=True)
        ref, ref_lse = reference_rows(case, dict(softcap=cap), decode=True)
        assert_close(out, ref, torch.float32, f"{isa}, cap {cap}")
        assert_lse(lse, ref_lse)
    kc = torch.randn(4, 16, 1, 64).to(torch.float8_e5m2)
    vc = torch.randn(4, 16, 1, 64).to(torch.float8_e5m2)
    kc.view(torch.uint8)[0, :5] = 0xFC
    kc.view(torch.uint8)[1, 3:9] = 0x7C
    q = torch.rand(1, 4, 64) + 0.5  # q > 0: those keys score -inf / +inf
    tables, lens, scale = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32), torch.tensor([60], dtype=torch.int32), torch.tensor([0.5])
    out, ref = nan_like(q), torch.empty(q.shape, dtype=torch.float64)
    cpu.decode_attention(out, q, kc, vc, tables, lens, 0.125, scale, scale, softcap=2.0)
    reference.decode_attention(ref, q.double(), kc, vc, tables, lens, 0.125, scale, scale, softcap=2.0)
    assert_close(out, ref, torch.float32, isa)

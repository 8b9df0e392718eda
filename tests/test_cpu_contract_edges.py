"""Issue #27's contract edges on the cpu backend's own paths, on every ISA build this machine runs
(tests/test_contract_edges.py holds them for every backend): inf / NaN values of keys a row cannot
see never reach it through any PV path (the 8-lane kernels, the bf16 dot path and its AMX tiles,
decode_dot.h's small rows), in plain and batch-invariant mode, where prefill rows must still equal
decode rows bitwise; rows that see no key (0, lse -inf, or the sink's); sinks of -inf / +inf / NaN;
window_right and its O(window) reads; fp8 scales per tensor / KV head / sequence, K and V apart;
merge_states."""
from __future__ import annotations

import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import (assert_bits_equal, assert_close, assert_lse_close, make_case, nan_like, poison,
                               random_tensor)

from .test_cpu_backend import poison_outside, run_cpu

cpu = paged_ops.backend("cpu")


def run(case, causal=True, decode=False, **kw):
    """(out, lse) of the cpu backend (test_cpu_backend.run_cpu, variants as keywords)."""
    return run_cpu(case, kw, causal, decode)


def expected(case, causal=True, decode=False, **kw):
    kw = {k: v for k, v in kw.items() if k != "batch_invariant"}
    return case.reference_decode_lse(**kw) if decode else case.reference_prefill_lse(causal, **kw)


def store(cache, block_tables, seq, position, value, head=None, columns=slice(None)):
    """cache[token `position` of sequence `seq`][head][columns] = value (fp8: value's byte)."""
    bs = cache.shape[1]
    block, offset = int(block_tables[seq, position // bs]), position % bs
    heads = slice(None) if head is None else head
    if cache.dtype == torch.float8_e4m3fn:  # no inf: its NaN byte
        cache.view(torch.uint8)[block, offset, heads, columns] = 0x7F if not math.isinf(value) or value > 0 else 0xFF
    elif cache.dtype == torch.float8_e5m2:
        byte = 0x7C if value == math.inf else 0xFC if value == -math.inf else 0x7F
        cache.view(torch.uint8)[block, offset, heads, columns] = byte
    else:
        cache[block, offset, heads, columns] = value


def assert_rows_like_reference(out, lse, ref, ref_lse, dtype, msg=""):
    """Non-finite exactly where the reference is (elementwise), the finite rows within budget."""
    assert torch.equal(out.isfinite(), ref.isfinite()), (
        f"finite elements differ from the reference's {msg}: rows {(out.isfinite() != ref.isfinite()).any(-1).nonzero()[:6].tolist()}")
    finite = ref.isfinite().all(-1)
    assert finite.any()
    assert_close(out[finite], ref[finite], dtype, msg)
    assert_lse_close(lse[finite], ref_lse[finite], dtype, msg)


# --- A: a key's value never reaches a row that cannot see it ---------------------------------------

# (query dtype, cache dtype, q_len, num_heads, num_kv_heads): per KV head a task has q_len * group
# rows: >= 16 takes the bf16 dot path (AMX tiles in the amx builds), fewer decode_dot.h's small
# rows (bf16 / fp8 caches under a bf16 query, avx512_bf16 builds); the rest the 8-lane kernels.
PV_PATHS = {
    "fp32": (torch.float32, None, 40, 4, 2),
    "fp16": (torch.float16, None, 40, 4, 1),
    "bf16-dot": (torch.bfloat16, None, 40, 4, 2),
    "bf16-small": (torch.bfloat16, None, 5, 2, 2),
    "e5m2-dot": (torch.bfloat16, torch.float8_e5m2, 40, 4, 2),
    "e4m3-small": (torch.bfloat16, torch.float8_e4m3fn, 6, 2, 2),
    "e5m2-fp16": (torch.float16, torch.float8_e5m2, 40, 4, 2),
}


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path", list(PV_PATHS))
def test_causal_prefill_hidden_inf_values(isa, path, batch_invariant):
    """One inf in V at token 35 of a 40-token causal prefill (the issue's case), a NaN element in
    token 37's, -inf in token 39's and inf in K at 38: rows 0-34 must not change (they cannot see
    those keys); rows that see them are non-finite where the reference is. The second sequence's
    values at its hidden positions are poisoned too (a prefill of 40 rows at the end of 70 keys)."""
    dtype, cache_dtype, q_len, heads, kv_heads = PV_PATHS[path]
    case = make_case([40, 70], q_lens=[q_len, q_len], num_heads=heads, num_kv_heads=kv_heads, head_size=64,
                     dtype=dtype, cache_dtype=cache_dtype, seed=1)
    base = 40 - q_len  # the rows' first position in sequence 0
    store(case.value_cache, case.block_tables, 0, base + q_len - 5, math.inf, head=0, columns=slice(3, 9))
    store(case.value_cache, case.block_tables, 0, base + q_len - 3, math.nan, head=kv_heads - 1, columns=5)
    store(case.value_cache, case.block_tables, 0, base + q_len - 1, -math.inf, columns=slice(0, 1))
    store(case.key_cache, case.block_tables, 0, base + q_len - 2, math.inf, head=0)
    store(case.value_cache, case.block_tables, 1, 69 - 2, math.inf)
    out, lse = run(case, batch_invariant=batch_invariant)
    ref, ref_lse = expected(case)
    assert ref[:q_len - 5].isfinite().all() and not ref[q_len - 5:q_len].isfinite().all()
    assert_rows_like_reference(out, lse, ref, ref_lse, dtype, f"{isa} {path}")


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path", ["fp32", "bf16-dot", "bf16-small", "e5m2-dot"])
@pytest.mark.parametrize("causal,window_right", [(True, -1), (False, 3), (False, 40)])
def test_window_edges_hidden_inf_values(isa, path, causal, window_right, batch_invariant):
    """A window of 50 keys mid-tile: inf in V at the first row's first key (the key the keys
    before it point at, which only that row sees) and just past a row's right edge
    (window_right, non-causal): only the rows that see them turn non-finite."""
    dtype, cache_dtype, q_len, heads, kv_heads = PV_PATHS[path]
    n = 230
    case = make_case([n], q_lens=[q_len], num_heads=heads, num_kv_heads=kv_heads, head_size=64, dtype=dtype,
                     cache_dtype=cache_dtype, seed=2)
    kw = dict(window_left=50, window_right=window_right, batch_invariant=batch_invariant)
    first = n - q_len  # row 0's position
    store(case.value_cache, case.block_tables, 0, first - 50, math.inf)  # row 0's lo: seen by row 0 only
    if window_right >= 0 and first + window_right + 2 < n:
        store(case.value_cache, case.block_tables, 0, first + window_right + 2, math.nan)  # rows 2.. see it
    out, lse = run(case, causal=causal, **kw)
    ref, ref_lse = expected(case, causal=causal, **kw)
    assert not ref[0].isfinite().all() and ref[1:2].isfinite().all()
    assert_rows_like_reference(out, lse, ref, ref_lse, dtype, f"{isa} {path}")


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e5m2])
def test_batch_invariant_prefill_rows_equal_decode_with_inf_values(isa, threads, cache_dtype):
    """Batch-invariant mode: prefill rows == decode rows at each position, bitwise, although the
    prefill's tiles hold +inf / -inf values the decode never reads (keys after a row) or reads
    as a key every row of its tile sees (the decode row's own keys): the rows' finite columns keep
    their bits and the inf ones are +-inf in both. 600 keys: two 512-key chunks."""
    n, q_len = 600, 40
    case = make_case([n], q_lens=[q_len], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                     cache_dtype=cache_dtype, seed=3)
    store(case.value_cache, case.block_tables, 0, n - 12, math.inf, head=0, columns=3)
    store(case.value_cache, case.block_tables, 0, n - 7, -math.inf, head=1, columns=slice(10, 12))
    kw = dict(batch_invariant=True)
    for t in (1, 3):
        threads(t)
        out, lse = run(case, **kw)
        for i in range(q_len):
            position = n - q_len + i
            d_out, d_lse = nan_like(case.query[i:i + 1]), poison(torch.empty(1, 8))
            cpu.decode_attention(d_out, case.query[i:i + 1], case.key_cache, case.value_cache, case.block_tables,
                                 torch.tensor([position + 1], dtype=torch.int32), case.scale, case.k_scale,
                                 case.v_scale, lse=d_lse, **kw)
            assert_bits_equal(out[i], d_out[0], f"{isa} row {i}, {t} threads")
            assert_bits_equal(lse[i], d_lse[0], f"{isa} row {i} lse, {t} threads")
    ref, ref_lse = expected(case, **kw)
    assert_rows_like_reference(out, lse, ref, ref_lse, torch.bfloat16, isa)
    assert out[q_len - 12:, :4, 3].isposinf().all() and out[q_len - 7:, 4:, 10:12].isneginf().all()


# --- B: rows that see no key: out 0, lse -inf (or the sink) ----------------------------------------

@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
def test_prefill_rows_before_the_first_key(isa, dtype, cache_dtype, batch_invariant):
    """q_len > seq_len under causal alignment: the first rows sit before key 0 and see nothing
    (out 0, lse -inf; with sinks 0 and the sink); the query tile of 40 rows holds both kinds, and
    a sequence of 0 keys has only empty rows. Non-causal with window_right 2: rows with p + 2 < 0
    (and window_left 1 too)."""
    case = make_case([5, 30, 0], q_lens=[40, 3, 7], num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                     cache_dtype=cache_dtype, seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for causal, kw, empty_rows in [(True, {}, 35), (False, dict(window_right=2), 33),
                                   (False, dict(window_right=2, window_left=1), 33)]:
        empty = torch.zeros(50, dtype=torch.bool)
        empty[:empty_rows] = empty[43:] = True
        for sink in (None, sinks):
            kw = dict(kw, batch_invariant=batch_invariant, sinks=sink)
            out, lse = run(case, causal=causal, **kw)
            ref, ref_lse = expected(case, causal=causal, **kw)
            want_lse = torch.full((4,), -math.inf) if sink is None else sink
            assert torch.equal(ref_lse[empty].float(), want_lse.expand(int(empty.sum()), 4)), (causal, kw)
            assert (out[empty] == 0).all() and torch.equal(lse[empty], ref_lse[empty].float()), (isa, causal, kw)
            assert_close(out, ref, dtype, f"{isa} {causal} {kw}")
            assert_lse_close(lse[~empty], ref_lse[~empty], dtype, f"{isa} {causal} {kw}")


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_decode_seq_len_zero(isa, threads, batch_invariant):
    """Decode rows with seq_len 0 (next to a long split sequence, 2 threads): out 0, lse -inf;
    with sinks out 0 and lse = sink."""
    threads(2)
    case = make_case([0, 2000, 0, 17], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, seed=5)
    for kw in ({}, dict(sinks=torch.tensor([0.5, -1.0, 2.0, float("-inf")]))):
        kw = dict(kw, batch_invariant=batch_invariant)
        out, lse = run(case, decode=True, **kw)
        ref, ref_lse = expected(case, decode=True, **kw)
        assert (out[[0, 2]] == 0).all()
        assert torch.equal(lse[[0, 2]], ref_lse[[0, 2]].float())
        assert_close(out, ref, torch.bfloat16, isa)
        assert_lse_close(lse, ref_lse, torch.bfloat16, isa)


def test_all_minus_inf_scores_are_an_empty_row(isa):
    """Every visible score -inf (K = -inf, q > 0): the reference's lse is -inf and its row 0 (its
    probabilities are 0 where the lse is -inf), through the direct finish, the split merge (600
    keys, 2 threads) and the batch-invariant fold."""
    num_blocks, block_size, d = 80, 16, 64
    kc = torch.full((num_blocks, block_size, 1, d), 1.0).to(torch.float8_e5m2)
    kc.view(torch.uint8).fill_(0xFC)
    vc = torch.randn(num_blocks, block_size, 1, d).to(torch.float8_e5m2)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, 40)
    lens = torch.tensor([600, 40], dtype=torch.int32)
    q = torch.rand(2, 4, d) + 0.5
    scale = torch.tensor([0.5])
    for mode in (False, True):
        out, lse = nan_like(q), poison(torch.empty(2, 4))
        cpu.decode_attention(out, q, kc, vc, tables, lens, d ** -0.5, scale, scale, lse=lse, batch_invariant=mode)
        assert (out == 0).all() and lse.isneginf().all(), (isa, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_merge_attention_states_both_empty(dtype):
    """Both sides -inf: out 0 and lse -inf (their outs NaN, as attention over no key once was);
    one side -inf: the other side as it is; +inf / NaN: NaN rows."""
    g = torch.Generator().manual_seed(6)
    a, b = random_tensor((4, 3, 64), dtype, g), random_tensor((4, 3, 64), dtype, g)
    la, lb = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    la[0], lb[0] = -math.inf, -math.inf
    a[0], b[0] = math.nan, math.nan
    la[1, 0], a[1, 0] = -math.inf, math.nan
    la[2, 1], lb[3, 2] = math.inf, math.nan
    out, out_lse = nan_like(a), poison(torch.empty(4, 3))
    cpu.merge_attention_states(out, out_lse, a, la, b, lb)
    assert (out[0] == 0).all() and out_lse[0].isneginf().all()
    assert torch.equal(out[1, 0], b[1, 0]) and out_lse[1, 0] == lb[1, 0]
    assert out[2, 1].isnan().all() and out[3, 2].isnan().all() and out_lse[2, 1].isnan() and out_lse[3, 2].isnan()
    ref, ref_lse = torch.empty(out.shape, dtype=torch.float64), torch.empty(4, 3, dtype=torch.float64)
    reference.merge_attention_states(ref, ref_lse, a, la, b, lb)
    ok = ref.isfinite().all(-1)
    assert torch.equal(ok, out.isfinite().all(-1))
    assert_close(out[ok], ref[ok], dtype)


# --- C: sinks of -inf, +inf, NaN -------------------------------------------------------------------

@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_non_finite_sinks(isa, threads, decode, batch_invariant):
    """Per head: -inf (no sink), +inf (out 0, lse +inf), NaN (a NaN row), finite; through the
    direct finish, the split merge (2000 keys, 2 threads) and the batch-invariant fold; a prefill
    with rows before the first key too (+inf and NaN hold for them as for every row)."""
    threads(2)
    if decode:
        case = make_case([2000, 40], num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, seed=7)
    else:
        case = make_case([2000, 10], q_lens=[70, 20], num_heads=4, num_kv_heads=2, head_size=64,
                         dtype=torch.bfloat16, seed=7)
    sinks = torch.tensor([float("-inf"), float("inf"), float("nan"), 1.5])
    kw = dict(sinks=sinks, batch_invariant=batch_invariant)
    out, lse = run(case, decode=decode, **kw)
    ref, ref_lse = expected(case, decode=decode, **kw)
    assert (out[:, 1] == 0).all() and lse[:, 1].isposinf().all(), isa
    assert out[:, 2].isnan().all() and lse[:, 2].isnan().all(), isa
    for h in (0, 3):
        assert_close(out[:, h], ref[:, h], torch.bfloat16, f"{isa} head {h}")
        assert_lse_close(lse[:, h], ref_lse[:, h], torch.bfloat16, f"{isa} head {h}")
    nosink, nosink_lse = run(case, decode=decode, batch_invariant=batch_invariant)
    assert_bits_equal(out[:, 0], nosink[:, 0], "a sink of -inf is no sink")
    assert_bits_equal(lse[:, 0], nosink_lse[:, 0], "a sink of -inf is no sink")


# --- D: window_right -----------------------------------------------------------------------------

@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("window_left,window_right", [(-1, 0), (-1, 37), (100, 0), (64, 20), (0, 0)])
def test_window_right_against_the_reference(isa, window_left, window_right, batch_invariant):
    """Non-causal prefill (a long chunk, GQA) and decode with window_right (alone and with
    window_left); causal with window_right changes nothing."""
    case = make_case([1500, 300, 33], q_lens=[130, 1, 33], num_heads=8, num_kv_heads=2, head_size=64,
                     dtype=torch.bfloat16, seed=8)
    kw = dict(window_left=window_left, window_right=window_right, batch_invariant=batch_invariant)
    out, lse = run(case, causal=False, **kw)
    ref, ref_lse = expected(case, causal=False, **kw)
    assert_close(out, ref, torch.bfloat16, isa)
    assert_lse_close(lse, ref_lse, torch.bfloat16, isa)
    causal_out, causal_lse = run(case, causal=True, **kw)
    plain_out, plain_lse = run(case, causal=True, window_left=window_left, batch_invariant=batch_invariant)
    assert_bits_equal(causal_out, plain_out)
    assert_bits_equal(causal_lse, plain_lse)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_window_right_reads_only_the_window(batch_invariant):
    """Non-causal prefill of 300 rows at the end of 4000 keys with a two-sided window: every key
    before the first row's window is NaN in K and V (whole blocks swapped for a NaN block), so a
    plan that walked from key 0 or cut the window wrong would read NaN; decode likewise."""
    lens, q_lens, left, right = [4000, 900], [300, 1], 150, 90
    case = make_case(lens, q_lens, num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float32, seed=9)
    kw = dict(window_left=left, window_right=right, batch_invariant=batch_invariant)
    ref, ref_lse = expected(case, causal=False, **kw)
    keep = [(n - q - left, n - 1) for n, q in zip(lens, q_lens)]
    out, lse = run(poison_outside(case, keep), causal=False, **kw)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


# --- E: fp8 scales per tensor, KV head, sequence; K and V apart --------------------------------------

@pytest.mark.parametrize("scale_kind", ["seq", "head/tensor", "tensor/seq"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scale_forms(isa, scale_kind, cache_dtype):
    """Each (sequence, KV head) its own scale, K and V in different forms: decode (small rows and
    the split merge), prefill (the dot path), under bf16 and fp16 queries."""
    for dtype in (torch.bfloat16, torch.float16):
        case = make_case([300, 90, 1100], q_lens=[1, 60, 1], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype,
                         cache_dtype=cache_dtype, scale_kind=scale_kind, seed=10)
        out, lse = run(case)
        ref, ref_lse = expected(case)
        assert_close(out, ref, dtype, f"{isa} {scale_kind} {dtype}")
        assert_lse_close(lse, ref_lse, dtype, f"{isa} {scale_kind} {dtype}")
        dcase = make_case([300, 90, 1100], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype,
                          cache_dtype=cache_dtype, scale_kind=scale_kind, seed=11)
        out, lse = run(dcase, decode=True)
        ref, ref_lse = expected(dcase, decode=True)
        assert_close(out, ref, dtype, f"{isa} {scale_kind} {dtype} decode")
        assert_lse_close(lse, ref_lse, dtype, f"{isa} {scale_kind} {dtype} decode")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("k_kind,v_kind", [("head", "tensor"), ("tensor", "head")])
def test_reshape_and_cache_k_and_v_scales_apart(isa, cache_dtype, k_kind, v_kind):
    g = torch.Generator().manual_seed(12)
    key, value = (torch.randn(50, 3, 64, generator=g) for _ in range(2))
    shape = {"head": (3,), "tensor": (1,)}
    k_scale, v_scale = (torch.rand(shape[k], generator=g) * 0.05 + 0.01 for k in (k_kind, v_kind))
    slots = torch.randperm(8 * 16, generator=g)[:50]
    got = [poison(torch.empty(8, 16, 3, 64, dtype=cache_dtype)) for _ in range(2)]
    want = [c.clone() for c in got]
    cpu.reshape_and_cache(key, value, got[0], got[1], slots, k_scale, v_scale)
    reference.reshape_and_cache(key, value, want[0], want[1], slots, k_scale, v_scale)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_.view(torch.uint8), w_.view(torch.uint8))


# --- F: merge_states ------------------------------------------------------------------------------

def merge_both(states, states_lse, dtype, with_lse=True):
    T, _, H, D = states.shape
    out, out_lse = poison(torch.empty(T, H, D, dtype=dtype)), (poison(torch.empty(T, H)) if with_lse else None)
    cpu.merge_states(out, out_lse, states, states_lse)
    ref, ref_lse = torch.empty(T, H, D, dtype=torch.float64), torch.empty(T, H, dtype=torch.float64)
    reference.merge_states(ref, ref_lse, states, states_lse)
    return out, out_lse, ref, ref_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_states", [1, 2, 5, 17])
def test_merge_states_against_the_reference(threads, dtype, num_states):
    """Random states (lse spread over +-30) in a strided view (states and lse with token and
    state dims swapped in memory), many tokens so threads split them, with and without out_lse."""
    g = torch.Generator().manual_seed(num_states)
    T, H, D = 300, 4, 72
    states = random_tensor((num_states, T, H, D), dtype, g).transpose(0, 1)  # [T, S, H, D], strided
    states_lse = (torch.randn(H, num_states, T, generator=g) * 10).permute(2, 1, 0)  # any strides
    for t in (1, 3):
        threads(t)
        for with_lse in (True, False):
            out, out_lse, ref, ref_lse = merge_both(states, states_lse, dtype, with_lse)
            assert_close(out, ref, dtype)
            if with_lse:
                assert_lse_close(out_lse, ref_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_states_edges(dtype):
    """-inf states contribute nothing even with NaN outs; all -inf: 0 and -inf; +inf or NaN
    anywhere: NaN row; no state at all: every row empty."""
    g = torch.Generator().manual_seed(13)
    T, S, H, D = 6, 3, 2, 64
    states = random_tensor((T, S, H, D), dtype, g)
    lse = torch.randn(T, S, H, generator=g)
    lse[0, :, 0] = -math.inf
    states[0, :, 0] = math.nan
    lse[1, 1, 1], states[1, 1, 1] = -math.inf, math.nan
    lse[2, 0, 0] = math.inf
    lse[3, 2, 1] = math.nan
    lse[4, :2, 0] = -math.inf
    lse[5, 0, 1] = -1e4  # weight e^-1e4 = 0: contributes 0 (its out is finite)
    out, out_lse, ref, ref_lse = merge_both(states, lse, dtype)
    assert (out[0, 0] == 0).all() and out_lse[0, 0].isneginf()
    assert out[2, 0].isnan().all() and out_lse[2, 0].isnan() and out[3, 1].isnan().all() and out_lse[3, 1].isnan()
    assert torch.equal(out[4, 0], states[4, 2, 0]) and out_lse[4, 0] == lse[4, 2, 0]
    ok = ref.isfinite().all(-1)
    assert torch.equal(ok, out.isfinite().all(-1))
    assert_close(out[ok], ref[ok], dtype)
    assert_lse_close(out_lse[ok], ref_lse[ok], torch.float32)
    out, out_lse = poison(torch.empty(T, H, D, dtype=dtype)), poison(torch.empty(T, H))
    cpu.merge_states(out, out_lse, torch.empty(T, 0, H, D, dtype=dtype), torch.empty(T, 0, H))
    assert (out == 0).all() and out_lse.isneginf().all()

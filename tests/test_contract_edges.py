"""The contract's edges (#27), on every backend against paged_ops.reference: keys a row cannot
see never reach it, rows with no visible key, non-finite sinks, the softcap bound, window_right,
per-sequence and mixed fp8 scales, the N-way merge_states, and outputs that overlap inputs."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import (assert_bits_equal, assert_close, assert_lse_close, make_case, nan_like, poison,
                               sequence_scale)

BACKENDS = paged_ops.available_backends()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INF, NAN = math.inf, math.nan


def device_of(name: str) -> str:
    return "cuda" if torch.cuda.is_available() and "cuda" in paged_ops.backend(name).devices else "cpu"


pytestmark = pytest.mark.usefixtures("untuned_configs")


def params(*axes):
    """Every backend with every combination of the axes (an axis of tuples adds several
    parameters at once)."""
    combos = [()]
    for axis in axes:
        combos = [(*c, *(v if isinstance(v, tuple) else (v,))) for c in combos for v in axis]
    return [(b, *c) for b in BACKENDS for c in combos]


def store_token(case, s: int, position: int, which: str, value: float) -> None:
    """Write value into every element of token ``position`` of sequence s in the K or V cache."""
    cache = case.key_cache if which == "k" else case.value_cache
    bs = cache.shape[1]
    block = int(case.block_tables[s, position // bs])
    if cache.dtype == E4M3:  # no inf in e4m3fn: its NaN byte
        cache.view(torch.uint8)[block, position % bs] = 0x7F
    else:
        cache[block, position % bs] = value


def run_prefill(backend, c, causal=True, **kw):
    out = nan_like(c.query)
    paged_ops.backend(backend).prefill_attention(*c.prefill_args(out, causal), **kw)
    return out.cpu()


def run_decode(backend, c, **kw):
    out = nan_like(c.query)
    paged_ops.backend(backend).decode_attention(*c.decode_args(out), **kw)
    return out.cpu()


def lse_buffer(c):
    return poison(torch.empty(c.query.shape[:2], dtype=torch.float32, device=c.device))


# --- item 2: keys a row cannot see never change it ----------------------------------------------

@pytest.mark.parametrize("backend,dtype,which,value,mode", params(
    (F32, BF16), ("v", "k"), (INF, NAN), (False, True)))
def test_hidden_nonfinite_token_does_not_reach_rows_that_cannot_see_it(backend, dtype, which, value, mode):
    # The repro: one inf (or NaN) at token 35 of a 40-token causal prefill. Rows 0..34
    # cannot see it and must equal the reference exactly as without it; rows 35.. see it.
    device = device_of(backend)
    c = make_case([40], [40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                  device=device, seed=3)
    store_token(c, 0, 35, which, value)
    lse = lse_buffer(c)
    out = run_prefill(backend, c, lse=lse, batch_invariant=mode)
    ref, ref_lse = c.reference_prefill_lse()
    assert_close(out[:35], ref[:35], dtype, "rows that cannot see token 35")
    assert_lse_close(lse.cpu()[:35], ref_lse[:35], dtype)
    assert not out[35:].isfinite().all(), "rows that see the non-finite token"


@pytest.mark.parametrize("backend,dtype", params((F32, BF16)))
def test_hidden_nonfinite_value_keeps_batch_invariant_rows_equal_to_decode(backend, dtype):
    # Batch-invariant mode: prefill row p equals the decode of position p bitwise, with an inf V
    # at a later position the prefill's tile holds but row p cannot see.
    device = device_of(backend)
    c = make_case([40], [40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                  device=device, seed=4)
    store_token(c, 0, 35, "v", INF)
    prefill = run_prefill(backend, c, batch_invariant=True)
    for p in (0, 17, 31, 34):
        d = make_case([p + 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, device=device)
        d.query, d.key_cache, d.value_cache, d.block_tables = c.query[p:p + 1], c.key_cache, c.value_cache, c.block_tables
        decode = run_decode(backend, d, batch_invariant=True)
        assert_bits_equal(prefill[p:p + 1], decode, f"row {p}")


@pytest.mark.parametrize("backend,window_left,window_right,causal", params(
    ((5, -1, True), (20, -1, True), (3, 4, False), (8, 2, False), (10, 0, False))))
def test_tokens_outside_every_window_hold_inf(backend, window_left, window_right, causal):
    # Windows leave tokens no row sees; they hold inf in K and V (poison_hidden) and must stay out.
    device = device_of(backend)
    c = make_case([70, 33], [30, 33], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                  device=device, seed=5)
    assert c.poison_hidden(causal, window_left, window_right) > 0
    lse = lse_buffer(c)
    out = run_prefill(backend, c, causal, window_left=window_left, window_right=window_right, lse=lse)
    ref, ref_lse = c.reference_prefill_lse(causal, window_left=window_left, window_right=window_right)
    assert_close(out, ref, F16)
    assert_lse_close(lse.cpu(), ref_lse, F16)


# --- item 9: rows with no visible key --------------------------------------------------------------

@pytest.mark.parametrize("backend,sinks,mode", params((False, True), (False, True)))
def test_prefill_rows_before_the_first_key_are_zero(backend, sinks, mode):
    # q_len > seq_len under causal alignment: the first q_len - seq_len rows see no key
    # (FlashAttention and vLLM: out 0, lse -inf; with a sink: 0 and the sink).
    device = device_of(backend)
    c = make_case([3, 0, 10, 20], [5, 2, 10, 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                  dtype=F32, device=device, seed=6)
    kw = {"sinks": torch.randn(4, device=device)} if sinks else {}
    lse = lse_buffer(c)
    out = run_prefill(backend, c, lse=lse, batch_invariant=mode, **kw)
    ref, ref_lse = c.reference_prefill_lse(**kw)
    empty = torch.tensor([1, 1, 0, 0, 0, 1, 1] + [0] * 11, dtype=torch.bool)  # rows of seqs 0 and 1 before key 0
    assert (out[empty] == 0).all(), "a row with no visible key is 0"
    assert_close(out, ref, F32)
    assert_lse_close(lse.cpu(), ref_lse, F32)
    if sinks:
        assert torch.equal(lse.cpu()[empty], kw["sinks"].cpu().expand(int(empty.sum()), 4))
    else:
        assert (lse.cpu()[empty] == -INF).all()


@pytest.mark.parametrize("backend,mode", params((False, True)))
def test_decode_of_an_empty_sequence_is_zero(backend, mode):
    # seq_lens 0 (a padded slot of a fixed-size batch): out 0, lse -inf; the others unchanged.
    device = device_of(backend)
    c = make_case([0, 9, 0, 40], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16,
                  device=device, seed=7)
    lse = lse_buffer(c)
    out = run_decode(backend, c, lse=lse, batch_invariant=mode)
    ref, ref_lse = c.reference_decode_lse()
    assert (out[[0, 2]] == 0).all() and (lse.cpu()[[0, 2]] == -INF).all()
    assert_close(out, ref, BF16)
    assert_lse_close(lse.cpu(), ref_lse, BF16)


# --- item 3: non-finite sinks; the softcap bound; ALiBi slopes finite ------------------------------

@pytest.mark.parametrize("backend,op", params(("decode", "prefill")))
def test_non_finite_sinks_follow_the_reference(backend, op):
    # sinks -inf: no sink; +inf: out 0, lse +inf (for every row of the head); NaN: a NaN row.
    device = device_of(backend)
    c = make_case([30, 70], [1, 12] if op == "prefill" else None, num_heads=8, num_kv_heads=2, head_size=64,
                  block_size=16, dtype=F32, device=device, seed=8)
    sinks = torch.tensor([-INF, INF, NAN, 0.5, -INF, INF, 2.0, NAN], device=device)
    lse = lse_buffer(c)
    out = (run_prefill(backend, c, sinks=sinks, lse=lse) if op == "prefill" else
           run_decode(backend, c, sinks=sinks, lse=lse))
    ref, ref_lse = (c.reference_prefill_lse if op == "prefill" else c.reference_decode_lse)(sinks=sinks)
    lse = lse.cpu()
    finite = [0, 3, 4, 6]
    assert_close(out[:, finite], ref[:, finite], F32)
    assert_lse_close(lse[:, finite], ref_lse[:, finite], F32)
    assert (out[:, [1, 5]] == 0).all() and (lse[:, [1, 5]] == INF).all(), "sink +inf: out 0, lse +inf"
    assert out[:, [2, 7]].isnan().all() and lse[:, [2, 7]].isnan().all(), "sink NaN: NaN rows"


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_at_its_bound_stays_finite(backend):
    # 2^126: scores / softcap ~ 0 and softcap * tanh(...) ~ the raw score (no cap); products with
    # log2(e) stayed finite only below ~2.36e38, past which every output was NaN.
    device = device_of(backend)
    c = make_case([40], [6], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F32, device=device)
    out = run_prefill(backend, c, softcap=2.0 ** 126)
    assert_close(out, c.reference_prefill(softcap=2.0 ** 126), F32)
    for softcap in (2.4e38, 3.0e38, 2.0 ** 127):
        with pytest.raises(ValueError, match="softcap"):
            run_prefill(backend, c, softcap=softcap)


@pytest.mark.parametrize("bad", (INF, -INF, NAN))
def test_non_finite_alibi_slopes_are_rejected(bad):
    c = make_case([10], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    slopes = torch.tensor([0.5, bad, 0.25, 0.125])
    with pytest.raises(ValueError, match=r"alibi_slopes\[1\]"):
        run_decode("cpu", c, alibi_slopes=slopes)


# --- item 9: window_right --------------------------------------------------------------------------

@pytest.mark.parametrize("backend,window_left,window_right,block_size", params(
    ((-1, 0), (-1, 3), (4, 4), (0, 0), (30, 17), (2, 100)), (1, 16)))
def test_window_right_non_causal(backend, window_left, window_right, block_size):
    device = device_of(backend)
    c = make_case([50, 7, 90], [50, 3, 20], num_heads=4, num_kv_heads=1, head_size=64, block_size=block_size,
                  dtype=F16, device=device, seed=window_right)
    c.poison_hidden(False, window_left, window_right)
    lse = lse_buffer(c)
    out = run_prefill(backend, c, False, window_left=window_left, window_right=window_right, lse=lse)
    ref, ref_lse = c.reference_prefill_lse(False, window_left=window_left, window_right=window_right)
    assert_close(out, ref, F16)
    assert_lse_close(lse.cpu(), ref_lse, F16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_right_changes_nothing_under_causal(backend):
    device = device_of(backend)
    c = make_case([40, 21], [9, 21], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, device=device)
    plain, right = run_prefill(backend, c), run_prefill(backend, c, window_right=0)
    assert_bits_equal(plain, right)
    d = make_case([40, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, device=device)
    assert_bits_equal(run_decode(backend, d), run_decode(backend, d, window_right=5))


def test_window_right_below_minus_one_is_rejected():
    c = make_case([10], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    with pytest.raises(ValueError, match="window_right"):
        run_decode("cpu", c, window_right=-2)


# --- items 7 and 9: per-sequence and mixed fp8 scales -----------------------------------------------

@pytest.mark.parametrize("backend,cache_dtype,scale_kind,op", params(
    (E4M3, E5M2), ("seq", "head/tensor", "tensor/seq"), ("decode", "prefill")))
def test_per_sequence_and_mixed_scales(backend, cache_dtype, scale_kind, op):
    device = device_of(backend)
    c = make_case([33, 5, 70], [4, 5, 1] if op == "prefill" else None, num_heads=8, num_kv_heads=2, head_size=64,
                  block_size=16, dtype=BF16, cache_dtype=cache_dtype, scale_kind=scale_kind, device=device, seed=9)
    if "seq" in scale_kind:  # each sequence's tokens were stored with its own row of the scale
        per_seq = c.k_scale if c.k_scale.dim() == 2 else c.v_scale
        assert per_seq.shape == (3, 2) and per_seq.unique().numel() == 6
    lse = lse_buffer(c)
    out = run_prefill(backend, c, lse=lse) if op == "prefill" else run_decode(backend, c, lse=lse)
    ref, ref_lse = (c.reference_prefill_lse if op == "prefill" else c.reference_decode_lse)()
    assert_close(out, ref, BF16)
    assert_lse_close(lse.cpu(), ref_lse, BF16)


@pytest.mark.parametrize("backend,cache_dtype", params((E4M3, E5M2)))
def test_reshape_and_cache_with_per_head_k_and_per_tensor_v(backend, cache_dtype):
    device = device_of(backend)
    g = torch.Generator().manual_seed(10)
    key, value = torch.randn(6, 2, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    k_scale, v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.03])
    slots = torch.tensor([0, 5, -1, 9, 30, 2])
    caches = [poison(torch.empty(5, 8, 2, 64, dtype=cache_dtype)) for _ in range(4)]
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    kc, vc = caches[2].to(device), caches[3].to(device)
    paged_ops.backend(backend).reshape_and_cache(key.to(device), value.to(device), kc, vc, slots.to(device),
                                                  k_scale.to(device), v_scale.to(device))
    assert_bits_equal(kc.cpu(), caches[0])
    assert_bits_equal(vc.cpu(), caches[1])


def test_per_sequence_scale_shape_is_checked():
    c = make_case([10, 4], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, cache_dtype=E5M2,
                  scale_kind="seq")
    with pytest.raises(ValueError, match="k_scale"):
        run_decode("cpu", dataclasses.replace(c, k_scale=torch.ones(3, 2)))
    key = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="k_scale"):  # reshape_and_cache has no sequences
        torch.ops.paged.reshape_and_cache(key, key, c.key_cache, c.value_cache, torch.tensor([0]),
                                          torch.ones(1, 2), torch.ones(1))
    assert sequence_scale(c.k_scale, 1).shape == (2,)


# --- item 9: merge_states, the N-way merge ----------------------------------------------------------

def merge_states_inputs(num_tokens, num_states, num_heads=4, head_size=64, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, num_states, num_heads, head_size, generator=g).to(dtype)
    lse = torch.randn(num_tokens, num_states, num_heads, generator=g) * 4
    if num_states and num_tokens >= 4:
        lse[0, 0] = -INF  # an empty state: its out is NaN and must not matter
        states[0, 0] = NAN
        lse[1] = -INF  # every state empty: out 0, lse -inf
        states[1] = NAN
        lse[2, :, 0] = torch.tensor([90.0, -90.0, 0.0] * num_states)[:num_states]  # far apart
        lse[3, 0, 1] = INF  # +inf: NaN row
        lse[3, -1, 2] = NAN  # NaN: NaN row
    return states, lse


@pytest.mark.parametrize("backend,num_states,dtype,with_lse", params((1, 2, 3, 7), (F32, F16, BF16), (True, False)))
def test_merge_states(backend, num_states, dtype, with_lse):
    device = device_of(backend)
    states, lse = merge_states_inputs(9, num_states, dtype=dtype, seed=num_states)
    ref = torch.empty(9, 4, 64, dtype=torch.float64)
    ref_lse = torch.empty(9, 4, dtype=torch.float64)
    reference.merge_states(ref, ref_lse, states, lse)
    out = nan_like(torch.empty(9, 4, 64, dtype=dtype, device=device))
    out_lse = poison(torch.empty(9, 4, device=device)) if with_lse else None
    paged_ops.backend(backend).merge_states(out, out_lse, states.to(device), lse.to(device))
    out = out.cpu()
    nan_rows = ref.isnan().any(-1)
    assert out[nan_rows].isnan().all() and nan_rows.sum() == 2, "a +inf or NaN state: NaN rows"
    assert (out[1] == 0).all(), "every state empty: out 0"
    assert_close(out[~nan_rows], ref[~nan_rows], dtype)
    if with_lse:
        assert (out_lse.cpu()[1] == -INF).all()
        assert out_lse.cpu()[nan_rows].isnan().all()
        assert_lse_close(out_lse.cpu()[~nan_rows], ref_lse[~nan_rows], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_states_of_stacked_splits_equals_attention(backend):
    # Split-KV / context parallelism: attention over each third of the keys, stacked along dim 0
    # ([num_states, tokens, heads, D], a strided view as the op's [tokens, num_states, ...]), merged.
    device = device_of(backend)
    q = torch.randn(5, 4, 64, dtype=torch.float64)
    k, v = torch.randn(60, 2, 64, dtype=torch.float64), torch.randn(60, 2, 64, dtype=torch.float64)
    parts = [reference.attention(q, k[i:i + 20], v[i:i + 20], 0.125, False, return_lse=True) for i in (0, 20, 40)]
    states = torch.stack([o for o, _ in parts]).float().transpose(0, 1)
    lse = torch.stack([l for _, l in parts]).float().transpose(0, 1)
    out, out_lse = nan_like(torch.empty(5, 4, 64, device=device)), torch.empty(5, 4, device=device)
    paged_ops.backend(backend).merge_states(out, out_lse, states.to(device), lse.to(device))
    full, full_lse = reference.attention(q, k, v, 0.125, False, return_lse=True)
    assert_close(out.cpu(), full, F32)
    assert_lse_close(out_lse.cpu(), full_lse, F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_states_with_no_state_and_no_token(backend):
    device = device_of(backend)
    out, out_lse = nan_like(torch.empty(3, 2, 16, device=device)), torch.empty(3, 2, device=device)
    paged_ops.backend(backend).merge_states(out, out_lse, torch.empty(3, 0, 2, 16, device=device),
                                            torch.empty(3, 0, 2, device=device))
    assert (out.cpu() == 0).all() and (out_lse.cpu() == -INF).all()
    ref, ref_lse = torch.empty(3, 2, 16, dtype=torch.float64), torch.empty(3, 2, dtype=torch.float64)
    reference.merge_states(ref, ref_lse, torch.empty(3, 0, 2, 16), torch.empty(3, 0, 2))
    assert (ref == 0).all() and (ref_lse == -INF).all()
    paged_ops.backend(backend).merge_states(torch.empty(0, 2, 16, device=device), None,
                                            torch.empty(0, 3, 2, 16, device=device), torch.empty(0, 3, 2, device=device))


def test_merge_states_compiles_with_dynamic_shapes():
    def merged(states, lse):
        out = torch.empty(states.shape[0], states.shape[2], states.shape[3])
        out_lse = torch.empty(states.shape[0], states.shape[2])
        torch.ops.paged.merge_states(out, out_lse, states * 1.0, lse)
        return out, out_lse

    compiled = torch.compile(merged, fullgraph=True, dynamic=True)
    for tokens, n in ((5, 3), (8, 2)):
        states, lse = merge_states_inputs(tokens, n, seed=tokens)
        lse, states = lse.clamp(-8, 8), states.nan_to_num(0.0)
        got, want = compiled(states, lse), merged(states, lse)
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("what", ("states shape", "states dtype", "states_lse shape", "out_lse is states_lse",
                                  "out inside states"))
def test_merge_states_bad_input(what):
    states, lse = merge_states_inputs(4, 3)
    out, out_lse = torch.empty(4, 4, 64), torch.empty(4, 4)
    name = what.split()[0]
    call = {
        "states shape": lambda: torch.ops.paged.merge_states(out, out_lse, states[:, :, :3], lse),
        "states dtype": lambda: torch.ops.paged.merge_states(out, out_lse, states.half(), lse),
        "states_lse shape": lambda: torch.ops.paged.merge_states(out, out_lse, states, lse[:, :2]),
        "out_lse is states_lse": lambda: torch.ops.paged.merge_states(out, lse[:, 0], states, lse),
        "out inside states": lambda: torch.ops.paged.merge_states(states[:, 1], out_lse, states, lse),
    }[what]
    with pytest.raises(ValueError, match=name):
        call()


def test_merge_attention_states_of_two_empty_sides_is_zero():
    nan = torch.full((2, 3, 8), NAN)
    out, lse = torch.empty(2, 3, 8), torch.empty(2, 3)
    minus = torch.full((2, 3), -INF)
    for backend in BACKENDS:
        device = device_of(backend)
        o, l = nan_like(out).to(device), lse.to(device)
        paged_ops.backend(backend).merge_attention_states(o, l, nan.to(device), minus.to(device), nan.to(device),
                                                          minus.to(device))
        assert (o.cpu() == 0).all() and (l.cpu() == -INF).all(), backend


# --- item 1: outputs that overlap an input are a ValueError naming both -------------------------------

def overlapping_calls():
    """(what, the two names, a call): an output sharing memory with an input, op by op."""
    c = make_case([5, 19], [5, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    f8 = make_case([5, 19], [5, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, cache_dtype=E5M2)

    def bytes_of(t):  # t's bytes at the start of a bigger buffer, and the buffer
        buf = torch.zeros(t.numel() * t.element_size() + 4096, dtype=torch.uint8)
        view = buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view, buf

    def lse_over(t):  # an lse [8, 4] float32 laid over t's first bytes
        view, buf = bytes_of(t)
        return view, buf[:8 * 4 * 4].view(torch.float32).view(8, 4)

    def prefill(case, **changes):
        args = dict(zip(("out", "query", "key_cache", "value_cache", "block_tables", "cu_seqlens_q", "seq_lens",
                         "max_seqlen_q", "scale", "causal", "k_scale", "v_scale"), case.prefill_args(nan_like(case.query))))
        keywords = {k: changes.pop(k) for k in ("lse", "sinks") if k in changes}
        args.update(changes)
        return lambda: torch.ops.paged.prefill_attention(*args.values(), **keywords)

    for name in ("block_tables", "seq_lens", "cu_seqlens_q", "query", "key_cache", "value_cache"):
        view, lse = lse_over(getattr(c, name))
        yield f"lse over {name}", ("lse", name), prefill(c, **{name: view, "lse": lse})
    for name in ("k_scale", "v_scale"):
        view, buf = bytes_of(getattr(f8, name))
        yield f"lse over {name}", ("lse", name), prefill(f8, **{name: view, "lse": buf[:128].view(torch.float32).view(8, 4)})
    for name in ("block_tables", "key_cache", "value_cache", "query"):
        src = getattr(c, name)
        buf = torch.zeros(src.numel() * src.element_size() + c.query.numel() * 4, dtype=torch.uint8)
        view = buf[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        view.copy_(src)
        out = buf[:c.query.numel() * 4].view(torch.float32).view(c.query.shape)
        yield f"out over {name}", ("out", name), prefill(c, **{name: view, "out": out})
    sinks = torch.zeros(8, 4)
    yield "lse over sinks", ("lse", "sinks"), prefill(c, sinks=sinks[0], lse=sinks)

    # reshape_and_cache: a cache over key / value / slot_mapping, the caches over each other
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([0, 9, 17])
    kc, vc = c.key_cache.clone(), c.value_cache.clone()
    yield "key_cache over key", ("key_cache", "key"), lambda: torch.ops.paged.reshape_and_cache(
        kc[0, :3], value, kc, vc, slots, None, None)
    yield "value_cache over value", ("value_cache", "value"), lambda: torch.ops.paged.reshape_and_cache(
        key, vc[1, :3], kc, vc, slots, None, None)
    sbuf = torch.zeros(kc.numel() * 4, dtype=torch.uint8)
    kc2 = sbuf.view(torch.float32).view(kc.shape)
    slots2 = sbuf[:24].view(torch.int64)
    slots2.copy_(slots)
    yield "key_cache over slot_mapping", ("key_cache", "slot_mapping"), lambda: torch.ops.paged.reshape_and_cache(
        key, value, kc2, vc, slots2, None, None)
    yield "value_cache is key_cache", ("value_cache", "key_cache"), lambda: torch.ops.paged.reshape_and_cache(
        key, value, kc, kc, slots, None, None)
    x = torch.randn(4, 64)
    yield "quantize out over input", ("out", "input"), lambda: torch.ops.paged.quantize_fp8(
        x.view(-1).view(torch.uint8)[:256].view(E5M2).view(4, 64), x, torch.tensor([0.5]))
    y = torch.randn(4, 64).to(E4M3)
    ybuf = torch.zeros(4 * 64 * 4, dtype=torch.uint8)
    ybuf[:256].view(E4M3).view(4, 64).copy_(y)
    yield "dequantize out over input", ("out", "input"), lambda: torch.ops.paged.dequantize_fp8(
        ybuf.view(torch.float32).view(4, 64), ybuf[:256].view(E4M3).view(4, 64), torch.tensor([0.5]))
    caches = torch.randn(6, 8, 2, 64)
    mapping = caches.view(-1)[:8].view(torch.int64).view(2, 2)
    mapping.copy_(torch.tensor([[0, 3], [1, 4]]))  # valid pairs, stored in block 0 of the cache
    yield "copy_blocks cache over block_mapping", ("key_caches\\[0\\]", "block_mapping"), \
        lambda: torch.ops.paged.copy_blocks([caches], [torch.randn(6, 8, 2, 64)], mapping)
    src = torch.randn(6, 8, 2, 64)
    yield "swap_blocks dst is src", ("dst", "src"), lambda: torch.ops.paged.swap_blocks(
        src, src[3:], torch.tensor([[0, 0]]))


OVERLAPS = list(overlapping_calls())


@pytest.mark.parametrize("what,names,call", OVERLAPS, ids=[o[0] for o in OVERLAPS])
def test_output_overlapping_an_input_is_a_value_error(what, names, call):
    with pytest.raises(ValueError, match=f"{names[0]} overlaps {names[1]}"):
        call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_cache_halves_are_not_an_overlap(backend):
    # vLLM's per-layer cache [num_blocks, block_size, H, 2 * D] split into its K and V halves:
    # one storage, interleaved rows, no shared byte: reshape_and_cache and attention accept it.
    device = device_of(backend)
    kv = torch.randn(6, 8, 2, 128, device=device)
    kc, vc = kv[..., :64], kv[..., 64:]
    key, value = torch.randn(3, 2, 64, device=device), torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([0, 9, 17], device=device)
    paged_ops.backend(backend).reshape_and_cache(key, value, kc, vc, slots, None, None)
    assert torch.equal(kc[1, 1].cpu(), key[1].cpu()) and torch.equal(vc[2, 1].cpu(), value[2].cpu())
    out = nan_like(torch.empty(1, 4, 64, device=device))
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device)
    lens = torch.tensor([18], dtype=torch.int32, device=device)
    paged_ops.backend(backend).decode_attention(out, torch.randn(1, 4, 64, device=device), kc, vc, tables, lens, 0.125)
    assert out.isfinite().all()
    # an out laid over the V half of a block no sequence uses is an overlap all the same
    with pytest.raises(ValueError, match="out overlaps value_cache"):
        paged_ops.backend(backend).decode_attention(vc[5, 0:1], torch.randn(1, 2, 64, device=device), kc, vc,
                                                    tables, lens, 0.125)


# --- item 7: batch_invariant must be a bool -----------------------------------------------------

@pytest.mark.parametrize("mode", (1, 0, 2, 1.0, None, "yes"))
def test_wrappers_take_only_a_bool_batch_invariant(mode):
    # torch.ops' parser converts an int to a bool silently (as for every bool argument of every
    # torch op); the paged_ops wrappers, where Python sees the value, refuse anything else.
    c = make_case([10], [3], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    with pytest.raises(TypeError, match="batch_invariant"):
        paged_ops.prefill_attention(*c.prefill_args(nan_like(c.query)), batch_invariant=mode)
    d = make_case([10], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    with pytest.raises(TypeError, match="batch_invariant"):
        paged_ops.decode_attention(*d.decode_args(nan_like(d.query)), batch_invariant=mode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_sink_makes_a_row_nan_even_with_no_key(backend):
    # The reference's sum over zero keys was 0 even when its lse was NaN; a NaN sink is a NaN row.
    device = device_of(backend)
    c = make_case([0, 12], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, device=device)
    sinks = torch.tensor([NAN, 0.5, -INF, INF], device=device)
    lse = lse_buffer(c)
    out = run_decode(backend, c, sinks=sinks, lse=lse)
    ref, ref_lse = c.reference_decode_lse(sinks=sinks)
    assert ref[:, 0].isnan().all() and out[:, 0].isnan().all() and lse.cpu()[:, 0].isnan().all()
    assert (out[0, 1:] == 0).all() and (ref[0, 1:] == 0).all()
    assert_close(out[1, 1:3], ref[1, 1:3], F32)

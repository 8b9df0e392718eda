"""Issue #27's contract edges on the Triton kernels' own paths (tests/test_contract_edges.py runs
them through the router for every backend): small prefill tiles, so the masked tiles (causal
diagonal, both window edges) are many and the unmasked fast path runs between them; forced
flash-decoding splits and the reduce; the batch-invariant row-wise path; the merge kernels.

- A: a hidden key's inf / NaN K or V never reaches a row that cannot see it (masked prefill
  tiles read such a V as 0 and add p * v back for exactly the rows that see it).
- B: rows without keys (q_len > seq_len, seq_len 0, windows that exclude everything): out 0,
  lse -inf, or 0 / the sink; the reduce over no partition; merges of nothing.
- C: sinks -inf / +inf / NaN, soft-caps at both ends of [2^-126, 2^126].
- D: window_right (non-causal local attention) in the prefill kernel and the row-wise path.
- E: per-sequence and mixed K/V fp8 scales (attention), mixed forms in reshape_and_cache.
- F: merge_states, N-way.
Everything is compared against paged_ops.reference in float64.
"""
from __future__ import annotations

import math

import pytest
import torch

from paged_ops import reference
from paged_ops import triton as triton_backend
from paged_ops.testing import assert_bits_equal, assert_close, make_case, nan_like, poison
from paged_ops.triton import decode, prefill
from paged_ops.triton._common import Variants

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
INF, NAN = math.inf, math.nan


pytestmark = pytest.mark.usefixtures("untuned_configs")


def _reference(case, decode_op: bool, causal: bool = True, **kw):
    """(out, lse) of the float64 reference on the case's (possibly poisoned) cache."""
    out = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    args = case._on_cpu_in_float64(case.decode_args(out) if decode_op else case.prefill_args(out, causal))
    kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    (reference.decode_attention if decode_op else reference.prefill_attention)(*args, lse=lse, **kw)
    return out, lse


def _nan_lse(case) -> torch.Tensor:
    return torch.full(case.query.shape[:2], NAN, dtype=torch.float32, device=case.device)


def _like_reference(out, ref, dtype, msg="", exact_nonfinite=True):
    """NaN and +-inf exactly where the reference has them (exact_nonfinite; else non-finite
    where it is: the contract lets a visible non-finite K make a row NaN where the reference's
    lse is +inf), the finite rest within the budget."""
    out, ref = out.cpu().double(), ref.cpu()
    assert torch.equal(out.isfinite(), ref.isfinite()), f"finite pattern differs {msg}: {(out.isfinite() != ref.isfinite()).nonzero()[:8]}"
    if exact_nonfinite:
        assert torch.equal(out.isnan(), ref.isnan()), f"NaN pattern differs {msg}: {(out.isnan() != ref.isnan()).nonzero()[:8]}"
        assert torch.equal(out == INF, ref == INF) and torch.equal(out == -INF, ref == -INF), f"inf pattern differs {msg}"
    finite = ref.isfinite()
    if (ref[finite] == 0).all():  # only empty rows: exact zeros (a relative error has no scale)
        assert (out[finite] == 0).all(), msg
    else:
        assert_close(out[finite], ref[finite], dtype, msg)


def _set_token(case, seq: int, pos: int, which: str, value: float, kv_head: int = 0, dim: int = 5) -> None:
    bs = case.key_cache.shape[1]
    block = int(case.block_tables[seq, pos // bs])
    cache = case.key_cache if which == "k" else case.value_cache
    if cache.dtype == E4M3:  # no inf in e4m3fn: its NaN byte
        cache.view(torch.uint8)[block, pos % bs, kv_head, dim] = 0x7F
    else:
        cache[block, pos % bs, kv_head, dim] = value


# ---------------------------------------------------------------------------------------------
# A: masked keys are never read into a row

# (causal, window_left, window_right, sequence 0's poisoned position): the issue's repro (token 35
# of a 40-token causal prefill, on the diagonal tile), a key left of the last rows' windows (the
# first, masked tile of a window), a key right of the first rows' right windows (non-causal).
GEOMETRIES = [(True, -1, -1, 35), (True, 6, -1, 26), (False, -1, 3, 20), (False, 4, 4, 30)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"causal{int(g[0])}-wl{g[1]}-wr{g[2]}-pos{g[3]}")
@pytest.mark.parametrize("which,value", [("v", INF), ("v", -INF), ("v", NAN), ("k", INF), ("k", NAN)])
def test_prefill_hidden_nonfinite_key_or_value_reaches_only_rows_that_see_it(geometry, which, value):
    # 40 query rows over 40 tokens (16-row tiles: the key sits in a masked tile of several query
    # tiles, hidden from some rows of each, visible to others) plus a second sequence; the
    # reference reads a key's value only for the rows that see it.
    causal, window_left, window_right, pos = geometry
    case = make_case([40, 23], [40, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=3, seed=4,
                     device=DEVICE)
    _set_token(case, 0, pos, which, value)
    kw = {"window_left": window_left, "window_right": window_right}
    ref, ref_lse = _reference(case, False, causal, **kw)
    assert ref[:40].isfinite().all(-1).any() and not ref[:40].isfinite().all(), "the key must be seen by some rows only"
    for config in (SMALL_TILES, prefill.DEFAULT_CONFIG):
        out, lse = nan_like(case.query), _nan_lse(case)
        prefill.run_prefill(*case.prefill_args(out, causal), config,
                            Variants(window_left=window_left, window_right=window_right, lse=lse))
        _like_reference(out, ref, F32, f"config {config}", exact_nonfinite=which == "v")
        _like_reference(lse, ref_lse, F32, f"config {config}", exact_nonfinite=which == "v")


@pytest.mark.parametrize("causal,window_left,window_right", [(True, -1, -1), (True, 5, -1), (False, 3, 6),
                                                              (False, -1, 0)])
def test_prefill_tile_classes_over_every_offset(causal, window_left, window_right):
    # Which KV tiles of a query tile are masked (some row does not see some key) and which take
    # the fast path depends on the rows' positions modulo the tile sizes: 9 or 10 query rows
    # (8-row query tiles at group 2: a last tile of 1 or 2 rows) after every context length 0..16
    # (16-key tiles), inf in every token no row sees.
    contexts = range(17)
    q_lens = [9 + c % 2 for c in contexts]
    case = make_case([q + c for q, c in zip(q_lens, contexts)], q_lens, num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=5, seed=16, device=DEVICE)
    kw = {"window_left": window_left, "window_right": window_right}
    case.poison_hidden(causal=causal, **kw)
    ref, ref_lse = _reference(case, False, causal, **kw)
    out, lse = nan_like(case.query), _nan_lse(case)
    prefill.run_prefill(*case.prefill_args(out, causal), SMALL_TILES, Variants(lse=lse, **kw))
    assert_close(out, ref, F32)
    assert_close(lse, ref_lse, F32)


@pytest.mark.parametrize("dtype,cache_dtype", [(F16, F16), (BF16, BF16), (F16, E5M2), (BF16, E4M3)])
def test_prefill_hidden_nonfinite_values_16_bit_and_fp8(dtype, cache_dtype):
    # The corrected path in the compute dtypes: the rows that see the value get p * v with the
    # dot's own (rounded) p, the others the clean result; fp8 caches' inf / NaN bytes.
    case = make_case([40], [40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, seed=5, device=DEVICE)
    for j in (33, 35, 37):
        _set_token(case, 0, j, "v", INF if j != 37 else -INF, kv_head=j % 2, dim=j % 7)
    ref, _ = _reference(case, False)
    out = nan_like(case.query)
    prefill.run_prefill(*case.prefill_args(out), SMALL_TILES)
    _like_reference(out, ref, dtype)


def test_batch_invariant_prefill_with_hidden_nonfinite_values_equals_decode():
    # The row-wise path loads only a row's own keys; rows before the poisoned token stay exact
    # and each row keeps the bits of the decode of its first p + 1 tokens.
    case = make_case([40], [40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, seed=6,
                     device=DEVICE)
    _set_token(case, 0, 35, "v", INF)
    ref, _ = _reference(case, False)
    out, lse = nan_like(case.query), _nan_lse(case)
    triton_backend.prefill_attention(*case.prefill_args(out), lse=lse, batch_invariant=True)
    _like_reference(out, ref, F16)
    dec_out, dec_lse = nan_like(case.query), _nan_lse(case)
    seq_lens = torch.arange(1, 41, dtype=torch.int32, device=DEVICE)
    triton_backend.decode_attention(dec_out, case.query, case.key_cache, case.value_cache,
                                    case.block_tables[[0] * 40].contiguous(), seq_lens, case.scale, None, None,
                                    lse=dec_lse, batch_invariant=True)
    assert_bits_equal(dec_out, out)
    assert_bits_equal(dec_lse, lse)


# ---------------------------------------------------------------------------------------------
# B: rows without keys; C: non-finite sinks

# Per query head: finite, none (-inf), everything (+inf), finite. A NaN sink (a NaN row) is
# tested on rows with keys: for a row without any, the reference's out depends on whether its
# sequence has keys at all (0 for seq_len 0, NaN for keys it does not see).
SINKS = torch.tensor([-0.45, -INF, INF, -0.9])  # finite ones whose fp32 round trip through base 2 is inexact


@pytest.mark.parametrize("config", [SMALL_TILES, prefill.DEFAULT_CONFIG], ids=["small", "default"])
@pytest.mark.parametrize("sinks", [False, True])
def test_prefill_rows_before_the_first_key_and_nonfinite_sinks(config, sinks):
    # q_len > seq_len (causal): the first q_len - seq_len rows see no key (out 0, lse -inf, or
    # 0 / the sink); a sequence of no keys at all; a row's last tile of keys partly empty.
    case = make_case([6, 0, 30], [20, 3, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=3, seed=7,
                     device=DEVICE)
    kw = {"sinks": SINKS.to(DEVICE)} if sinks else {}
    ref, ref_lse = _reference(case, False, **kw)
    assert (ref_lse[:14] == (SINKS if sinks else -INF)).all() or sinks
    out, lse = nan_like(case.query), _nan_lse(case)
    prefill.run_prefill(*case.prefill_args(out), config, Variants(lse=lse, **kw))
    _like_reference(out, ref, F32)
    _like_reference(lse, ref_lse, F32)
    assert (out[:14] == 0).all()
    assert torch.equal(lse[:14].cpu(), SINKS.expand(14, 4) if sinks else torch.full((14, 4), -INF))  # bits: the sink


@pytest.mark.parametrize("mode", ["unsplit", "split3", "batch_invariant"])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_empty_sequences_and_nonfinite_sinks(mode, sinks):
    # seq_len 0 rows (padded decode slots) between real ones: no program of the row reads a key;
    # unsplit, its one program writes 0 / -inf; split, the reduce merges no partition.
    case = make_case([0, 40, 0, 77], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=8, device=DEVICE)
    kw = {"sinks": SINKS.to(DEVICE)} if sinks else {}
    ref, ref_lse = _reference(case, True, **kw)
    out, lse = nan_like(case.query), _nan_lse(case)
    if mode == "batch_invariant":
        triton_backend.decode_attention(*case.decode_args(out), lse=lse, batch_invariant=True, **kw)
    else:
        used = decode.run_decode(*case.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16),
                                 num_splits=1 if mode == "unsplit" else 3, variants=Variants(lse=lse, **kw))
        assert (used > 1) == (mode == "split3")
    _like_reference(out, ref, F32, mode)
    _like_reference(lse, ref_lse, F32, mode)
    assert (out[[0, 2]] == 0).all()
    assert torch.equal(lse[[0, 2]].cpu(), SINKS.expand(2, 4) if sinks else torch.full((2, 4), -INF))  # bits


@pytest.mark.parametrize("mode", ["prefill", "unsplit", "split3", "batch_invariant"])
def test_nonfinite_sinks_split_and_small_tiles(mode):
    # sinks -inf: no sink; +inf: out 0, lse +inf; NaN: NaN rows; in the unsplit decode kernel's
    # end of row, the reduce (split), the row-wise path and the prefill kernel.
    case = make_case([30, 70], [1, 12] if mode == "prefill" else None, num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=16, seed=15, device=DEVICE)
    sinks = torch.tensor([-INF, INF, NAN, 0.5, -INF, INF, 2.0, NAN], device=DEVICE)
    ref, ref_lse = _reference(case, mode != "prefill", sinks=sinks)
    out, lse = nan_like(case.query), _nan_lse(case)
    if mode == "prefill":
        prefill.run_prefill(*case.prefill_args(out), SMALL_TILES, Variants(sinks=sinks, lse=lse))
    elif mode == "batch_invariant":
        triton_backend.decode_attention(*case.decode_args(out), lse=lse, batch_invariant=True, sinks=sinks)
    else:
        decode.run_decode(*case.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16),
                          num_splits=1 if mode == "unsplit" else 3, variants=Variants(sinks=sinks, lse=lse))
    assert out[:, [2, 7]].isnan().all() and (out[:, [1, 5]] == 0).all() and (lse[:, [1, 5]] == INF).all()
    _like_reference(out, ref, F32, mode)
    _like_reference(lse, ref_lse, F32, mode)


@pytest.mark.parametrize("softcap", [2.0 ** 126, 2.0 ** -126, 3e37])
def test_softcap_at_both_ends_of_its_range(softcap):
    # A cap of 2^126 is the identity on these scores (s / cap underflows: the scores must pass
    # through exactly, not through a subnormal 1 / (cap log2 e)); 2^-126 caps every score to ~0.
    case = make_case([40, 9], [5, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=9,
                     device=DEVICE)
    ref, ref_lse = _reference(case, False, softcap=softcap)
    out, lse = nan_like(case.query), _nan_lse(case)
    prefill.run_prefill(*case.prefill_args(out), SMALL_TILES, Variants(softcap=softcap, lse=lse))
    assert_close(out, ref, F32)
    assert_close(lse, ref_lse, F32)
    dcase = make_case([40, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=9, device=DEVICE)
    ref, ref_lse = _reference(dcase, True, softcap=softcap)
    out, lse = nan_like(dcase.query), _nan_lse(dcase)
    decode.run_decode(*dcase.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=2,
                      variants=Variants(softcap=softcap, lse=lse))
    assert_close(out, ref, F32)
    assert_close(lse, ref_lse, F32)


# ---------------------------------------------------------------------------------------------
# D: window_right

WINDOWS = [(-1, 0), (-1, 5), (3, 0), (10, 17), (0, 40)]


@pytest.mark.parametrize("window_left,window_right", WINDOWS)
def test_prefill_window_right_small_tiles(window_left, window_right):
    # Non-causal local attention over chunked prefill (cached context), a decode row, q_len >
    # seq_len (rows whose right window ends before the first key: nothing), every token no row
    # sees poisoned with inf in K and V.
    case = make_case([70, 41, 4, 30], [70, 1, 9, 12], num_heads=4, num_kv_heads=2, head_size=64, block_size=3,
                     seed=10, device=DEVICE)
    kw = {"window_left": window_left, "window_right": window_right}
    case.poison_hidden(causal=False, **kw)
    ref, ref_lse = _reference(case, False, causal=False, **kw)
    out, lse = nan_like(case.query), _nan_lse(case)
    prefill.run_prefill(*case.prefill_args(out, False), SMALL_TILES, Variants(lse=lse, **kw))
    _like_reference(out, ref, F32)
    _like_reference(lse, ref_lse, F32)
    # Through the entry point (default config), window_right as the last positional argument.
    out2 = nan_like(case.query)
    triton_backend.prefill_attention(*case.prefill_args(out2, False), 0.0, window_left, None, None, None, False,
                                     window_right)
    _like_reference(out2, ref, F32)


@pytest.mark.parametrize("window_left,window_right", [(-1, 3), (20, 300)])
def test_batch_invariant_window_right(window_left, window_right):
    # The row-wise path: a non-causal row's keys end at p + window_right; rows whose window
    # ends before the first key have none (the reduce of no partition).
    case = make_case([600, 9], [6, 12], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                     seed=11, device=DEVICE)
    kw = {"window_left": window_left, "window_right": window_right}
    ref, ref_lse = _reference(case, False, causal=False, **kw)
    out, lse = nan_like(case.query), _nan_lse(case)
    triton_backend.prefill_attention(*case.prefill_args(out, False), lse=lse, batch_invariant=True, **kw)
    _like_reference(out, ref, F16)
    _like_reference(lse, ref_lse, F32)


def test_window_right_is_dropped_under_causal_and_bounds_the_splits():
    # Causal rows stop at p: window_right changes nothing and compiles nothing new; a non-causal
    # window of both edges bounds the keys a row reads (the split plan).
    v = Variants(window_left=7, window_right=5)
    assert v.for_causal(True).flags() == Variants(window_left=7).flags()
    assert v.for_causal(False).flags()["HAS_WINDOW_RIGHT"]
    assert decode.visible_bound(4096, v, causal=False) == 13
    assert decode.visible_bound(4096, Variants(window_right=5), causal=False) == 4096


# ---------------------------------------------------------------------------------------------
# E: per-sequence and mixed K/V scales

@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_kind", ["seq", "head/tensor", "tensor/seq"])
def test_fp8_scale_forms(cache_dtype, scale_kind):
    # scale[s * seq_stride + h * head_stride] for K and V apart, in decode (split and unsplit),
    # prefill and the row-wise path.
    case = make_case([33, 70, 5], [4, 70, 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                     cache_dtype=cache_dtype, scale_kind=scale_kind, seed=12, device=DEVICE)
    ref, ref_lse = _reference(case, False)
    out, lse = nan_like(case.query), _nan_lse(case)
    prefill.run_prefill(*case.prefill_args(out), SMALL_TILES, Variants(lse=lse))
    assert_close(out, ref, F32, "prefill")
    assert_close(lse, ref_lse, F32, "prefill")
    out = nan_like(case.query)
    triton_backend.prefill_attention(*case.prefill_args(out), batch_invariant=True)
    assert_close(out, ref, F32, "batch-invariant prefill")
    dcase = make_case([33, 70, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, cache_dtype=cache_dtype,
                      scale_kind=scale_kind, seed=12, device=DEVICE)
    ref, ref_lse = _reference(dcase, True)
    for splits in (1, 3):
        out, lse = nan_like(dcase.query), _nan_lse(dcase)
        decode.run_decode(*dcase.decode_args(out), dict(decode.DEFAULT_CONFIG, BLOCK_N=16), num_splits=splits,
                          variants=Variants(lse=lse))
        assert_close(out, ref, F32, f"decode, {splits} splits")
        assert_close(lse, ref_lse, F32, f"decode, {splits} splits")


@pytest.mark.parametrize("k_kind,v_kind", [("head", "tensor"), ("tensor", "head")])
def test_reshape_and_cache_k_and_v_scale_forms_apart(k_kind, v_kind):
    g = torch.Generator().manual_seed(13)
    num_tokens, kvh, d = 7, 3, 40
    key, value = torch.randn(num_tokens, kvh, d, generator=g), torch.randn(num_tokens, kvh, d, generator=g)
    scales = {"tensor": torch.rand(1, generator=g) * 0.05 + 0.01, "head": torch.rand(kvh, generator=g) * 0.05 + 0.01}
    k_scale, v_scale = scales[k_kind].to(DEVICE), scales[v_kind].to(DEVICE)
    slots = torch.tensor([5, -1, 0, 17, 9, 30, 2], device=DEVICE)
    caches = [poison(torch.empty(4, 8, kvh, d, dtype=E4M3, device=DEVICE)) for _ in range(4)]
    triton_backend.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), caches[0], caches[1], slots, k_scale, v_scale)
    reference.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), caches[2], caches[3], slots, k_scale, v_scale)
    assert_bits_equal(caches[0], caches[2])
    assert_bits_equal(caches[1], caches[3])


# ---------------------------------------------------------------------------------------------
# F: merge_states; merges of nothing

def _check_merge(out, out_lse, ref, ref_lse, dtype):
    _like_reference(out, ref, dtype)
    if out_lse is not None:
        _like_reference(out_lse, ref_lse, F32)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("num_states", [0, 1, 2, 5])
def test_merge_states_matches_reference(dtype, num_states):
    # Strided states (a state axis that is not the outer one, a padded head axis) and lses (a
    # transposed view); rows with one -inf state (its out NaN), every state -inf, a +inf and a NaN
    # lse; head size 40 (a padded tile), 5 heads (a partial head block).
    g = torch.Generator().manual_seed(num_states)
    T, H, D = 6, 5, 40
    states = torch.randn(num_states, T, H + 1, D, generator=g).to(dtype).to(DEVICE).transpose(0, 1)[:, :, :H]
    states_lse = (torch.randn(num_states, H, T, generator=g) * 3).to(DEVICE).permute(2, 0, 1)
    if num_states:
        states_lse[0, 0, 0] = -INF
        states[0, 0, 0] = NAN
        states_lse[1, :, 1] = -INF
        states[1, :, 1] = NAN
        states_lse[2, -1, 2] = INF
        states_lse[3, 0, 3] = NAN
    out = poison(torch.empty(T, H, 2 * D, dtype=dtype, device=DEVICE))[..., :D]
    out_lse = torch.full((T, H), NAN, device=DEVICE)
    triton_backend.merge_states(out, out_lse, states, states_lse)
    ref = torch.zeros(T, H, D, dtype=torch.float64)
    ref_lse = torch.full((T, H), -INF, dtype=torch.float64)
    if num_states:  # (the reference's own no-state case does not run on strided lses)
        reference.merge_states(ref, ref_lse, states.cpu(), states_lse.cpu())
    _check_merge(out, out_lse, ref, ref_lse, dtype)
    if num_states == 0:
        assert (out == 0).all() and (out_lse == -INF).all()
    out2 = nan_like(out)
    triton_backend.merge_states(out2, None, states, states_lse)
    assert_bits_equal(out2, out)


def test_merge_states_of_splits_is_full_attention():
    # Four key ranges of one 6-row chunk (non-causal over the first three, causal over the last),
    # stacked as states: their merge is attention over all keys.
    case = make_case([64], [6], num_heads=4, num_kv_heads=2, head_size=64, block_size=4, seed=14, device=DEVICE)
    outs, lses = [], []
    for lo, hi, causal in ((0, 16, False), (16, 32, False), (32, 48, False), (48, 64, True)):
        part, part_lse = nan_like(case.query), _nan_lse(case)
        prefill.run_prefill(part, case.query, case.key_cache, case.value_cache,
                            case.block_tables[:, lo // 4:].contiguous(), case.cu_seqlens_q,
                            torch.tensor([hi - lo], dtype=torch.int32, device=DEVICE), 6, case.scale, causal, None,
                            None, SMALL_TILES, Variants(lse=part_lse))
        outs.append(part)
        lses.append(part_lse)
    out, out_lse = nan_like(case.query), _nan_lse(case)
    triton_backend.merge_states(out, out_lse, torch.stack(outs, 1), torch.stack(lses, 1))
    ref, ref_lse = _reference(case, False)
    assert_close(out, ref, F32)
    assert_close(out_lse, ref_lse, F32)


def test_merge_attention_states_of_two_empty_sides_is_zero():
    T, H, D = 3, 2, 16
    empty_lse = torch.full((T, H), -INF, device=DEVICE)
    side = torch.full((T, H, D), NAN, device=DEVICE)  # attention over no keys may leave anything
    out, out_lse = nan_like(side), torch.full((T, H), NAN, device=DEVICE)
    triton_backend.merge_attention_states(out, out_lse, side, empty_lse, side, empty_lse)
    assert (out == 0).all() and (out_lse == -INF).all()

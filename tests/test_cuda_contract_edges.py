"""The contract's edges (#27) in the CUDA kernels themselves, path by path, with explicit launch
configurations (the test namespaces' *_config ops): the tensor-core prefill (its edge tiles' add-back
of non-finite values), the CUDA-core prefill, decode one pass / split-KV / shared-KV staging
(group > 8), and the batch-invariant mode (prefill rows through the decode kernel). Every case runs
on the CPU emulator (target "emu") and, where the cuda backend and a GPU are present, on each GPU.
tests/test_contract_edges.py checks the same contract through each backend's default paths.

Every case compares with paged_ops.reference in float64 on fresh random inputs, outputs NaN-poisoned.
"""
from __future__ import annotations

import math

import pytest
import torch

from paged_ops import reference
from paged_ops.testing import assert_close, assert_lse_close, cuda_targets, make_case, nan_like, poison

TARGETS = cuda_targets()  # the target fixture's values (tests/conftest.py)
if not TARGETS:
    pytest.skip("neither the cuda_emu backend nor a GPU with the cuda backend", allow_module_level=True)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INF, NAN = math.inf, math.nan

# LaunchConfig: [threads, partition_size, kv_tile, force_split, tensor_cores] (kernels/params.h).
TC = [0, 0, 0, 0, 1]
CUDA_CORES = [0, 0, 0, 0, -1]
CUDA_CORES_SMALL = [64, 0, 8, 0, -1]  # 8-row tiles of 8 keys: many edge tiles
PREFILL_CONFIGS = {"tc": TC, "cuda_cores": CUDA_CORES, "cuda_cores_small": CUDA_CORES_SMALL}
ONE_PASS = [0, -1]        # partition_size < 0: never split
SPLIT = [0, 16, 0, 1]     # partitions of 16 keys, always split
DECODE_CONFIGS = {"one_pass": ONE_PASS, "split": SPLIT}


def ops(target):
    return torch.ops.paged_cuda_emu_test if target == "emu" else torch.ops.paged_cuda_test


def device_of(target):
    return "cpu" if target == "emu" else target


def on(target, kw):
    return {k: v.to(device_of(target)) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def prefill(target, case, config, causal=True, batch_invariant=False, **variants):
    """(out, lse) of prefill_attention_config on target, on the CPU; both start NaN."""
    case = case.to(device_of(target))
    out = nan_like(case.query)
    lse = poison(torch.empty(case.query.shape[:2], dtype=torch.float32, device=case.device))
    ops(target).prefill_attention_config(*case.prefill_args(out, causal), config, lse=lse,
                                         batch_invariant=batch_invariant, **on(target, variants))
    return out.cpu(), lse.cpu()


def decode(target, case, config, batch_invariant=False, **variants):
    case = case.to(device_of(target))
    out = nan_like(case.query)
    lse = poison(torch.empty(case.query.shape[:2], dtype=torch.float32, device=case.device))
    ops(target).decode_attention_config(*case.decode_args(out), config, lse=lse, batch_invariant=batch_invariant,
                                        **on(target, variants))
    return out.cpu(), lse.cpu()


def store(case, s, positions, which, value, dims=slice(None)):
    """value into elements `dims` of tokens `positions` of sequence s, in K or V (all KV heads)."""
    cache = case.key_cache if which == "k" else case.value_cache
    bs = cache.shape[1]
    for j in positions:
        block, off = int(case.block_tables[s, j // bs]), j % bs
        if cache.dtype == E4M3:  # no inf in e4m3fn: its NaN byte
            cache.view(torch.uint8)[block, off, :, dims] = 0x7F
        else:
            cache[block, off, :, dims] = value


def assert_matches_reference(out, lse, ref, ref_lse, dtype):
    """Non-finite exactly where the reference is (element by element), the rest within budget; lse
    NaN and +inf exactly where the reference's is, the rest (-inf included) within budget."""
    finite = ref.isfinite()
    assert torch.equal(out.isfinite(), finite), (
        f"non-finite elements differ: {int((out.isfinite() != finite).sum())} of {finite.numel()}")
    assert_close(out[finite], ref[finite], dtype)
    assert torch.equal(lse.isnan(), ref_lse.isnan()), "NaN lse entries differ"
    assert torch.equal(lse.isposinf(), ref_lse.isposinf()), "+inf lse entries differ"
    rest = ~(ref_lse.isnan() | ref_lse.isposinf())
    assert_lse_close(lse[rest], ref_lse[rest], dtype)


# ---- A: keys a row cannot see never reach it -------------------------------------------------------
@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("dtype,cache_dtype", [(BF16, BF16), (F16, F16), (F16, E5M2), (BF16, E4M3)])
@pytest.mark.parametrize("value", [INF, NAN])
def test_causal_diagonal_tile_keeps_hidden_values_out(target, config, dtype, cache_dtype, value):
    # A non-finite V element in the middle of the causal diagonal tile (group 2: 64 packed rows are
    # 32 positions, so the tile holds keys hidden from some rows and seen by others). Rows that see
    # the token get it (inf / NaN in exactly that element, as the reference's IEEE p * v); every
    # other row and every other element equals the reference: a kernel that multiplies the hidden
    # value by 0 makes NaN of them.
    case = make_case([40, 70], [40, 50], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                     cache_dtype=cache_dtype, seed=1)
    store(case, 0, [35], "v", value, dims=slice(5, 6))
    store(case, 1, [43, 57], "v", value, dims=slice(60, 62))
    out, lse = prefill(target, case, PREFILL_CONFIGS[config])
    ref, ref_lse = case.reference_prefill_lse()
    assert not ref[35:40].isfinite().all() and ref[:35].isfinite().all(), "the test's premise"
    assert_matches_reference(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("which", ["k", "v"])
def test_whole_hidden_token_nonfinite(target, config, which):
    # Every element of K or V of a token inside the diagonal tile: rows before it stay exact.
    case = make_case([40], [40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16, seed=2)
    store(case, 0, [35], which, INF)
    out, lse = prefill(target, case, PREFILL_CONFIGS[config])
    ref, ref_lse = case.reference_prefill_lse()
    assert_close(out[:35], ref[:35], BF16)
    assert_lse_close(lse[:35], ref_lse[:35], BF16)
    assert not out[35:].isfinite().all()


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("causal,window_left,window_right", [(True, 9, -1), (False, 9, 6), (False, -1, 3)])
def test_window_edge_tiles_keep_hidden_values_out(target, config, causal, window_left, window_right):
    # A window's first tile (keys before some rows' windows) and, without causal, the tile of the
    # window_right edge (keys after some rows' windows): non-finite V elements at positions each
    # seen by some rows and hidden from others.
    case = make_case([120], [60], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, dtype=F16, seed=3)
    store(case, 0, [61, 70, 77, 100, 113], "v", INF, dims=slice(8, 9))
    store(case, 0, [66, 90], "v", -INF, dims=slice(40, 41))
    kw = dict(window_left=window_left, window_right=window_right)
    out, lse = prefill(target, case, PREFILL_CONFIGS[config], causal, **kw)
    ref, ref_lse = case.reference_prefill_lse(causal, **kw)
    assert not ref.isfinite().all() and ref.isfinite().any(-1).all(), "the test's premise"
    assert_matches_reference(out, lse, ref, ref_lse, F16)


@pytest.mark.parametrize("num_heads", [4, 24])  # group 2 (registers) and 12 (shared-KV staging)
def test_batch_invariant_rows_never_read_hidden_values(target, num_heads):
    # The batch-invariant prefill runs each row through the decode kernel over exactly its keys.
    case = make_case([40, 300], [40, 9], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=BF16, seed=4)
    store(case, 0, [35], "v", INF)
    store(case, 1, [297], "k", NAN)  # seen by the last 3 rows of sequence 1 (positions 297..299)
    out, lse = prefill(target, case, [], batch_invariant=True)
    ref, ref_lse = case.reference_prefill_lse()
    assert_close(out[:35], ref[:35], BF16)
    assert_close(out[40:46], ref[40:46], BF16)
    assert_lse_close(lse[:35], ref_lse[:35], BF16)
    assert_lse_close(lse[40:46], ref_lse[40:46], BF16)
    assert not out[35:40].isfinite().any(-1).all() and out[46:].isnan().all()


@pytest.mark.parametrize("config", DECODE_CONFIGS)
@pytest.mark.parametrize("num_heads", [4, 24])
def test_decode_window_never_reads_keys_before_it(target, config, num_heads):
    # inf K and V in every token before the window (poison_hidden): one pass, split-KV, shared-KV.
    case = make_case([300, 41, 5], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16, dtype=F16,
                     seed=13)
    assert case.poison_hidden(True, 40) > 0
    out, lse = decode(target, case, DECODE_CONFIGS[config], window_left=40)
    ref, ref_lse = case.reference_decode_lse(window_left=40)
    assert_close(out, ref, F16)
    assert_lse_close(lse, ref_lse, F16)


# ---- B: rows with nothing to weigh ----------------------------------------------------------------
# No NaN sink with rows that see no key: the reference makes those rows NaN in a sequence with keys
# but 0 in a sequence of none (its einsum over zero keys); a NaN sink is tested with keys below.
SINKS = {"none": None, "finite": [0.3, -1.5, 2.0, 0.0], "inf": [INF, -INF, 0.5, -2.0]}


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
@pytest.mark.parametrize("sinks", SINKS)
def test_prefill_rows_before_the_first_key(target, config, sinks):
    # q_len > seq_len (seq_len 0 too): the first rows see no key. Out 0, lse -inf or the sink's.
    case = make_case([3, 0, 33, 20], [5, 2, 40, 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                     dtype=F16, seed=5)
    kw = {} if SINKS[sinks] is None else {"sinks": torch.tensor(SINKS[sinks])}
    out, lse = prefill(target, case, PREFILL_CONFIGS[config], **kw)
    ref, ref_lse = case.reference_prefill_lse(**kw)
    empty = torch.zeros(case.query.shape[0], dtype=torch.bool)
    empty[[0, 1, 5, 6]] = True
    empty[7:14] = True  # sequence 2: 40 rows over 33 keys
    assert_matches_reference(out, lse, ref, ref_lse, F16)
    assert (out[empty] == 0).all()
    want = torch.full((4,), -INF) if SINKS[sinks] is None else torch.tensor(SINKS[sinks])
    assert torch.equal(lse[empty], want.expand(int(empty.sum()), 4)), "lse: -inf or the sink exactly"


@pytest.mark.parametrize("config", PREFILL_CONFIGS)
def test_windows_that_exclude_every_key(target, config):
    # Non-causal: window_right 1 puts rows more than 1 before the first key out of reach.
    case = make_case([4, 10], [9, 10], num_heads=2, num_kv_heads=2, head_size=32, block_size=4, dtype=F16, seed=6)
    out, lse = prefill(target, case, PREFILL_CONFIGS[config], False, window_left=0, window_right=1)
    ref, ref_lse = case.reference_prefill_lse(False, window_left=0, window_right=1)
    assert (ref_lse[:4] == -INF).all(), "the test's premise: rows -5..-2 see nothing"
    assert_matches_reference(out, lse, ref, ref_lse, F16)


@pytest.mark.parametrize("config", DECODE_CONFIGS)
@pytest.mark.parametrize("num_heads", [4, 24])
@pytest.mark.parametrize("sinks", SINKS)
def test_decode_of_empty_sequences(target, config, num_heads, sinks):
    # seq_len 0 rows among others, in one pass, split-KV (the reduce of a row with no partition)
    # and the shared-KV kernel; and the batch-invariant mode.
    case = make_case([0, 9, 0, 70], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16, dtype=BF16,
                     seed=7)
    kw = {} if SINKS[sinks] is None else {"sinks": torch.tensor(SINKS[sinks] * (num_heads // 4))}
    ref, ref_lse = case.reference_decode_lse(**kw)
    for bi in (False, True):
        out, lse = decode(target, case, DECODE_CONFIGS[config], batch_invariant=bi, **kw)
        assert_matches_reference(out, lse, ref, ref_lse, BF16)
        assert (out[[0, 2]] == 0).all()
        assert torch.equal(lse[[0, 2]], ref_lse[[0, 2]].float()), "lse: -inf or the sink exactly"


@pytest.mark.parametrize("config", [*DECODE_CONFIGS, "batch_invariant"])
def test_decode_row_of_only_minus_inf_scores(target, config):
    # A query with -inf in dim 0 against keys whose dim 0 is > 0: every score -inf, so nothing to
    # weigh: out 0, lse -inf (the reference). Split, a partition with l = 0 must add nothing.
    case = make_case([50, 50], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F32, seed=8)
    case.key_cache[..., 0] = case.key_cache[..., 0].abs() + 0.5  # NaN slots stay NaN
    case.query[1, 2, 0] = -INF
    ref, ref_lse = case.reference_decode_lse()
    bi = config == "batch_invariant"
    out, lse = decode(target, case, [] if bi else DECODE_CONFIGS[config], batch_invariant=bi)
    assert ref_lse[1, 2] == -INF and (ref[1, 2] == 0).all()
    assert (out[1, 2] == 0).all() and lse[1, 2] == -INF
    assert_matches_reference(out, lse, ref, ref_lse, F32)


# ---- C: non-finite and extreme sinks, softcap at its bound ---------------------------------------
EXTREME_SINKS = [-INF, INF, NAN, 3.0e38, -3.0e38, 0.5, 80.0, -80.0]


@pytest.mark.parametrize("path", [*PREFILL_CONFIGS, *DECODE_CONFIGS, "batch_invariant"])
def test_extreme_sinks_follow_the_reference(target, path):
    # sink * log2(e) overflows float past ~2.4e38: a finite sink of 3e38 still dominates (out 0,
    # lse = sink) and -3e38 still vanishes; +-inf and NaN as the reference.
    num_heads = 8
    if path in PREFILL_CONFIGS or path == "batch_invariant":
        case = make_case([30, 70], [5, 12], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=F16, seed=9)
    else:
        case = make_case([30, 70, 1], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=F16, seed=9)
    sinks = torch.tensor(EXTREME_SINKS)
    if path in PREFILL_CONFIGS:
        out, lse = prefill(target, case, PREFILL_CONFIGS[path], sinks=sinks)
        ref, ref_lse = case.reference_prefill_lse(sinks=sinks)
    elif path == "batch_invariant":
        out, lse = prefill(target, case, [], batch_invariant=True, sinks=sinks)
        ref, ref_lse = case.reference_prefill_lse(sinks=sinks)
    else:
        out, lse = decode(target, case, DECODE_CONFIGS[path], sinks=sinks)
        ref, ref_lse = case.reference_decode_lse(sinks=sinks)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan())
    keep = ~ref.isnan().any(-1)
    assert_close(out[keep], ref[keep], F16)
    assert torch.equal(lse[:, [1, 3]], torch.tensor([INF, 3.0e38]).expand(lse.shape[0], 2))
    assert (out[:, [1, 3]] == 0).all()
    finite = keep & ref_lse.isfinite()
    assert_lse_close(lse[finite], ref_lse[finite], F16)


@pytest.mark.parametrize("path", [*PREFILL_CONFIGS, *DECODE_CONFIGS, "batch_invariant"])
@pytest.mark.parametrize("softcap", [2.0 ** 126, 2.0 ** -126])
def test_softcap_at_its_bounds(target, path, softcap):
    # 2^126: no cap (scores / softcap ~ 0); 2^-126: every score capped to ~0 (uniform weights).
    case = make_case([40, 9], [6, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, seed=10)
    if path in PREFILL_CONFIGS or path == "batch_invariant":
        out, lse = prefill(target, case, PREFILL_CONFIGS.get(path, []), batch_invariant=path == "batch_invariant",
                           softcap=softcap)
        ref, ref_lse = case.reference_prefill_lse(softcap=softcap)
    else:
        case = make_case([40, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16, seed=10)
        out, lse = decode(target, case, DECODE_CONFIGS[path], softcap=softcap)
        ref, ref_lse = case.reference_decode_lse(softcap=softcap)
    assert_close(out, ref, F16)
    assert_lse_close(lse, ref_lse, F16)


# ---- D: window_right --------------------------------------------------------------------------------
WINDOWS = [(-1, 0), (0, 0), (4, 4), (30, 17), (2, 100), (-1, 3)]


@pytest.mark.parametrize("path", [*PREFILL_CONFIGS, "batch_invariant"])
@pytest.mark.parametrize("window_left,window_right", WINDOWS)
def test_window_right_non_causal(target, path, window_left, window_right):
    case = make_case([50, 7, 300], [50, 3, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                     dtype=F16, seed=window_right)
    case.poison_hidden(False, window_left, window_right)
    kw = dict(window_left=window_left, window_right=window_right)
    out, lse = prefill(target, case, PREFILL_CONFIGS.get(path, []), False, batch_invariant=path == "batch_invariant",
                       **kw)
    ref, ref_lse = case.reference_prefill_lse(False, **kw)
    assert_close(out, ref, F16)
    assert_lse_close(lse, ref_lse, F16)


@pytest.mark.skipif("emu" not in TARGETS, reason="the emulator's KV byte counter: cuda_emu is not built")
@pytest.mark.parametrize("path", [*PREFILL_CONFIGS, "batch_invariant"])
@pytest.mark.parametrize("causal,window_left,window_right", [(False, 20, 11), (False, 0, 30), (True, 25, -1)])
def test_a_window_costs_o_window(path, causal, window_left, window_right):
    # 1200 cached keys, 400 queries at the end: each row tile (or batch-invariant row) may read
    # only the keys its rows' windows cover, plus at most one tile of slack.
    seq_len, q_len, group, D = 1200, 400, 2, 64
    case = make_case([seq_len], [q_len], num_heads=2 * group, num_kv_heads=2, head_size=D, block_size=16, dtype=F16,
                     seed=11)
    out = nan_like(case.query)
    bi = path == "batch_invariant"
    read = torch.ops.paged_cuda_emu_test.prefill_kv_bytes_read(
        *case.prefill_args(out, causal), PREFILL_CONFIGS.get(path, []), window_left=window_left,
        window_right=window_right, batch_invariant=bi)
    ref = case.reference_prefill(causal, window_left=window_left, window_right=window_right)
    assert_close(out, ref, F16)
    visible = reference.visible_keys(q_len, seq_len, causal, window_left, window_right)
    token_bytes = 2 * 2 * D * 2  # K and V, 2 KV heads, fp16
    if bi:
        assert read == int(visible.sum()) * token_bytes, "each row reads exactly its own keys"
    else:
        config = PREFILL_CONFIGS[path]
        rows_per_tile = 64 if config[4] >= 0 else (config[0] or 128) // 8
        kv_tile = 32 if config[4] >= 0 else (config[2] or 32)
        positions = rows_per_tile // group
        bound = 0
        for t0 in range(0, q_len, positions):
            keys = visible[t0:t0 + positions].any(0).nonzero().flatten()
            bound += (int(keys[-1] - keys[0]) + 1 + kv_tile) * token_bytes
        assert 0 < read <= bound, f"read {read} bytes, the windows need at most {bound}"
        assert read * 10 < seq_len * token_bytes * (q_len // positions), "O(window), not O(seq_len)"


# ---- E: scales per tensor, per KV head, per sequence, K and V apart ----------------------------------
@pytest.mark.parametrize("path", [*PREFILL_CONFIGS, *DECODE_CONFIGS, "batch_invariant", "shared_kv"])
@pytest.mark.parametrize("scale_kind", ["seq", "head/tensor", "tensor/seq", "head"])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_scales_by_sequence_and_head(target, path, scale_kind, cache_dtype):
    num_heads = 24 if path == "shared_kv" else 8
    if path in PREFILL_CONFIGS or path == "batch_invariant":
        case = make_case([33, 5, 70], [4, 5, 20], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=BF16, cache_dtype=cache_dtype, scale_kind=scale_kind, seed=12)
        out, lse = prefill(target, case, PREFILL_CONFIGS.get(path, []), batch_invariant=path == "batch_invariant")
        ref, ref_lse = case.reference_prefill_lse()
    else:
        case = make_case([33, 5, 70], num_heads=num_heads, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=BF16, cache_dtype=cache_dtype, scale_kind=scale_kind, seed=12)
        out, lse = decode(target, case, DECODE_CONFIGS.get(path, SPLIT))
        ref, ref_lse = case.reference_decode_lse()
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, BF16)


# ---- F: merge_states ---------------------------------------------------------------------------------
def run_merge_states(target, out, out_lse, states, lse):
    dev = device_of(target)
    op = torch.ops.paged_cuda_emu if target == "emu" else torch.ops.paged_cuda
    o = out.to(dev)
    ol = None if out_lse is None else out_lse.to(dev)
    op.merge_states(o, ol, states.to(dev), lse.to(dev))
    return o.cpu(), None if ol is None else ol.cpu()


def check_merge_states(target, states, lse, head_size, dtype, with_lse=True):
    T, N, H = lse.shape
    ref = torch.zeros(T, H, head_size, dtype=torch.float64)
    ref_lse = torch.full((T, H), -INF, dtype=torch.float64)
    if N:  # no state: every row 0 / -inf (the contract; the reference's max over 0 states fails)
        reference.merge_states(ref, ref_lse, states, lse)
    out, out_lse = run_merge_states(target, nan_like(torch.empty(T, H, head_size, dtype=dtype)),
                                    poison(torch.empty(T, H)) if with_lse else None, states, lse)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    if N == 0:
        assert (out == 0).all() and (out_lse is None or (out_lse == -INF).all())
    elif (~nan).any():
        assert_close(out[~nan], ref[~nan], dtype)
    if with_lse and N:
        assert torch.equal(out_lse.isnan(), ref_lse.isnan())
        ok = ~ref_lse.isnan()
        assert_lse_close(out_lse[ok], ref_lse[ok], dtype)


def special_lses(lse):
    lse[0, 0] = -INF
    lse[1] = -INF
    lse[2, -1, 0] = INF
    lse[3, 0, 1] = NAN
    return lse


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("num_states", [0, 1, 3, 9])
@pytest.mark.parametrize("head_size", [0, 8, 13, 64])
def test_merge_states(target, dtype, num_states, head_size):
    g = torch.Generator().manual_seed(num_states * 100 + head_size)
    states = torch.randn(6, num_states, 3, head_size, generator=g).to(dtype)
    lse = torch.randn(6, num_states, 3, generator=g) * 5
    if num_states:
        special_lses(lse)
        states[0, 0] = NAN  # lse -inf: never read
        states[1] = NAN
    check_merge_states(target, states, lse, head_size, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_merge_states_strided_and_unaligned(target, dtype):
    # Token/state/head strides of any size: states stacked state-major ([N, T, H, D] transposed), an
    # odd element offset (element loads), a broadcast state (stride 0), and lses by any strides.
    g = torch.Generator().manual_seed(3)
    T, N, H, D = 5, 4, 3, 24
    stacked = torch.randn(N, T, H, D + 3, generator=g).to(dtype)[..., 1:D + 1]  # rows start at odd elements
    states = stacked.transpose(0, 1)
    lse = special_lses((torch.randn(N, H, T, generator=g) * 3).permute(2, 0, 1))
    states[0, 0] = NAN
    check_merge_states(target, states, lse, D, dtype, with_lse=False)
    check_merge_states(target, states, lse, D, dtype)
    one = torch.randn(T, 1, H, 16, generator=g).to(dtype)
    check_merge_states(target, one.expand(T, 6, H, 16), torch.randn(T, 6, H, generator=g), 16, dtype)


def test_merge_attention_states_of_two_empty_sides(target):
    nan = torch.full((3, 2, 16), NAN)
    minus = torch.full((3, 2), -INF)
    dev = device_of(target)
    op = torch.ops.paged_cuda_emu if target == "emu" else torch.ops.paged_cuda
    out, out_lse = nan_like(nan).to(dev), torch.empty(3, 2, device=dev)
    op.merge_attention_states(out, out_lse, nan.to(dev), minus.to(dev), nan.to(dev), minus.to(dev))
    assert (out.cpu() == 0).all() and (out_lse.cpu() == -INF).all()

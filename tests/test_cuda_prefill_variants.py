"""The attention variants (softcap, window_left, sinks, alibi_slopes, lse; issue #13) in the CUDA
prefill kernels (csrc/kernels/prefill.cuh) with explicit launch configurations (the test namespaces'
prefill_attention_config): the tensor-core path (mma.sync, fp16/bf16 queries, fp8 caches) and the
CUDA-core path (any dtype; forced with tensor_cores=-1), several KV tiles and thread counts. Every case runs
on the CPU emulator (target "emu", under the strict emulator's defaults: random fiber order) and,
where the cuda backend and a GPU are present, on each GPU (targets "cuda:N"; without one they are
not collected, so nothing is reported as skipped).

Every case compares out and lse with paged_ops.reference in float64 on fresh random inputs, with
NaN-poisoned outputs and unused cache slots (paged_ops.testing). The public op over all backends
runs in tests/test_ops.py; the batch-invariant mode (prefill rows through the decode kernel) in
tests/test_cuda_emu.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from paged_ops import reference
from paged_ops.testing import assert_close, cuda_targets, make_case

TARGETS = cuda_targets()  # the target fixture's values (tests/conftest.py)
if not TARGETS:
    pytest.skip("neither the cuda_emu backend nor a GPU with the cuda backend", allow_module_level=True)

# kernels/plan.h: the tensor-core kernel's row tile at the fp16 head 64 of the tests below (the
# pipelined kernel's tc_pipelined_rows: 4 warps x 2 fragments of 16 rows); the CUDA-core kernel's is
# threads / 8.
TC_ROWS = 128
# LaunchConfig order: [threads, partition_size, kv_tile, force_split, tensor_cores].
TC = [0, 0, 0, 0, 1]
CUDA_CORES = [0, 0, 0, 0, -1]


def cuda_cores(threads=0, kv_tile=0) -> list[int]:
    return [threads, 0, kv_tile, 0, -1]


def variant_tensors(num_heads: int, sinks: bool, alibi: bool, seed: int) -> dict:
    """sinks / alibi_slopes as the contract takes them (float32 [num_heads]); sinks of both signs
    around typical row maxima, so the sink neither vanishes nor dominates."""
    g = torch.Generator().manual_seed(1000 + seed)
    kw = {}
    if sinks:
        kw["sinks"] = (torch.randn(num_heads, generator=g) * 2).float()
    if alibi:
        # BLOOM-style geometric slopes, shuffled so every head's own slope is used.
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
        kw["alibi_slopes"] = slopes[torch.randperm(num_heads, generator=g)].float()
    return kw


def run(case, config, causal=True, target="emu", with_lse=True, **variants):
    """(out, lse) of the kernels on `target` (the CPU case is moved to a GPU target), on the CPU;
    both start NaN, so a row or lse entry left unwritten fails. lse is None without with_lse."""
    op = torch.ops.paged_cuda_emu_test if target == "emu" else torch.ops.paged_cuda_test
    device = "cpu" if target == "emu" else target
    case = case.to(device)
    variants = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in variants.items()}
    out = case.new_out()  # NaN, [rows, heads, value head size]
    lse = torch.full(case.query.shape[:2], float("nan"), dtype=torch.float32, device=device) if with_lse else None
    op.prefill_attention_config(*case.prefill_args(out, causal), config, lse=lse, **variants)
    return out.cpu(), None if lse is None else lse.cpu()


def reference_of(case, causal=True, **variants):
    """(out, lse) by the float64 specification on the CPU."""
    out = torch.empty(case.out_shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in case.prefill_args(out, causal)]
    args[1] = args[1].double()
    reference.prefill_attention(*args, lse=lse, **variants)
    return out, lse


def assert_lse_close(lse, ref, msg=""):
    """Infinities exactly where the reference has them; finite entries within float32's budget
    (the kernels accumulate m and l in float32 whatever the query dtype)."""
    ref = ref.to(torch.float64)
    got = lse.to(torch.float64)
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got) & (got < 0), inf & (ref < 0)), f"-inf lse entries differ {msg}"
    assert not torch.isnan(got[~inf]).any(), f"lse holds NaN (unwritten?) {msg}"
    if (~inf).any():
        assert_close(got[~inf], ref[~inf], torch.float32, msg)


def check(case, config, causal=True, target="emu", **variants):
    out, lse = run(case, config, causal, target, **variants)
    ref_out, ref_lse = reference_of(case, causal, **variants)
    assert_close(out, ref_out, case.dtype, "out")
    assert_lse_close(lse, ref_lse, "lse")


# ---- each variant alone and all together, on both kernels -----------------------------------------
# (name, kwargs builder): each entry a function of (num_heads, seed) -> variant kwargs.
VARIANTS = {
    "plain": lambda h, s: {},
    "softcap": lambda h, s: {"softcap": 5.0},
    "softcap_tight": lambda h, s: {"softcap": 0.5},  # most scores saturate: tanh's tails matter
    "window0": lambda h, s: {"window_left": 0},  # each row sees only itself
    "window": lambda h, s: {"window_left": 11},
    "window_wide": lambda h, s: {"window_left": 10 ** 12},  # wider than any sequence: no window (int64)
    "sinks": lambda h, s: variant_tensors(h, True, False, s),
    "alibi": lambda h, s: variant_tensors(h, False, True, s),
    "all": lambda h, s: {"softcap": 8.0, "window_left": 6, **variant_tensors(h, True, True, s)},
}

# Chunked prefill: cached context before the new tokens, a decode row (q_len 1), a fresh prompt,
# a sequence with no new tokens, block boundaries; long enough for several KV tiles and row tiles.
SEQ_LENS = [1, 45, 70, 9, 6]
Q_LENS = [1, 33, 12, 9, 0]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["tc", "cuda_cores"])
@pytest.mark.parametrize("causal", [True, False])
def test_variant_fp16(target, variant, path, causal):
    seed = len(variant) * 7 + (path == "tc") + 2 * causal
    case = make_case(SEQ_LENS, q_lens=Q_LENS, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=seed)
    check(case, TC if path == "tc" else CUDA_CORES, causal, target, **VARIANTS[variant](8, seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_fp32(target, variant):
    # fp32 queries always take the CUDA-core kernel (plan_prefill), at fp32's 1e-5 budget.
    seed = len(variant) + 40
    case = make_case(SEQ_LENS, q_lens=Q_LENS, num_heads=6, num_kv_heads=3, head_size=80, block_size=5,
                     dtype=torch.float32, layout="HND", seed=seed)
    check(case, TC, True, target, **VARIANTS[variant](6, seed))


# Every existing axis with the variants: dtypes, fp8 caches (per tensor / per head scales), GQA
# groups (incl. 7, not a power of two), block sizes, head sizes (80: padded k-steps on tensor cores),
# HND caches, launch configurations of the CUDA-core kernel.
GRID = [
    # dtype, cache_dtype, group, block_size, head_size, layout, config
    (torch.bfloat16, None, 1, 16, 128, "NHD", TC),
    (torch.bfloat16, None, 7, 3, 96, "HND", TC),
    (torch.float16, torch.float8_e4m3fn, 4, 16, 64, "NHD", TC),
    (torch.bfloat16, torch.float8_e5m2, 2, 8, 80, "HND", TC),
    (torch.float16, None, 8, 1, 256, "NHD", TC),
    (torch.bfloat16, torch.float8_e4m3fn, 2, 16, 128, "HND", cuda_cores(threads=64, kv_tile=16)),
    (torch.float16, None, 7, 16, 96, "NHD", cuda_cores(threads=256, kv_tile=64)),
    (torch.float16, torch.float8_e5m2, 1, 3, 64, "NHD", cuda_cores(threads=128, kv_tile=7)),
    (torch.float32, torch.float8_e4m3fn, 4, 16, 64, "HND", cuda_cores(threads=96, kv_tile=5)),
]


@pytest.mark.parametrize("dtype,cache_dtype,group,block_size,head_size,layout,config", GRID)
@pytest.mark.parametrize("variant", ["softcap", "window", "sinks", "alibi", "all"])
def test_variants_with_every_axis(target, dtype, cache_dtype, group, block_size, head_size, layout, config, variant):
    seed = group * 31 + block_size + head_size + len(variant)
    num_heads = 2 * group
    case = make_case([1, 2 * block_size, 37, 20], q_lens=[1, block_size, 30, 20], num_heads=num_heads,
                     num_kv_heads=2, head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                     scale_kind=("tensor", "head")[group % 2], layout=layout, seed=seed)
    causal = seed % 3 != 0  # both, spread over the grid
    check(case, config, causal, target, **VARIANTS[variant](num_heads, seed))


@pytest.mark.parametrize("config", [TC, CUDA_CORES])
def test_lse_is_optional(target, config):
    # Without lse the kernels write out alone (same bits as with it: lse is a side output).
    case = make_case(SEQ_LENS, q_lens=Q_LENS, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, seed=5)
    kw = {"softcap": 3.0, "window_left": 9, **variant_tensors(4, True, True, 5)}
    out, _ = run(case, config, True, target, with_lse=False, **kw)
    out_with, _ = run(case, config, True, target, **kw)
    assert torch.equal(out.view(torch.int16), out_with.view(torch.int16))


# ---- scales of either sign, zero and NaN -----------------------------------------------------------
# The plain tensor-core kernel applies the scale c in the softmax's exponent (exp2(s c - m c) by one
# fma), which takes the max of the raw q . k: right for c > 0 only, so it moves any other c into Q
# (prefill.cuh q_mul / exp_mul). Rows late in a 200-token sequence give interior KV tiles (no mask) as
# well as edge ones; one query element is infinite, so its (row, head) is NaN in the reference (an
# infinite q . k times the scale, or times 0) and must be NaN here, every other row finite.
@pytest.mark.parametrize("scale", [-0.3, 0.0, -0.0, math.nan])
@pytest.mark.parametrize("config", [TC, CUDA_CORES])
@pytest.mark.parametrize("variant", ["plain", "window", "alibi"])
def test_scale_of_any_sign(target, scale, config, variant):
    seed = 60 + len(variant) + (config == TC)
    case = make_case(SEQ_LENS + [200], q_lens=Q_LENS + [10], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=16, dtype=torch.bfloat16, seed=seed)
    case.scale = scale
    case.query[40, 1, 5] = math.inf  # sequence 2's row 6, head 1
    kw = VARIANTS[variant](4, seed)
    out, lse = run(case, config, True, target, **kw)
    ref_out, ref_lse = reference_of(case, **kw)
    nan_rows = ref_out.isnan().any(-1)
    assert nan_rows[40, 1] and (nan_rows.all() if math.isnan(scale) else nan_rows.sum() == 1)
    assert torch.equal(out.isnan().any(-1), nan_rows), "NaN rows differ from the reference's"
    if not math.isnan(scale):  # (the NaN row's lse: NaN here, the reference's logsumexp may give +inf)
        assert_close(out[~nan_rows], ref_out[~nan_rows], case.dtype)
        assert_lse_close(lse[~nan_rows], ref_lse[~nan_rows])


# ---- rows with no finite score: 0 / -inf, or the sink's 0 / sinks[h] ------------------------------
@pytest.mark.parametrize("config", [TC, CUDA_CORES])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_row_without_finite_score(target, config, with_sinks):
    # A row whose every visible score is -inf: query dim 0 = -inf against keys whose dim 0 is > 0.
    # Reference (#27): nothing to weigh, so out 0 and lse -inf, as a row with no key; with a sink,
    # out 0 and lse = sinks[h] (the sink is the whole denominator and has no value).
    case = make_case([20, 7], q_lens=[5, 7], num_heads=4, num_kv_heads=2, head_size=64, block_size=4,
                     dtype=torch.float16, seed=11)
    case.key_cache[..., 0] = case.key_cache[..., 0].abs() + 0.5  # NaN slots stay NaN; they are never read
    case.query[2, 1, 0] = -math.inf  # sequence 0, row 2, head 1
    case.query[6, 3, 0] = -math.inf  # sequence 1, row 1, head 3
    kw = variant_tensors(4, True, False, 11) if with_sinks else {}
    out, lse = run(case, config, True, target, **kw)
    ref_out, ref_lse = reference_of(case, **kw)
    for t, h in ((2, 1), (6, 3)):
        assert torch.equal(out[t, h].float(), torch.zeros(64)), "a row with nothing to weigh is 0"
        assert torch.equal(ref_out[t, h], torch.zeros(64, dtype=torch.float64))
        if with_sinks:
            assert lse[t, h].item() == kw["sinks"][h].item() == ref_lse[t, h].item()
        else:
            assert lse[t, h].item() == -math.inf == ref_lse[t, h].item()
    keep = torch.ones(case.query.shape[:2], dtype=torch.bool)
    keep[2, 1] = keep[6, 3] = False
    assert_close(out[keep], ref_out[keep], case.dtype)
    assert_lse_close(lse[keep], ref_lse[keep])


def test_nan_sink_poisons_the_row(target):
    case = make_case([12], q_lens=[4], num_heads=2, num_kv_heads=1, head_size=64, dtype=torch.float16, seed=2)
    sinks = torch.tensor([float("nan"), 0.5])
    for config in (TC, CUDA_CORES):
        out, lse = run(case, config, True, target, sinks=sinks)
        assert out[:, 0].isnan().all() and lse[:, 0].isnan().all()
        assert not out[:, 1].isnan().any()


# ---- a sliding window skips the KV tiles before it ------------------------------------------------
def poison_tokens(cache, block_table, tokens, value):
    """Set every listed token's K or V (all KV heads) of one sequence to `value`."""
    bs = cache.shape[1]
    for j in tokens:
        cache[int(block_table[j // bs]), j % bs] = value


@pytest.mark.parametrize("config", [TC, CUDA_CORES, cuda_cores(threads=64, kv_tile=8)])
@pytest.mark.parametrize("causal", [True, False])
def test_window_never_reads_keys_before_every_window(target, config, causal):
    # Tokens before the earliest row's window hold NaN in K and V. Staged, V's NaN times the masked
    # probability 0 is NaN, so a kernel that started the KV loop at 0 (masking the tokens) fails.
    window, seq_lens, q_lens = 13, [200, 90], [24, 1]
    case = make_case(seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                     dtype=torch.float16, seed=3)
    ref_out, ref_lse = reference_of(case, causal, window_left=window)
    for s, (n, q) in enumerate(zip(seq_lens, q_lens)):
        first = n - q - window  # the earliest row's window start
        for cache in (case.key_cache, case.value_cache):
            poison_tokens(cache, case.block_tables[s], range(first), float("nan"))
    out, lse = run(case, config, causal, target, window_left=window)
    assert_close(out, ref_out, case.dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("config,rows_per_tile", [(TC, TC_ROWS), (CUDA_CORES, 16), (cuda_cores(threads=64), 8)])
def test_window_skips_per_row_tile(target, config, rows_per_tile):
    # Per row tile, not per sequence: token j0 is seen by rows of the first row tile but lies before
    # the window of every row of the later tiles. Its V is +inf: the rows that see it are inf/NaN
    # (unchecked), and a later tile that staged it anyway would turn 0 * inf into NaN.
    group, window = 2, 5
    q_len = 3 * rows_per_tile // group  # three row tiles
    seq_len = q_len + 4
    case = make_case([seq_len], q_lens=[q_len], num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=4,
                     dtype=torch.float16, seed=rows_per_tile)
    ref_out, ref_lse = reference_of(case, window_left=window)
    first_of_tile2 = seq_len - q_len + rows_per_tile // group  # position of tile 2's first query
    j0 = first_of_tile2 - window - 1  # just before that row's window; in tile 1's last row's window
    poison_tokens(case.value_cache, case.block_tables[0], [j0], float("inf"))
    out, lse = run(case, config, True, target, window_left=window)
    later = slice(rows_per_tile // group, q_len)  # rows of tiles 2 and 3
    assert_close(out[later], ref_out[later], case.dtype)
    assert_lse_close(lse[later], ref_lse[later])
    last_of_tile1 = rows_per_tile // group - 1
    assert not torch.isfinite(out[last_of_tile1].float()).all(), "the test's premise: tile 1 sees the inf value"


# ---- the strict emulator's schedules ------------------------------------------------------------
@pytest.mark.skipif("emu" not in TARGETS, reason="the emulator's schedules: cuda_emu is not built")
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:7"])
@pytest.mark.parametrize("config", [TC, cuda_cores(kv_tile=16)])
def test_fiber_orders(schedule, config):
    # A missing barrier around the new shared state (lse from the row's bookkeeping) would show as
    # a schedule-dependent result; every order must give the reference.
    case = make_case([33, 50], q_lens=[33, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.bfloat16, seed=9)
    kw = {"softcap": 4.0, "window_left": 20, **variant_tensors(4, True, True, 9)}
    torch.ops.paged_cuda_emu_test.set_schedule(schedule)
    try:
        check(case, config, **kw)
    finally:
        torch.ops.paged_cuda_emu_test.set_schedule("")

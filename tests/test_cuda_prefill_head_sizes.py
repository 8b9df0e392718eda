"""Keys and values of different head sizes, and heads up to 576 (#24 item 1, MLA), in the CUDA
prefill kernels (csrc/kernels/prefill.cuh) with each kernel forced through the test namespace's
prefill_attention_config (tests/test_attention_head_sizes.py runs the public op):

- the pipelined tensor-core kernel (a 16-bit cache of the query's dtype, or fp8 heads of multiples
  of 16, 16-byte aligned rows): its (192, 128) instance (DeepSeek's non-absorbed prefill, and any
  128 < Dk <= 192 with Dv <= 128: Dk 136 pads a k-step, Dv 72 an n-tile pair), the square instances
  at Dv < Dk (Dv runtime), and fp8 caches through its staging tiles (k_scale for K, v_scale for V);
- the general tensor-core kernel: fp8 caches of other heads or rows, a value view whose rows are not
  16-byte aligned;
- the CUDA-core kernel: forced, fp32 queries, and every head above 256 (576 / 512: plan.h
  kTcMaxHeadSize; a tensor-core config falls back to it there), its wide instance (72 chunks);
- value_cache a view into key_cache's storage (absorbed MLA), never written;
- each variant (softcap, windows, sinks, ALiBi, lse), block sizes 1 to 64, HND caches, several KV
  and row tiles, non-finite values of hidden keys (the edge tiles' add-back).

Every case compares out and lse with the float64 reference (NaN-poisoned outputs and unused slots),
on the emulator and, where present, on each GPU.
"""
from __future__ import annotations

import pytest
import torch

from paged_ops.testing import assert_close, bits, make_case, make_variants
from tests.test_cuda_prefill_variants import (CUDA_CORES, TARGETS, TC, VARIANTS, assert_lse_close, check,
                                              cuda_cores, reference_of, run)

if not TARGETS:
    pytest.skip("neither the cuda_emu backend nor a GPU with the cuda backend", allow_module_level=True)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Chunked prefill over several 32- and 64-key tiles and row tiles: cached context, a decode row, a
# fresh prompt, a sequence without new tokens.
SEQ_LENS = [70, 1, 37, 6]
Q_LENS = [40, 1, 37, 0]


def case_of(dk, dv, dtype=BF16, cache_dtype=None, group=2, block_size=16, layout="NHD", value_in_key=False,
            seq_lens=SEQ_LENS, q_lens=Q_LENS, seed=0, scale_kind="tensor", num_kv_heads=2):
    return make_case(seq_lens, q_lens=q_lens, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_size=dk, value_head_size=dv, value_in_key=value_in_key, block_size=block_size, dtype=dtype,
                     cache_dtype=cache_dtype, layout=layout, scale_kind=scale_kind, seed=seed)


def check_unwritten(case, config, causal=True, target="emu", **variants):
    """check(), and neither cache's storage written (a value view of key_cache shares it)."""
    before = [bits(case.key_cache).clone(), bits(case.value_cache).clone()]
    check(case, config, causal, target, **variants)
    assert torch.equal(bits(case.key_cache), before[0]) and torch.equal(bits(case.value_cache), before[1])


# (dk, dv): DeepSeek's 192 / 128 and the other instances' shapes at Dv < Dk.
PIPELINED_SHAPES = [(192, 128), (136, 72), (160, 8), (128, 64), (256, 128), (64, 8)]


@pytest.mark.parametrize("dk,dv", PIPELINED_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_pipelined_tensor_cores(target, dk, dv, causal):
    seed = dk + dv + causal
    case = case_of(dk, dv, dtype=(BF16, F16)[seed % 2], group=1 + seed % 3, block_size=(16, 8, 32)[seed % 3],
                   layout=("NHD", "HND")[dk % 3 == 0], seed=seed)
    check_unwritten(case, TC, causal, target)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["tc", "cuda_cores"])
def test_deepseek_prefill_variants(target, variant, path):
    """DeepSeek's non-absorbed prefill (Dk 192, Dv 128, num_kv_heads == num_heads) with each variant."""
    seed = 3 * len(variant) + (path == "tc")
    case = case_of(192, 128, dtype=BF16, group=1, num_kv_heads=3, block_size=16, seed=seed)
    kw = VARIANTS[variant](3, seed)
    case.poison_hidden(True, **kw)  # keys no row sees hold inf: never read
    check(case, TC if path == "tc" else CUDA_CORES, True, target, **kw)


def test_window_right_non_causal(target):
    case = case_of(192, 128, dtype=F16, group=2, block_size=5, seed=4)
    kw = dict(window_left=9, window_right=3)
    case.poison_hidden(False, **kw)
    for config in (TC, CUDA_CORES):
        check(case, config, False, target, **kw)


@pytest.mark.parametrize("dk,dv", [(192, 128), (256, 64)])
@pytest.mark.parametrize("config", [TC, CUDA_CORES])
def test_infinite_value_of_a_partly_hidden_key(target, dk, dv, config):
    """A V of +inf at the causal diagonal: only the rows that see its key are inf / NaN; the edge tile
    holds it back from the others (the tensor-core kernels' add-back: p * v for exactly those rows)."""
    case = case_of(dk, dv, dtype=BF16, group=2, block_size=16, seq_lens=[50], q_lens=[30], seed=dk)
    hidden = 50 - 30 + 10  # row 10's own key: rows 0-9 do not see it
    case.value_cache[int(case.block_tables[0, hidden // 16]), hidden % 16, :, dv // 2] = float("inf")
    ref_out, ref_lse = reference_of(case)
    out, lse = run(case, config, True, target)
    assert_close(out[:10], ref_out[:10], case.dtype)
    assert_lse_close(lse, ref_lse)
    assert not torch.isfinite(out[10:].float()).all(), "the test's premise: later rows see the inf value"


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dk,dv,config", [(192, 128, TC), (136, 72, TC), (192, 128, CUDA_CORES),
                                          (576, 512, TC)])
def test_fp8_caches(target, cache_dtype, dk, dv, config):
    """fp8 caches (the tensor-core kernels up to 256: 192 / 128 the pipelined one, 136 / 72 the general
    one; the CUDA-core kernel above) with their own K and V scales of different forms (per KV head /
    per tensor, per tensor / per sequence)."""
    seed = dk + (cache_dtype == E5M2)
    kind = ("head/tensor", "tensor/seq")[seed % 2]  # K and V scaled apart
    case = case_of(dk, dv, dtype=(F16, BF16)[seed % 2], cache_dtype=cache_dtype, group=2, block_size=(16, 3)[seed % 2],
                   scale_kind=kind, seed=seed, value_in_key=dk == 576,
                   num_kv_heads=1 if dk == 576 else 2, seq_lens=[40, 9] if dk == 576 else SEQ_LENS,
                   q_lens=[20, 9] if dk == 576 else Q_LENS)
    check_unwritten(case, config, True, target, softcap=6.0)


FP8_PIPELINED = [(128, 128, "plain"), (64, 64, "window"), (256, 256, "sinks"), (192, 128, "alibi"),
                 (128, 64, "all"), (160, 32, "softcap")]


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dk,dv,variant", FP8_PIPELINED)
def test_fp8_caches_in_the_pipelined_kernel(target, cache_dtype, dk, dv, variant):
    """fp8 caches whose heads are multiples of 16 and rows 16-byte aligned take the pipelined
    kernel (plan.h): each thread copies K / V tiles into fp8 staging tiles by cp.async and widens
    its own chunks into the 16-bit tiles (prefill.cuh widen_fp8x16), K and V scaled apart; every
    instance (64, 128, 256, DeepSeek's 192 / 128; Dv < Dk), both query dtypes, odd block sizes (the
    page by FastDivmod), each variant (soft-cap / ALiBi: the score-mods instance)."""
    seed = dk + dv + (cache_dtype == E5M2) + len(variant)
    kind = ("head/tensor", "tensor/seq")[seed % 2]
    case = case_of(dk, dv, dtype=(F16, BF16)[seed % 2], cache_dtype=cache_dtype, group=1 + seed % 3,
                   block_size=(16, 3, 8)[seed % 3], scale_kind=kind, seed=seed)
    kw = VARIANTS[variant](case.query.shape[1], seed)
    case.poison_hidden(True, **kw)  # keys no row sees hold NaN: never read, or held back
    check_unwritten(case, TC, True, target, **kw)
    if target == "emu":
        assert _ldmatrix_count(case, case.new_out()) > 0, "the pipelined kernel (ldmatrix) ran"


@pytest.mark.skipif("emu" not in TARGETS, reason="the emulator's ldmatrix count: cuda_emu is not built")
@pytest.mark.parametrize("dk,dv,offset,pipelined", [(128, 128, 0, True), (136, 72, 0, False), (128, 128, 8, False)])
def test_fp8_caches_take_the_pipelined_kernel_where_their_rows_allow(dk, dv, offset, pipelined):
    """plan.h: an fp8 row goes by 16-byte chunks of 16 elements, so heads of whole chunks and 16-byte
    aligned rows take the pipelined kernel; 136 / 72 (8-element tails) and rows 8 bytes off a 16-byte
    boundary take the general one. Both right against the reference."""
    case = case_of(dk, dv, dtype=BF16, cache_dtype=E4M3, group=2, block_size=16, seed=dk + offset)
    if offset:
        for name in ("key_cache", "value_cache"):
            c = getattr(case, name)
            wide = torch.zeros((*c.shape[:3], c.shape[3] + offset), dtype=torch.uint8).view(E4M3)
            wide[..., offset:] = c
            setattr(case, name, wide[..., offset:])
        assert case.key_cache.data_ptr() % 16 == offset
    out = case.new_out()
    assert (_ldmatrix_count(case, out) > 0) == pipelined
    assert_close(out, case.reference_prefill(), case.dtype)


@pytest.mark.parametrize("cache_dtype,bad", [(E5M2, float("inf")), (E4M3, float("nan"))])
def test_nonfinite_fp8_value_of_a_partly_hidden_key(target, cache_dtype, bad):
    """The pipelined kernel's hold-back and add-back over an fp8 cache: a non-finite V (e5m2 inf,
    e4m3 NaN: it has no inf) at the causal diagonal reaches only the rows that see its key."""
    case = case_of(128, 128, dtype=F16, cache_dtype=cache_dtype, group=2, block_size=16, seq_lens=[50], q_lens=[30],
                   seed=7)
    hidden = 50 - 30 + 10  # row 10's own key: rows 0-9 do not see it
    case.value_cache[int(case.block_tables[0, hidden // 16]), hidden % 16, :, 64] = bad
    ref_out, ref_lse = reference_of(case)
    out, lse = run(case, TC, True, target)
    assert_close(out[:10], ref_out[:10], case.dtype)
    assert_lse_close(lse, ref_lse)
    assert not torch.isfinite(out[10:].float()).all(), "the test's premise: later rows see the value"


# Partly hidden keys (seq_len 50, q_len 30: row i sees keys <= 20 + i) at every k-step of a 64-key tile
# (16 keys each) and in both 8-key halves of one (the A fragment's registers 0 / 1 and 2 / 3), and in
# both 32-key tiles at value tile 256: a non-finite V of each, in a column of its own.
HIDDEN_KEYS = [21, 26, 33, 41, 46, 49]


@pytest.mark.parametrize("dk,dv,dtype,cache_dtype", [(128, 128, F16, None), (64, 64, BF16, None),
                                                     (256, 256, F16, None), (192, 128, BF16, None),
                                                     (128, 128, BF16, E5M2)])
def test_nonfinite_values_of_hidden_keys_across_a_tile(target, dk, dv, dtype, cache_dtype):
    """The pipelined kernel's add-back finds each held-back key's probability in P's fragments (the
    k-step and register its column lands in): every row that sees a key gets its inf, no other row
    does, and the finite outputs match the reference."""
    case = case_of(dk, dv, dtype=dtype, cache_dtype=cache_dtype, group=2, block_size=16, seq_lens=[50],
                   q_lens=[30], seed=dk + dv)
    for n, key in enumerate(HIDDEN_KEYS):
        case.value_cache[int(case.block_tables[0, key // 16]), key % 16, :, 4 * n + 1] = float("inf")
    ref_out, ref_lse = reference_of(case)
    out, lse = run(case, TC, True, target)
    if target == "emu":
        assert _ldmatrix_count(case, case.new_out()) > 0, "the pipelined kernel ran"
    finite = torch.isfinite(ref_out)
    assert (~finite).any(dim=(1, 2))[:20].sum() == 20 - 1, "the test's premise: rows 1-19 see some key"
    assert torch.equal(torch.isfinite(out.double()), finite), "inf exactly in the rows that see each key"
    assert torch.equal(out.double()[~finite], ref_out[~finite]), "+inf, never NaN"
    assert_close(torch.where(finite, out.double(), 0.0).to(case.dtype), torch.where(finite, ref_out, 0.0), case.dtype)
    assert_lse_close(lse, ref_lse)


def test_unaligned_value_view_takes_the_general_kernel(target):
    """A value_cache whose rows start 8 bytes off a 16-byte boundary: no cp.async, element loads."""
    case = case_of(192, 128, dtype=BF16, group=2, block_size=16, seed=12)
    v = case.value_cache
    wide = torch.full((*v.shape[:3], v.shape[3] + 4), float("nan"), dtype=v.dtype)
    wide[..., 4:] = v
    case.value_cache = wide[..., 4:]
    assert case.value_cache.data_ptr() % 16 == 8
    check_unwritten(case, TC, True, target, window_left=17)


def _ldmatrix_count(case, out, **variants) -> int:
    """The emulator's ldmatrix instructions in one forced tensor-core prefill: > 0 only for the
    pipelined kernel (the general one builds its fragments by 32-bit loads)."""
    selftest = torch.ops.paged_cuda_emu_test
    selftest.ldmatrix_stats(True)
    selftest.prefill_attention_config(*case.prefill_args(out), TC, **variants)
    return selftest.ldmatrix_stats(True)[0]


@pytest.mark.skipif("emu" not in TARGETS, reason="which kernel ran: the emulator's ldmatrix count")
@pytest.mark.parametrize("softcap,pipelined", [(0.5, True), (50.0, True), (64.0, True), (64.5, False), (1000.0, False),
                                               (2.0 ** 126, False)])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_soft_caps_up_to_the_pipelined_kernels_bound(softcap, pipelined, dtype):
    """plan.h kMaxSoftcapByExp: the pipelined kernel's soft-cap (common.cuh SoftCapByExp) errs by a few
    ulp of the cap, absolutely, so it takes caps up to 64 and the general tensor-core kernel (tanhf) the
    larger ones: at 2^126 the exponential form would round every score to 0. Scores spread over the
    cap's range where it is a model's (queries scaled: the tails and the middle of tanh), with ALiBi,
    against the float64 reference at the dtype's tolerance."""
    case = case_of(128, 128, dtype=dtype, group=4, seed=int(softcap) % 97 + (dtype == BF16))
    if softcap <= 1000:
        case.query.mul_(max(1.0, softcap / 2))
    variants = make_variants(8, softcap=softcap, alibi=True)
    out = case.new_out()
    assert (_ldmatrix_count(case, out, **variants) > 0) == pipelined
    assert_close(out, case.reference_prefill(**variants), dtype, f"softcap {softcap}")


@pytest.mark.skipif("emu" not in TARGETS, reason="which kernel ran: the emulator's ldmatrix count")
@pytest.mark.parametrize("view", ["aligned", "query_rows_off_16_bytes", "out_rows_off_4_bytes"])
def test_pipelined_kernel_takes_aligned_query_and_out_views_only(view):
    """plan.h: the pipelined kernel copies Q rows by 16-byte cp.async and writes out by element
    pairs; a query view whose rows start 8 bytes off 16, or an out view whose rows start 2 bytes off
    4, takes the general tensor-core kernel instead, and both are right."""
    case = case_of(128, 128, dtype=F16, group=4, seed=31)
    if view == "query_rows_off_16_bytes":
        q = case.query
        wide = torch.full((*q.shape[:2], q.shape[2] + 4), float("nan"), dtype=q.dtype)
        wide[..., 4:] = q
        case.query = wide[..., 4:]
        assert case.query.data_ptr() % 16 == 8
    out = case.new_out()
    if view == "out_rows_off_4_bytes":
        wide = torch.full((*out.shape[:2], out.shape[2] + 1), float("nan"), dtype=out.dtype)
        out = wide[..., 1:]
        assert out.data_ptr() % 4 == 2
    instructions = _ldmatrix_count(case, out)
    assert_close(out, case.reference_prefill(), case.dtype)
    assert (instructions > 0) == (view == "aligned"), f"{view}: {instructions} ldmatrix instructions"


@pytest.mark.parametrize("dk,dv", [(192, 128), (256, 8), (576, 512)])
def test_value_view_of_the_key_cache(target, dk, dv):
    """Absorbed MLA's layout at each kernel: value_cache = key_cache[..., :dv], one KV head."""
    case = case_of(dk, dv, dtype=BF16, group=8, num_kv_heads=1, block_size=16, value_in_key=True,
                   seq_lens=[33, 12], q_lens=[17, 12], seed=dk)
    assert case.value_cache.data_ptr() == case.key_cache.data_ptr()
    for config in (TC, CUDA_CORES):
        check_unwritten(case, config, True, target)


# ---- heads above 256: the CUDA-core kernel's wide instance ------------------------------------
@pytest.mark.parametrize("dtype,dk,dv,config,block_size,layout,causal", [
    (BF16, 576, 512, TC, 16, "NHD", True),  # a tensor-core config: heads above 256 take CUDA cores
    (F16, 576, 576, CUDA_CORES, 1, "HND", True),
    (F32, 576, 512, CUDA_CORES, 7, "NHD", True),
    (F32, 264, 264, CUDA_CORES, 64, "NHD", True),  # just past the narrow kernel
    (BF16, 320, 8, cuda_cores(threads=256, kv_tile=64), 3, "HND", False),
    # 225 KB of shared memory at 256 threads and 64 keys: plan.h halves the tile to fit kPrefillMaxSmem
    # (99 KB; the default 32-key tile at 576 is halved too)
    (BF16, 576, 64, cuda_cores(threads=256, kv_tile=64), 16, "NHD", True),
    (F16, 512, 256, cuda_cores(threads=64, kv_tile=5), 16, "NHD", True),
])
def test_wide_heads(target, dtype, dk, dv, config, block_size, layout, causal):
    case = case_of(dk, dv, dtype=dtype, group=4, num_kv_heads=1, block_size=block_size, layout=layout,
                   seq_lens=[30, 1, 9], q_lens=[20, 1, 9], seed=dk + dv)
    check_unwritten(case, config, causal, target)


@pytest.mark.parametrize("variant", ["softcap", "window", "sinks", "alibi", "all"])
def test_absorbed_latent_variants(target, variant):
    """MLA's latent prefill (576 / 512, value a view of the key, 16 query heads) with each variant."""
    seed = len(variant) + 60
    case = case_of(576, 512, dtype=BF16, group=16, num_kv_heads=1, block_size=16, value_in_key=True,
                   seq_lens=[24, 5], q_lens=[10, 5], seed=seed)
    kw = VARIANTS[variant](16, seed)
    check(case, TC, True, target, **kw)


def test_fp32_queries_at_dk_ne_dv(target):
    case = case_of(192, 128, dtype=F32, group=3, block_size=5, layout="HND", seed=70)
    check(case, TC, True, target, softcap=5.0, window_left=11, **VARIANTS["sinks"](6, 70))


@pytest.mark.skipif("emu" not in TARGETS, reason="the emulator's bank-conflict count: cuda_emu is not built")
@pytest.mark.parametrize("dk,dv", [(192, 128), (136, 72)])
def test_tile_reads_are_conflict_free(dk, dv):
    """The (192, 128) instance's rows of 24 chunks (Q, K) and 16 (V): swizzled, every ldmatrix read
    of them conflict-free (the emulator counts the extra wavefronts per 8x8 matrix)."""
    selftest = torch.ops.paged_cuda_emu_test
    case = case_of(dk, dv, dtype=F16, group=2, seed=dk)
    out = case.new_out()
    selftest.ldmatrix_stats(True)
    selftest.prefill_attention_config(*case.prefill_args(out), TC)
    instructions, matrices, extra = selftest.ldmatrix_stats(True)
    assert_close(out, case.reference_prefill(), case.dtype)
    assert instructions > 0, "the pipelined kernel reads its tiles by ldmatrix"
    assert extra == 0, f"{extra} bank-conflict wavefronts over {matrices} matrices"

"""The cpu backend's AMX-BF16 tile kernels (csrc/cpu/amx_dot.h), run through the isa_amx_emulated
build: the same kernels on a scalar model of the tile instructions (csrc/cpu/amx_emulated.h),
written from Intel's SDM. This machine (and CI's) has no AMX: the isa_amx build is compiled, never
run here. What these tests prove is that the kernels' tile configurations, shapes, strides and
layouts are what the instructions define, and that their results (with the SDM's arithmetic) meet
the contract; not timing, not the OS's permission path, not hardware rounding corners.

  - attention through the tiles (bf16 caches, >= 16 rows per KV head: prefill tiles, decode of
    large GQA groups): head sizes 64..256 incl. 80 and 96 (a K step of 8 or 16 column pairs left
    over), 16-row blocks with tails (rows not a multiple of 16: the rest by vdpbf16ps), tiles
    shorter than 32 tokens, the variants with lse, NaN keys, fp8 caches under a bf16 query (widened
    to bf16 before the re-layout); each case also counts the TDPBF16PS
    the model ran, so a case that silently stopped using the tiles fails;
  - the model: TDPBF16PS's arithmetic against the SDM's pseudocode (exact sums, even/odd pair
    sums apart, bf16 denormals as zero, denormal results flushed), and every wrong use faulting;
  - other code using the tiles between two calls (a release, a foreign configuration): the next
    call reconfigures;
  - the dispatch: amx is built, and refused here with the reason.
"""
from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
import torch

import paged_ops  # noqa: F401  (loads torch.ops.paged_cpu)
from paged_ops.testing import assert_close, assert_lse_close, make_case, named_variants, nan_like, poison, rel_err

ops = torch.ops.paged_cpu
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif("amx_emulated" not in ops.supported_isas(),
                                reason="no AVX-512 BF16 here: the AMX model's build does not run")


def run(case, causal, kw, decode=False):
    """out, lse and the number of TDPBF16PS the call ran."""
    out, lse = nan_like(case.query), poison(torch.empty(case.query.shape[:2]))
    before = ops.amx_emulated_dot_count()
    if decode:
        ops.decode_attention(*case.decode_args(out), lse=lse, **kw)
    else:
        ops.prefill_attention(*case.prefill_args(out, causal), lse=lse, **kw)
    return out, lse, ops.amx_emulated_dot_count() - before


def ref_rows(case, causal, kw, decode=False):
    return case.reference_decode_lse(**kw) if decode else case.reference_prefill_lse(causal, **kw)


# --- attention on the tiles ----------------------------------------------------------------------

@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_head_sizes_and_tails(amx_isa, head_size, causal):
    # Sequences ending mid-tile (odd lengths), a chunk after cached tokens, a decode row; block 16.
    # Rows per KV head and task: MHA 64 and 13 (77 tokens in tiles of 64), group 3: 63 (3 blocks of
    # 16 + 15 by vdpbf16ps), group 4: 64 and 52 (3 + 4). head 80 / 96: 8 / 0 column pairs left after
    # the 16-pair steps (80 = 2 x 32 + 16), 72-style tails covered by 80's 8.
    for heads, kv_heads in ((4, 4), (6, 2), (8, 2)):
        case = make_case([77, 131, 33, 5], q_lens=[77, 50, 33, 1], num_heads=heads, num_kv_heads=kv_heads,
                         head_size=head_size, block_size=16, dtype=BF16, seed=head_size + heads)
        out, lse, dots = run(case, causal, {})
        ref, ref_lse = ref_rows(case, causal, {})
        what = f"{heads}/{kv_heads} heads, d{head_size}"
        assert dots > 0, f"{what}: no TDPBF16PS ran: the tile path was not taken"
        assert_close(out, ref, BF16, what)
        assert_lse_close(lse, ref_lse, torch.float32, what)


@pytest.mark.parametrize("head_size", [72, 120, 200])
def test_prefill_odd_head_sizes(amx_isa, head_size):
    # Column pairs left after the 16-pair steps: 72: 4, 120: 12, 200: 4 (100 pairs = 6 steps + 4).
    case = make_case([70, 40], q_lens=[70, 40], num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=BF16, seed=head_size)
    out, lse, dots = run(case, True, {})
    ref, ref_lse = ref_rows(case, True, {})
    assert dots > 0
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("name", ["plain", "softcap", "window", "sinks", "alibi", "all"])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_variants_with_lse(amx_isa, name, causal):
    case = make_case([150, 129], q_lens=[150, 64], num_heads=16, num_kv_heads=2, head_size=96, block_size=16,
                     dtype=BF16, seed=7)
    kw = named_variants(16, name)
    out, lse, dots = run(case, causal, kw)
    ref, ref_lse = ref_rows(case, causal, kw)
    assert dots > 0
    assert_close(out, ref, BF16)
    # QK's products are exact and summed in fp32 on the tiles too: lse keeps fp32's budget.
    assert_lse_close(lse, ref_lse, torch.float32)
    # The vdpbf16ps build computes the same case within the same budget: the paths agree to bf16.
    previous = ops.set_isa("avx512_bf16")
    try:
        out_avx, _, _ = run(case, causal, kw)
    finally:
        ops.set_isa(previous)
    assert rel_err(out, out_avx.double()) <= 1e-2


@pytest.mark.parametrize("heads,kv_heads", [(32, 2), (40, 2), (64, 1)])
def test_decode_of_large_groups(amx_isa, heads, kv_heads):
    # A decode task's rows are its GQA group: 16 (one block), 20 (one + 4 by vdpbf16ps), 64.
    case = make_case([1000, 37, 300], num_heads=heads, num_kv_heads=kv_heads, head_size=128, block_size=16,
                     dtype=BF16, seed=heads)
    kw = dict(softcap=5.0, window_left=500, sinks=torch.randn(heads))
    out, lse, dots = run(case, True, kw, decode=True)
    ref, ref_lse = ref_rows(case, True, kw, decode=True)
    assert dots > 0
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_fp8_caches_under_a_bf16_query(amx_isa, fp8, scale_kind):
    # fp8 K/V widened to bf16 before the re-layout (bf16_dot.h), then the same tiles.
    case = make_case([150, 70], q_lens=[150, 70], num_heads=16, num_kv_heads=2, head_size=80, block_size=16,
                     dtype=BF16, cache_dtype=fp8, scale_kind=scale_kind, seed=13)
    out, lse, dots = run(case, True, dict(softcap=4.0))
    ref, ref_lse = ref_rows(case, True, dict(softcap=4.0))
    assert dots > 0
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse, torch.float32)


def test_nan_key_reaches_exactly_the_rows_that_see_it(amx_isa):
    case = make_case([96, 96], q_lens=[96, 96], num_heads=16, num_kv_heads=1, head_size=80, block_size=16,
                     dtype=BF16, seed=11)
    block = int(case.block_tables[1, 40 // 16])
    case.key_cache[block, 40 % 16, 0, 3] = float("nan")
    out, _, dots = run(case, True, {})
    ref, _ = ref_rows(case, True, {})
    nan_rows = ref.isnan().any(-1)
    assert dots > 0 and nan_rows[96 + 40:].all() and not nan_rows[:96 + 40].any()
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert_close(out[~nan_rows].view(-1, 80), ref[~nan_rows].view(-1, 80), BF16)


def test_no_tiles_where_the_dot_path_is_off(amx_isa):
    # Batch-invariant mode keeps one code path for decode and prefill rows (no dot path, no tiles),
    # and then the AMX build computes exactly what avx512_bf16 does; so does a task of < 16 rows.
    case = make_case([200, 70], q_lens=[200, 70], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=BF16, seed=3)
    out, lse, dots = run(case, True, dict(batch_invariant=True))
    assert dots == 0
    previous = ops.set_isa("avx512_bf16")
    try:
        out_avx, lse_avx, _ = run(case, True, dict(batch_invariant=True))
    finally:
        ops.set_isa(previous)
    assert torch.equal(out, out_avx) and torch.equal(lse, lse_avx)
    small = make_case([300], num_heads=8, num_kv_heads=1, head_size=64, block_size=16, dtype=BF16, seed=4)
    _, _, dots = run(small, True, {}, decode=True)
    assert dots == 0


@pytest.mark.parametrize("how", ["release", "foreign"])
def test_other_code_on_the_tiles_between_calls(amx_isa, two_threads, how):
    # torch's own AMX kernels (oneDNN) may release the tiles or load their configuration on the same
    # threads between two of our calls: each call configures again.
    case = make_case([300, 250], q_lens=[300, 250], num_heads=8, num_kv_heads=2, head_size=80, block_size=16,
                     dtype=BF16, seed=9)
    ref, _ = ref_rows(case, True, {})
    for _ in range(2):
        out, _, dots = run(case, True, {})
        assert dots > 0
        assert_close(out, ref, BF16)
        ops.amx_emulated_disturb(how)


# --- the model itself ----------------------------------------------------------------------------

def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).view(torch.int16).to(torch.int32) & 0xFFFF


def pairs(x: torch.Tensor) -> torch.Tensor:
    """[rows][2k] bf16 values -> [rows][k] int32 words (element 2i in the low half, as in memory)."""
    b = bf16_bits(x)
    return (b[:, 0::2] | (b[:, 1::2] << 16)).to(torch.int32)


def from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def test_tdpbf16ps_exact_products_and_sums():
    # Small integers: every product and sum exact in fp32, so the result is exactly C + A @ B.
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((16, 16, 16), (16, 4, 16), (3, 5, 7)):
        a = torch.randint(-8, 9, (m, 2 * k), generator=g).float()
        b = torch.randint(-8, 9, (k, 2 * n), generator=g).float()
        c = torch.randint(-100, 101, (m, n), generator=g).float()
        got = ops.amx_emulated_tdpbf16ps(c, pairs(a), pairs(b))
        # B's row kk holds, for output column j, the pair (2j, 2j + 1) that meets A's pair kk.
        want = c.double() + a.double() @ b.double().view(k, n, 2).permute(0, 2, 1).reshape(2 * k, n)
        assert torch.equal(got.double(), want), (m, k, n)


def test_tdpbf16ps_sums_even_and_odd_elements_apart():
    # The SDM sums the even bf16 of every pair in one fp32 sum and the odd in another, then adds them:
    # even = 2^24 + 0, odd = 1 + 1, total 2^24 + 2. One sequential sum would lose both 1s (2^24 + 1
    # rounds to 2^24, ties to even).
    a = torch.tensor([[2.0 ** 24, 1.0, 0.0, 1.0]])
    b = torch.ones(2, 2)
    got = ops.amx_emulated_tdpbf16ps(torch.zeros(1, 1), pairs(a), pairs(b))
    assert got.item() == 2.0 ** 24 + 2


def test_tdpbf16ps_denormals_as_zero():
    tiny = from_bits(0x0001)  # the smallest bf16 denormal
    assert 0 < tiny < torch.finfo(torch.float32).tiny
    a = torch.tensor([[tiny, 1.0]])
    b = torch.tensor([[2.0 ** 100, 0.0]])
    # Read as it is, tiny * 2^100 would be ~2^-33; bf16 inputs are denormals-as-zero.
    assert ops.amx_emulated_tdpbf16ps(torch.zeros(1, 1), pairs(a), pairs(b)).item() == 0.0
    # A normal product whose result is fp32-denormal is flushed to zero (sign kept).
    a = torch.tensor([[-(2.0 ** -70), 0.0]])
    b = torch.tensor([[2.0 ** -70, 0.0]])
    assert ops.amx_emulated_tdpbf16ps(torch.zeros(1, 1), pairs(a), pairs(b)).item() == 0.0  # not -2^-140
    # NaN stays NaN.
    a = torch.tensor([[float("nan"), 1.0]])
    assert ops.amx_emulated_tdpbf16ps(torch.zeros(1, 1), pairs(a), pairs(torch.ones(1, 2))).isnan().all()


FAULTS = {
    "no_config": "no tile configuration loaded",
    "after_release": "no tile configuration loaded",
    "config_palette0": "palette 0",
    "config_palette2": "palette 2 is not supported",
    "config_start_row": "start_row 1",
    "config_reserved": "reserved byte 5",
    "config_rows17": "over palette 1's 16 rows x 64 bytes",
    "config_colsb68": "over palette 1's 16 rows x 64 bytes",
    "config_colsb6": "not a multiple of 4 bytes",
    "config_rows_without_colsb": "a tile has both or neither",
    "config_tile8": "palette 1 has 8 tiles",
    "load_unconfigured_tile": "TILELOADD: tmm6 is not configured",
    "store_unconfigured_tile": "TILESTORED: tmm7 is not configured",
    "tile_number_8": "tile 8 does not exist",
    "store_unwritten": "nothing wrote it since LDTILECFG",
    "dot_unwritten_c": "C tmm0 read, but nothing wrote it",
    "dot_rows": "A.rows != C.rows",
    "dot_k": "A.colsb / 4 != B.rows",
    "dot_n": "B.colsb != C.colsb",
    "dot_same_tile": "the three tiles must differ",
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_every_wrong_use_faults(case):
    fault = ops.amx_emulated_fault(case)
    assert fault.startswith("amx_emulated: ") and FAULTS[case] in fault, fault


def test_a_valid_sequence_does_not_fault():
    assert ops.amx_emulated_fault("valid") == ""


def test_tdpbf16ps_shape_mismatch_raises():
    with pytest.raises(RuntimeError, match=r"A.colsb / 4 != B.rows"):
        ops.amx_emulated_tdpbf16ps(torch.zeros(4, 4), torch.zeros(4, 3, dtype=torch.int32),
                                   torch.zeros(2, 4, dtype=torch.int32))


# --- the dispatch --------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_amx_build_holds_the_tile_instructions():
    # The real build is compiled wherever the compiler takes the flags (it cannot run here): its
    # kernels are in the extension as AMX instructions (QK's steps and tail step, PV: 6 TDPBF16PS).
    so = paged_ops._C.__file__
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True, check=True).stdout
    counts = {i: len(re.findall(rf"\b{i}\b", asm)) for i in ("ldtilecfg", "tileloadd", "tilestored", "tilezero",
                                                             "tdpbf16ps")}
    assert all(counts.values()) and counts["tdpbf16ps"] >= 6, counts


def test_amx_emulated_is_never_the_default():
    assert ops.supported_isas()[0] == "amx_emulated" and ops.supported_isas()[-1] != "amx_emulated"

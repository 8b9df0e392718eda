"""What is specific to the cpu backend: the split-KV path its thread scheduling takes, and bit
probes of its vectorized (AVX2/F16C) fp8 code. The op contract over the full grid runs in
tests/test_ops.py."""
from __future__ import annotations

import math

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import FP8_DTYPES as FP8
from paged_ops.testing import assert_close, empty_cache, make_case, nan_like, poison

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
def test_attention_all_minus_inf_keys_give_nan_like_the_reference(seq_len):
    """Every visible K element -inf (e5m2 0xFC): every score is -inf or NaN, and softmax over only
    -inf is NaN in the reference; the kernel must not turn it into a zero row."""
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
    assert ref[:, 4:].isnan().all() and not ref[:, :4].isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    assert_close(out[:, :4], ref[:, :4], torch.float32)

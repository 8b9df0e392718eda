"""Keys and values of different head sizes, and heads up to 576 (#24 item 1: MLA), on every backend.

The contract (``paged_ops.reference``): ``query``/``key_cache`` have head size Dk,
``value_cache``/``out`` Dv <= Dk, both multiples of 8 up to 576. The shapes users run:

- absorbed MLA decode (DeepSeek-V2/V3, Kimi K2): one KV head holding the 576-wide latent (512 +
  64 RoPE dimensions), ``value_cache = key_cache[..., :512]`` (a view of the same storage), 16-128
  query heads;
- DeepSeek's non-absorbed prefill: per-head keys of 192 (128 + 64 RoPE) and values of 128, separate
  caches;
- any other Dk >= Dv, with every variant and fp8 caches.

Each case runs on every backend against the float64 reference with NaN outputs and NaN unused
slots (``paged_ops.testing.make_case``), and checks that neither cache was written. Tiers as in
tests/test_ops.py: cpu the full list, the CUDA emulator a cover, Triton (the interpreter) the small
list.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_bits_equal, assert_close, assert_lse_close, bits, empty_cache, make_case
from tests.test_ops import BACKENDS, TIER, VARIANTS, Var, device_of, sync

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class HeadCase:
    """One batch with key head size ``dk`` and value head size ``dv``; q_lens None = decode.
    value_in_key: value_cache is key_cache[..., :dv] (absorbed MLA)."""

    seq_lens: tuple
    q_lens: tuple | None
    num_heads: int
    num_kv_heads: int
    dk: int
    dv: int
    block_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype | None = None
    value_in_key: bool = False
    causal: bool = True
    layout: str = "NHD"
    seed: int = 0

    def build(self, device):
        return make_case(list(self.seq_lens), None if self.q_lens is None else list(self.q_lens),
                         num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.dk,
                         value_head_size=self.dv, value_in_key=self.value_in_key, block_size=self.block_size,
                         dtype=self.dtype, cache_dtype=self.cache_dtype, layout=self.layout, device=device,
                         seed=self.seed)

    @property
    def id(self) -> str:
        kind = "decode" if self.q_lens is None else f"prefill-q{list(self.q_lens)}"
        cd = "" if self.cache_dtype is None else f"-{str(self.cache_dtype)[6:]}"
        view = "-latent" if self.value_in_key else ""
        causal = "" if self.causal else "-noncausal"
        return (f"{kind}-dk{self.dk}-dv{self.dv}{view}-h{self.num_heads}x{self.num_kv_heads}-bs{self.block_size}"
                f"-{str(self.dtype)[6:]}{cd}-{self.layout}-L{list(self.seq_lens)}{causal}").replace(" ", "")


def absorbed(seq_lens, q_lens=None, num_heads=16, block_size=16, dtype=BF16, cache_dtype=None, seed=0):
    """DeepSeek's absorbed MLA: one latent head of 512 + 64, the value its first 512 columns."""
    return HeadCase(tuple(seq_lens), q_lens and tuple(q_lens), num_heads, 1, 576, 512, block_size, dtype,
                    cache_dtype, value_in_key=True, seed=seed)


def non_absorbed(seq_lens, q_lens, num_heads=4, block_size=16, dtype=BF16, causal=True, seed=0):
    """DeepSeek's prefill: per-head keys 128 + 64 RoPE = 192, values 128, separate caches."""
    return HeadCase(tuple(seq_lens), tuple(q_lens), num_heads, num_heads, 192, 128, block_size, dtype,
                    causal=causal, seed=seed)


SMALL = [
    absorbed((1, 17, 70)),
    absorbed((65, 3), block_size=64, dtype=F16, cache_dtype=E4M3, seed=1),
    absorbed((9, 4), (9, 2), block_size=1, dtype=F32, seed=2),
    non_absorbed((20, 33, 5), (20, 1, 5), seed=3),
    HeadCase((7, 20), None, 6, 2, 136, 72, 3, F16, layout="HND", seed=4),
    HeadCase((5, 18), None, 2, 2, 576, 576, 16, F32, seed=5),
    HeadCase((9, 12), (9, 5), 4, 1, 320, 8, 7, BF16, causal=False, seed=6),
]
COVER = SMALL + [
    absorbed((33, 1), num_heads=128, block_size=16, seed=7),
    absorbed((40,), (40,), num_heads=16, block_size=16, dtype=BF16, cache_dtype=E5M2, seed=8),
    non_absorbed((64, 9), (30, 9), num_heads=2, block_size=1, dtype=F16, causal=False, seed=9),
    HeadCase((13, 2), None, 8, 4, 256, 64, 16, BF16, E4M3, seed=10),
    HeadCase((24,), (24,), 2, 1, 576, 64, 3, F16, layout="HND", seed=11),
]
FULL = COVER + [
    absorbed((1, 17, 300, 4096), num_heads=16, block_size=16, seed=12),
    absorbed((100, 2000), num_heads=128, block_size=64, dtype=F16, seed=13),
    absorbed((700,), (700,), num_heads=16, block_size=64, dtype=BF16, seed=14),
    non_absorbed((600, 90), (64, 90), num_heads=4, block_size=16, dtype=BF16, seed=15),
    HeadCase((1500,), None, 4, 4, 192, 128, 16, F32, seed=16),
]
CASES = {"small": SMALL, "pairwise": COVER, "full": FULL}


def by_backend():
    return [pytest.param(b, c, id=f"{b}-{c.id}") for b in BACKENDS for c in CASES[TIER[b]]]


def cache_bits(case) -> list[torch.Tensor]:
    # The storage of both caches (a latent view shares key_cache's): neither may be written.
    return [bits(case.key_cache).clone(), bits(case.value_cache).clone()]


def run(backend: str, spec: HeadCase, c, out, **kw) -> None:
    ops = paged_ops.backend(backend)
    if spec.q_lens is None:
        ops.decode_attention(*c.decode_args(out), **kw)
    else:
        ops.prefill_attention(*c.prefill_args(out, spec.causal), **kw)


def reference_of(spec: HeadCase, c, **kw):
    return c.reference_decode_lse(**kw) if spec.q_lens is None else c.reference_prefill_lse(spec.causal, **kw)


def test_cases_have_the_shapes_they_say():
    c = absorbed((1, 17)).build("cpu")
    assert c.key_cache.shape[-1] == 576 and c.value_cache.shape[-1] == 512
    assert c.value_cache.data_ptr() == c.key_cache.data_ptr()  # one latent: value is a view of the key
    assert c.new_out().shape == (2, 16, 512) and c.new_out().isnan().all()
    c = non_absorbed((5,), (5,)).build("cpu")
    assert c.key_cache.shape[-1] == 192 and c.value_cache.shape[-1] == 128
    assert c.value_cache.untyped_storage().data_ptr() != c.key_cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend,spec", by_backend())
def test_attention_with_value_head_size(backend, spec):
    device = device_of(backend)
    c = spec.build(device)
    before = cache_bits(c)
    out = c.new_out()
    run(backend, spec, c, out)
    sync(device)
    ref, _ = reference_of(spec, c)
    assert out.shape[-1] == spec.dv
    assert_close(out, ref, c.dtype)
    for got, want in zip(cache_bits(c), before):
        assert torch.equal(got, want), "an attention op wrote its cache"


# Every variant on the absorbed decode and the non-absorbed prefill (small: three of them).
VARIANT_CASES = [absorbed((5, 40), num_heads=16, block_size=16, dtype=BF16, seed=20),
                 non_absorbed((30, 9), (12, 9), num_heads=2, block_size=3, dtype=F16, seed=21)]


def by_backend_variants():
    count = {"small": 3, "pairwise": 7, "full": len(VARIANTS)}
    return [pytest.param(b, c, v, id=f"{b}-{c.id}-{v.id}") for b in BACKENDS for c in VARIANT_CASES
            for v in VARIANTS[:count[TIER[b]]] + VARIANTS[len(VARIANTS) - 1:]]


@pytest.mark.parametrize("backend,spec,var", by_backend_variants())
def test_variants_with_value_head_size(backend, spec, var: Var):
    device = device_of(backend)
    c = spec.build(device)
    kw = var.kwargs(c, device, spec.seed)
    c.poison_hidden(spec.causal, **kw)  # keys outside every row's window hold inf: never read
    out = c.new_out()
    run(backend, spec, c, out, **kw)
    sync(device)
    ref, ref_lse = reference_of(spec, c, **kw)
    assert_close(out, ref, c.dtype)
    if var.lse:
        assert_lse_close(kw["lse"], ref_lse, c.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_rows_with_value_head_size(backend):
    """The batch-invariant mode at Dk != Dv: a sequence's row is bitwise the same alone and in a batch."""
    device = device_of(backend)
    big = absorbed((3, 90, 40), num_heads=16, block_size=16, dtype=BF16, seed=30).build(device)
    ops = paged_ops.backend(backend)
    out_big = big.new_out()
    ops.decode_attention(*big.decode_args(out_big), batch_invariant=True)
    one = (big.new_out()[1:2], big.query[1:2], big.key_cache, big.value_cache, big.block_tables[1:2],
           big.seq_lens[1:2], big.scale)
    ops.decode_attention(*one, batch_invariant=True)
    sync(device)
    assert_bits_equal(one[0], out_big[1:2], "row of a batch vs alone")
    assert_close(out_big, big.reference_decode(), big.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_keys_and_values_of_their_own_sizes(backend):
    """The non-absorbed MLA cache write: keys [T, H, 192], values [T, H, 128], each into its cache."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(21, 2, 192, generator=g).to(BF16), torch.randn(21, 2, 128, generator=g).to(BF16)
    slots = torch.randperm(4 * 8, generator=g)[:21]
    slots[5] = -1
    want_k, want_v = empty_cache(4, 8, 2, 192, BF16), empty_cache(4, 8, 2, 128, BF16)
    got_k, got_v = (empty_cache(4, 8, 2, d, BF16, device=device) for d in (192, 128))
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    paged_ops.backend(backend).reshape_and_cache(key.to(device), value.to(device), got_k, got_v, slots.to(device),
                                                 None, None)
    sync(device)
    assert_bits_equal(got_k, want_k, "key_cache")
    assert_bits_equal(got_v, want_v, "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_states_of_latent_rows(backend):
    """Split-KV over MLA: partial outputs of 512 columns merge like any other."""
    device = device_of(backend)
    g = torch.Generator().manual_seed(4)
    states = torch.randn(3, 4, 16, 512, generator=g).to(BF16)
    lse = torch.randn(3, 4, 16, generator=g)
    lse[0, 1] = -torch.inf
    want, want_lse = torch.empty(3, 16, 512, dtype=torch.float64), torch.empty(3, 16, dtype=torch.float64)
    reference.merge_states(want, want_lse, states, lse)
    out, out_lse = torch.full((3, 16, 512), torch.nan, dtype=BF16, device=device), torch.full((3, 16), torch.nan,
                                                                                              device=device)
    paged_ops.backend(backend).merge_states(out, out_lse, states.to(device), lse.to(device))
    sync(device)
    assert_close(out, want, BF16)
    assert_lse_close(out_lse, want_lse, BF16)


def _decode_args(dk=576, dv=512, kv_heads=1, v_kv_heads=None, out_dv=None, heads=16):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(4, 16, kv_heads, dk, generator=g)
    vc = kc[..., :dv] if v_kv_heads is None and dv <= dk else torch.randn(4, 16, v_kv_heads or kv_heads, dv,
                                                                          generator=g)
    q = torch.randn(2, heads, dk, generator=g)
    out = torch.empty(2, heads, dv if out_dv is None else out_dv)
    return (out, q, kc, vc, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 7], dtype=torch.int32),
            dk ** -0.5)


@pytest.mark.parametrize("args,match", [
    (dict(dk=128, dv=192), "value_cache head_size 192 is larger than key_cache head_size 128"),
    (dict(out_dv=576), r"out shape \(2, 16, 576\) must be \(num_tokens, num_heads, value_cache head_size\)"),
    (dict(dv=128, v_kv_heads=2), r"key_cache shape .* and value_cache shape .* must agree"),
    (dict(dk=584, dv=512), "key_cache: head_size 584 is not supported"),
    (dict(dk=576, dv=12), "value_cache: head_size 12 is not supported"),
])
def test_bad_head_size_combinations_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.paged.decode_attention(*_decode_args(**args))


def test_absorbed_decode_step_compiles_fullgraph_with_dynamic_shapes():
    """An absorbed MLA decode step as a model writes it: cache the new latent, attend with the value as
    a view of the latent cache, out [T, H, Dv]; under torch.compile(fullgraph, dynamic) with two batch
    sizes, recompiling at most once."""
    rank, rope_dim, heads, bs = 64, 16, 8, 8
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(12, bs, 1, rank + rope_dim, generator=g)

    def step(q, latent, rope, cache, slots, table, lens):
        # q: [T, heads, rank + rope_dim]; latent: [T, rank]; rope: [T, rope_dim]
        torch.ops.paged.concat_and_cache_mla(latent, rope, cache, slots, None)
        out = q.new_empty(q.shape[0], q.shape[1], rank)
        torch.ops.paged.decode_attention(out, q, cache, cache[..., :rank], table, lens, 0.125, None, None)
        return out

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for n in (2, 3):
        q = torch.randn(n, heads, rank + rope_dim, generator=g)
        latent, rope = torch.randn(n, rank, generator=g), torch.randn(n, rope_dim, generator=g)
        table = torch.arange(n * 4, dtype=torch.int32).view(n, 4)
        lens = torch.tensor([5 + 7 * s for s in range(n)], dtype=torch.int32)
        last = lens.long() - 1  # each sequence's newest token, the one this step caches
        slots = table.long().gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
        want_cache, got_cache = cache.clone(), cache.clone()
        want = step(q, latent, rope, want_cache, slots, table, lens)
        got = compiled(q, latent, rope, got_cache, slots, table, lens)
        torch.testing.assert_close(got, want)
        assert torch.equal(got_cache, want_cache)
    assert counter.frame_count <= 2

"""The op contract itself: opcheck, torch.compile, bad-input errors, backend selection."""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops import reference
from torch.library import opcheck  # noqa: F401  (public entry point; utils list below)
from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

from tests.helpers import FP8, assert_close, empty_cache, make_case, nan_like


def small_case(**kw):
    return make_case([5, 19], [5, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, **kw)


def op_samples():
    """One valid argument tuple per op (float and fp8 variants where they differ)."""
    c = small_case()
    f8 = small_case(cache_dtype=torch.float8_e4m3fn, scale_kind="head")
    decode = make_case([3, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    key, value = torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    slots = torch.tensor([0, 5, -1, 9, 30, 2])
    x = torch.randn(4, 64)
    kcs = [torch.randn(6, 8, 2, 64) for _ in range(2)]
    vcs = [torch.randn(6, 8, 2, 64) for _ in range(2)]
    return {
        "reshape_and_cache": [(key, value, c.key_cache.clone(), c.value_cache.clone(), slots, None, None),
                              (key, value, f8.key_cache.clone(), f8.value_cache.clone(), slots, f8.k_scale, f8.v_scale)],
        "decode_attention": [decode.decode_args(nan_like(decode.query))],
        "prefill_attention": [c.prefill_args(nan_like(c.query)), f8.prefill_args(nan_like(f8.query), False)],
        "quantize_fp8": [(torch.empty(4, 64, dtype=torch.float8_e5m2), x, torch.tensor([0.5]))],
        "dequantize_fp8": [(torch.empty(4, 64), x.to(torch.float8_e4m3fn), torch.tensor([0.5]))],
        "copy_blocks": [(kcs, vcs, torch.tensor([[0, 3], [1, 4]]))],
        "swap_blocks": [(kcs[0], torch.randn(3, 8, 2, 64), torch.tensor([[5, 0], [2, 2]]))],
    }


@pytest.mark.parametrize("op", paged_ops.OPS)
def test_opcheck(op):
    for args in op_samples()[op]:
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype in FP8 for a in args)
        # opcheck's schema test compares tensors with arithmetic torch lacks for fp8 dtypes
        # ("mul_cpu_reduced_float" not implemented); fp8 samples run every other opcheck test,
        # and the same ops' schemas are checked on the float samples.
        utils = [u for u in DEFAULT_TEST_UTILS if not (has_fp8 and u == "test_schema")]
        torch.library.opcheck(getattr(torch.ops.paged, op).default, args, test_utils=utils)


def test_torch_compile_fullgraph():
    case = small_case()
    key, value = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    used = set(case.block_tables[0, :1].tolist() + case.block_tables[1, :3].tolist())
    spare = next(b for b in range(case.key_cache.shape[0]) if b not in used)  # attention never reads it
    slots = torch.tensor([spare * 8 + 1, spare * 8 + 2])
    max_seqlen_q = case.max_seqlen_q

    def step(q, kc, vc):
        # q: [total_q, num_heads, head_size]
        out = torch.empty_like(q)
        torch.ops.paged.reshape_and_cache(key, value, kc, vc, slots, None, None)
        torch.ops.paged.prefill_attention(out, q * 1.0, kc, vc, case.block_tables, case.cu_seqlens_q,
                                          case.seq_lens, max_seqlen_q, case.scale, True, None, None)
        return out.sum(-1), kc

    kc, vc = case.key_cache.clone(), case.value_cache.clone()
    compiled = torch.compile(step, fullgraph=True)
    got, kc_after = compiled(case.query, kc, vc)
    want, _ = step(case.query, case.key_cache.clone(), case.value_cache.clone())
    torch.testing.assert_close(got, want, equal_nan=True)
    # The mutation of the cache inside the graph is visible to the caller.
    assert torch.equal(kc_after[spare, 1], key[0]) and torch.equal(kc[spare, 2], key[1])


def test_wrappers_and_torch_ops_agree_with_backend():
    case = small_case(dtype=torch.bfloat16)
    outs = [nan_like(case.query) for _ in range(3)]
    paged_ops.prefill_attention(*case.prefill_args(outs[0]))
    torch.ops.paged.prefill_attention(*case.prefill_args(outs[1]))
    paged_ops.backend("cpu").prefill_attention(*case.prefill_args(outs[2]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert_close(outs[0], case.reference_prefill(), torch.bfloat16)


# --- backend selection -----------------------------------------------------------------


def test_backend_selection():
    assert "cpu" in paged_ops.available_backends()
    assert paged_ops.selected_backend("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown backend"):
        paged_ops.backend("nope")
    with pytest.raises(ValueError, match="unknown backend"):
        with paged_ops.use_backend("nope"):
            pass
    with paged_ops.use_backend("cpu"):
        assert paged_ops.selected_backend("cpu") == "cpu"


def test_use_backend_routes_torch_ops():
    """Inside use_backend(name), torch.ops.paged.* gives exactly what backend(name) gives."""
    case = small_case(dtype=torch.float16)
    for name in [b for b in paged_ops.available_backends() if "cpu" in paged_ops.backend(b).devices]:
        routed, direct = nan_like(case.query), nan_like(case.query)
        with paged_ops.use_backend(name):
            assert paged_ops.selected_backend("cpu") == name
            torch.ops.paged.prefill_attention(*case.prefill_args(routed))
        paged_ops.backend(name).prefill_attention(*case.prefill_args(direct))
        assert torch.equal(routed, direct), name
        assert_close(routed, case.reference_prefill(), torch.float16)


# --- bad input: a clear ValueError naming the argument ------------------------------------


def bad_inputs():
    c = small_case()
    f8 = small_case(cache_dtype=torch.float8_e5m2)
    out = nan_like(c.query)
    d = make_case([3, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    dout = nan_like(d.query)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kc, vc = c.key_cache, c.value_cache
    num_slots = kc.shape[0] * kc.shape[1]
    bt_bad = d.block_tables.clone()
    bt_bad[1, 0] = 10_000
    yield "query dtype", "query", lambda: torch.ops.paged.decode_attention(
        dout.int(), d.query.int(), *d.decode_args(dout)[2:])
    yield "out dtype", "out", lambda: torch.ops.paged.decode_attention(dout.half(), *d.decode_args(dout)[1:])
    yield "query rank", "query", lambda: torch.ops.paged.decode_attention(
        dout[0], d.query[0], *d.decode_args(dout)[2:])
    yield "head count", "num_heads", lambda: torch.ops.paged.decode_attention(
        nan_like(d.query[:, :3]), d.query[:, :3], *d.decode_args(dout)[2:])
    yield "head size", "head_size", lambda: torch.ops.paged.decode_attention(
        nan_like(d.query[..., :32]), d.query[..., :32].contiguous(), *d.decode_args(dout)[2:])
    yield "unsupported head size", "head_size", lambda: torch.ops.paged.reshape_and_cache(
        torch.randn(1, 1, 12), torch.randn(1, 1, 12), torch.randn(2, 4, 1, 12), torch.randn(2, 4, 1, 12),
        torch.tensor([0]), None, None)
    yield "block id outside cache", "block_tables", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, bt_bad, d.seq_lens, d.scale, None, None)
    yield "seq_len beyond table", "seq_lens", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, d.block_tables, torch.tensor([3, 1000], dtype=torch.int32),
        d.scale, None, None)
    yield "seq_len zero in decode", "seq_lens", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, d.block_tables, torch.tensor([0, 3], dtype=torch.int32),
        d.scale, None, None)
    yield "block_tables dtype", "block_tables", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, d.block_tables.long(), d.seq_lens, d.scale, None, None)
    yield "q_len > seq_len", "seq_len", lambda: torch.ops.paged.prefill_attention(
        out, c.query, kc, vc, c.block_tables, c.cu_seqlens_q, torch.tensor([5, 2], dtype=torch.int32),
        c.max_seqlen_q, c.scale, True, None, None)
    yield "cu_seqlens end", "cu_seqlens_q", lambda: torch.ops.paged.prefill_attention(
        out, c.query, kc, vc, c.block_tables, torch.tensor([0, 5, 7], dtype=torch.int32), c.seq_lens,
        c.max_seqlen_q, c.scale, True, None, None)
    yield "max_seqlen_q too small", "max_seqlen_q", lambda: torch.ops.paged.prefill_attention(
        *c.prefill_args(out)[:7], 1, c.scale, True, None, None)
    yield "fp8 cache without scales", "k_scale", lambda: torch.ops.paged.prefill_attention(
        *f8.prefill_args(nan_like(f8.query))[:10], None, None)
    yield "scales on a float cache", "k_scale", lambda: torch.ops.paged.prefill_attention(
        *c.prefill_args(out)[:10], torch.ones(1), torch.ones(1))
    yield "per-head scale size", "k_scale", lambda: torch.ops.paged.prefill_attention(
        *f8.prefill_args(nan_like(f8.query))[:10], torch.ones(3), torch.ones(3))
    yield "slot outside cache", "slot_mapping", lambda: torch.ops.paged.reshape_and_cache(
        key, value, kc, vc, torch.tensor([0, num_slots, 1]), None, None)
    yield "slot_mapping dtype", "slot_mapping", lambda: torch.ops.paged.reshape_and_cache(
        key, value, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32), None, None)
    yield "key/cache kv heads", "key", lambda: torch.ops.paged.reshape_and_cache(
        torch.randn(3, 4, 64), torch.randn(3, 4, 64), kc, vc, torch.tensor([0, 1, 2]), None, None)
    yield "key/value caches differ", "value_cache", lambda: torch.ops.paged.reshape_and_cache(
        key, value, kc, vc.half(), torch.tensor([0, 1, 2]), None, None)
    yield "quantize to non-fp8", "out", lambda: torch.ops.paged.quantize_fp8(
        torch.empty(4), torch.randn(4), torch.ones(1))
    yield "quantize scale size", "scale", lambda: torch.ops.paged.quantize_fp8(
        torch.empty(4, dtype=torch.float8_e4m3fn), torch.randn(4), torch.ones(2))
    yield "copy src out of range", "block_mapping", lambda: torch.ops.paged.copy_blocks(
        [kc.clone()], [vc.clone()], torch.tensor([[kc.shape[0], 0]]))
    yield "copy dst negative", "block_mapping", lambda: torch.ops.paged.copy_blocks(
        [kc.clone()], [vc.clone()], torch.tensor([[0, -1]]))
    yield "copy dst twice", "block_mapping", lambda: torch.ops.paged.copy_blocks(
        [kc.clone()], [vc.clone()], torch.tensor([[0, 2], [1, 2]]))
    yield "copy mapping shape", "block_mapping", lambda: torch.ops.paged.copy_blocks(
        [kc.clone()], [vc.clone()], torch.tensor([0, 2]))
    yield "swap dst out of range", "block_mapping", lambda: torch.ops.paged.swap_blocks(
        kc, torch.empty(2, *kc.shape[1:]), torch.tensor([[0, 2]]))
    yield "swap dtype", "dst", lambda: torch.ops.paged.swap_blocks(
        kc, torch.empty(2, *kc.shape[1:], dtype=torch.float16), torch.tensor([[0, 1]]))


CASES = list(bad_inputs())


@pytest.mark.parametrize("what,names,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(what, names, call):
    with pytest.raises(ValueError, match=names):
        call()


def test_bad_input_leaves_outputs_untouched():
    d = make_case([3, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    kc = d.key_cache.clone()
    with pytest.raises(ValueError):
        torch.ops.paged.reshape_and_cache(torch.randn(2, 2, 64), torch.randn(2, 2, 64), kc, d.value_cache,
                                          torch.tensor([0, 10_000]), None, None)
    assert torch.equal(kc.view(torch.int32), d.key_cache.view(torch.int32))


def test_reference_matches_naive_dense_attention():
    """The oracle itself, checked against torch's SDPA on a contiguous layout."""
    case = make_case([33], [33], num_heads=4, num_kv_heads=4, head_size=64, block_size=5, dtype=torch.float32)
    ref = case.reference_prefill()
    k = reference.gather_kv(case.key_cache, case.block_tables[0], 33)
    v = reference.gather_kv(case.value_cache, case.block_tables[0], 33)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        case.query.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(ref, sdpa.transpose(0, 1))


def test_env_forces_backend(monkeypatch):
    monkeypatch.setenv("PAGED_OPS_BACKEND", "cpu")
    assert paged_ops.selected_backend("cpu") == "cpu"
    with pytest.raises(RuntimeError, match="does not run on cuda"):
        paged_ops.selected_backend("cuda")

"""The op contract itself: opcheck, torch.compile, bad-input errors, backend selection."""
from __future__ import annotations

import re

import pytest
import torch

import paged_ops
from paged_ops import reference
from torch.library import opcheck  # noqa: F401  (public entry point; utils list below)
from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

from paged_ops.testing import FP8_DTYPES, assert_close, empty_cache, make_case, make_variants, nan_like, poison


def small_case(**kw):
    return make_case([5, 19], [5, 3], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, **kw)


def decode_case(**kw):
    return make_case([3, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=8, **kw)


def op_samples():
    """One valid argument tuple per op (float and fp8 variants where they differ)."""
    c = small_case()
    f8 = small_case(cache_dtype=torch.float8_e4m3fn, scale_kind="head")
    decode = make_case([3, 17], num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    # keys and values of different head sizes (MLA): the latent with its value a view, and DeepSeek's prefill
    latent = make_case([3, 17], num_heads=8, num_kv_heads=1, head_size=80, value_head_size=64, value_in_key=True,
                       block_size=8, dtype=torch.bfloat16)
    split = make_case([5, 19], [5, 3], num_heads=2, num_kv_heads=2, head_size=24, value_head_size=16, block_size=8)
    key, value = torch.randn(6, 2, 64), torch.randn(6, 2, 64)
    slots = torch.tensor([0, 5, -1, 9, 30, 2])
    x = torch.randn(4, 64)
    kcs = [torch.randn(6, 8, 2, 64) for _ in range(2)]
    vcs = [torch.randn(6, 8, 2, 64) for _ in range(2)]
    return {
        "reshape_and_cache": [(key, value, c.key_cache.clone(), c.value_cache.clone(), slots, None, None),
                              (key, value, f8.key_cache.clone(), f8.value_cache.clone(), slots, f8.k_scale, f8.v_scale),
                              (torch.randn(6, 2, 24), torch.randn(6, 2, 16), split.key_cache.clone(),
                               split.value_cache.clone(), slots, None, None)],
        "decode_attention": [decode.decode_args(nan_like(decode.query)), latent.decode_args(latent.new_out())],
        "prefill_attention": [c.prefill_args(nan_like(c.query)), f8.prefill_args(nan_like(f8.query), False),
                              split.prefill_args(split.new_out()), latent.prefill_args(latent.new_out())],
        "merge_attention_states": [(torch.empty(4, 2, 64), torch.empty(4, 2), torch.randn(4, 2, 64), torch.randn(4, 2),
                                    torch.randn(4, 2, 64), torch.randn(4, 2)),
                                   (torch.empty(3, 2, 64, dtype=torch.bfloat16), None,
                                    torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2), torch.randn(3, 2, 64).bfloat16(),
                                    torch.randn(3, 2))],
        "merge_states": [(torch.empty(4, 2, 64), torch.empty(4, 2), torch.randn(4, 3, 2, 64), torch.randn(4, 3, 2)),
                         (torch.empty(3, 2, 64, dtype=torch.float16), None,
                          torch.randn(5, 3, 2, 64).half().transpose(0, 1), torch.randn(5, 3, 2).transpose(0, 1))],
        "quantize_fp8": [(torch.empty(4, 64, dtype=torch.float8_e5m2), x, torch.tensor([0.5]))],
        "dequantize_fp8": [(torch.empty(4, 64), x.to(torch.float8_e4m3fn), torch.tensor([0.5]))],
        "copy_blocks": [(kcs, vcs, torch.tensor([[0, 3], [1, 4]]))],
        "swap_blocks": [(kcs[0], torch.randn(3, 8, 2, 64), torch.tensor([[5, 0], [2, 2]]))],
        "concat_and_cache_mla": [(torch.randn(6, 64), torch.randn(6, 16), torch.randn(6, 8, 1, 80), slots, None),
                                 (torch.randn(6, 64).bfloat16(), torch.randn(6, 16).bfloat16(),
                                  torch.randn(6, 8, 1, 80).to(torch.float8_e4m3fn), slots, torch.tensor([0.25]))],
    }


@pytest.mark.parametrize("op", paged_ops.OPS)
def test_opcheck(op):
    for args in op_samples()[op]:
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES for a in args)
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
    yield "negative seq_len in decode", "seq_lens", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, d.block_tables, torch.tensor([-1, 3], dtype=torch.int32),
        d.scale, None, None)
    yield "block_tables dtype", "block_tables", lambda: torch.ops.paged.decode_attention(
        dout, d.query, d.key_cache, d.value_cache, d.block_tables.long(), d.seq_lens, d.scale, None, None)
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


# What paged_ops/_validate.py (the Python validation the C++ one replaced) said for each case
# above, recorded from it before it was removed: a caller sees the same messages.
PYTHON_VALIDATOR_MESSAGES = {
    'query dtype': "query has dtype torch.int32; expected one of ['torch.float32', 'torch.float16', 'torch.bfloat16']",
    'out dtype': "out has dtype torch.float16; expected one of ['torch.float32']",
    'query rank': 'query must have 3 dimensions, got shape (4, 64)',
    'head count': "query num_heads 3 is not a multiple of the cache's num_kv_heads 2",
    'head size': 'query head_size 32 != key_cache head_size 64',
    'unsupported head size': 'key_cache: head_size 12 is not supported (must be a multiple of 8, at most 576)',
    'block id outside cache': 'block_tables holds a block id outside the cache [0, 7): min 0, max 10000',
    'seq_len beyond table': 'seq_lens max 1000 exceeds what block_tables covers (4 blocks x block_size 8 = 32)',
    'negative seq_len in decode': 'seq_lens must be >= 0',
    'block_tables dtype': "block_tables has dtype torch.int64; expected one of ['torch.int32']",
    'cu_seqlens end': 'cu_seqlens_q must start at 0 and end at total_q_tokens=8, got 0..7',
    'max_seqlen_q too small': 'max_seqlen_q=1 is smaller than the longest query (5)',
    'fp8 cache without scales': 'k_scale is required for an fp8 (torch.float8_e5m2) cache',
    'scales on a float cache': 'k_scale/v_scale are only for fp8 caches; the cache dtype is torch.float32',
    # #27 item 9: per-sequence scales joined the forms (and K and V may differ).
    'per-head scale size': 'k_scale must have 1 element (per tensor), shape (2,) (per KV head) or shape '
                           '(num_seqs, num_kv_heads) = (2, 2) (per sequence and KV head), got shape (3,)',
    'slot outside cache': 'slot_mapping holds slot 56, outside the cache (7 blocks x 8 slots)',
    'slot_mapping dtype': "slot_mapping has dtype torch.int32; expected one of ['torch.int64']",
    'key/cache kv heads': 'key is [num_tokens, 4, 64] but its cache holds [num_kv_heads=2, head_size=64]',
    'key/value caches differ': 'key_cache dtype torch.float32 != value_cache dtype torch.float16',
    'quantize to non-fp8': "out has dtype torch.float32; expected one of ['torch.float8_e4m3fn', 'torch.float8_e5m2']",
    'quantize scale size': 'scale must have exactly 1 element (per-tensor scale), got 2',
    'copy src out of range': 'block_mapping source ids must be in [0, 7), got 7..7',
    'copy dst negative': 'block_mapping destination ids must be in [0, 7), got -1..-1',
    'copy dst twice': 'block_mapping destination ids must be distinct',
    'copy mapping shape': 'block_mapping must have 2 dimensions, got shape (2,)',
    'swap dst out of range': 'block_mapping destination ids must be in [0, 2), got 2..2',
    'swap dtype': "dst has dtype torch.float16; expected one of ['torch.float32']",
}


@pytest.mark.parametrize("what,names,call", CASES, ids=[c[0] for c in CASES])
def test_bad_input_message_matches_python_validator(what, names, call):
    with pytest.raises(ValueError) as raised:
        call()
    expected = re.escape(PYTHON_VALIDATOR_MESSAGES[what])
    if what == "block id outside cache":  # the smallest used id depends on make_case's random tables
        expected = expected.replace("min\\ 0", r"min\ \d+")
    assert re.fullmatch(expected, str(raised.value)), (str(raised.value), PYTHON_VALIDATOR_MESSAGES[what])


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


# --- rejections added with the C++ validation (#12 items 2, 3, 7) ---------------------------

INT32_MAX = 2**31 - 1


def _decode_on(key_cache, query=None):
    """A decode_attention call over key_cache that validation must reject, as a thunk (out is a
    stride-0 view: these calls must never write)."""
    query = torch.randn(1, 1, key_cache.shape[3]) if query is None else query
    num_seqs = query.shape[0]
    out = torch.empty(1, 1, query.shape[2]).expand(query.shape)
    return lambda: torch.ops.paged.decode_attention(
        out, query, key_cache, key_cache, torch.zeros(num_seqs, 1, dtype=torch.int32),
        torch.ones(num_seqs, dtype=torch.int32), 1.0, None, None)


def new_rejections():
    no_kv_heads = torch.zeros(4, 4, 0, 16)
    # #12 item 2: 0 KV heads passed validation, then SIGFPE in the cpu kernel (reshape_and_cache)
    # or ZeroDivisionError in validation (decode/prefill).
    yield "0 kv heads, reshape_and_cache", "num_kv_heads", lambda: torch.ops.paged.reshape_and_cache(
        torch.randn(3, 0, 16), torch.randn(3, 0, 16), no_kv_heads, no_kv_heads.clone(), torch.tensor([0, 1, 2]),
        None, None)
    yield "0 kv heads, decode", "num_kv_heads", _decode_on(no_kv_heads, torch.randn(2, 4, 16))
    yield "0 kv heads, prefill", "num_kv_heads", lambda: torch.ops.paged.prefill_attention(
        torch.empty(2, 4, 16), torch.randn(2, 4, 16), no_kv_heads, no_kv_heads, torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 2, 1.0, True, None, None)
    yield "0 query heads", "num_heads", _decode_on(torch.randn(4, 4, 2, 16), torch.randn(2, 0, 16))
    # #12 item 3: sizes past int32 (stride-0 views cost no memory) were narrowed in the kernels
    # after validation saw the real value: a segfault / an out-of-bounds write.
    huge_block = torch.ones(1, 1, 1, 8).expand(1, 2**32 + 16, 1, 8)
    yield "block_size past int32, decode", "key_cache: block_size .* does not fit", _decode_on(huge_block)
    yield "block_size past int32, reshape_and_cache", "key_cache: block_size .* does not fit", lambda: torch.ops.paged.reshape_and_cache(
        torch.randn(1, 1, 8), torch.randn(1, 1, 8), huge_block, huge_block, torch.tensor([0]), None, None)
    many_heads = torch.ones(1, 1, 8).expand(1, INT32_MAX + 1, 8)
    huge_heads = torch.ones(1, 1, 1, 8).expand(1, 1, INT32_MAX + 1, 8)
    yield "num_kv_heads past int32", "key_cache: num_kv_heads .* does not fit", _decode_on(huge_heads, many_heads)
    yield "num_heads past int32", "query: num_heads .* does not fit", _decode_on(torch.ones(1, 1, 1, 8), many_heads)
    many_tokens = torch.ones(1, 1, 8).expand(INT32_MAX + 1, 1, 8)
    yield "num_tokens past int32", "query: num_tokens .* does not fit", lambda: torch.ops.paged.prefill_attention(
        many_tokens, many_tokens, torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8), torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 1, 1.0, True, None, None)
    c = small_case()
    yield "max_seqlen_q past int32", "max_seqlen_q: .* does not fit", lambda: torch.ops.paged.prefill_attention(
        *c.prefill_args(nan_like(c.query))[:7], 2**31, c.scale, True, None, None)
    # #12 item 7: a meta tensor among CPU tensors went to the fake kernel, which returned
    # without validating or writing `out`.
    d = decode_case()
    yield "meta query, cpu out", "query", lambda: torch.ops.paged.decode_attention(
        nan_like(d.query), d.query.to("meta"), *d.decode_args(None)[2:])
    yield "meta cache, cpu query", "key_cache", lambda: torch.ops.paged.reshape_and_cache(
        d.query[:, :2], d.query[:, :2], d.key_cache.to("meta"), d.value_cache, torch.tensor([0, 1]), None, None)
    yield "meta swap src, cpu dst", "src", lambda: torch.ops.paged.swap_blocks(
        d.key_cache.to("meta"), d.key_cache.clone(), torch.tensor([[0, 1]]))


NEW_CASES = list(new_rejections())


@pytest.mark.parametrize("what,names,call", NEW_CASES, ids=[c[0] for c in NEW_CASES])
def test_new_rejections(what, names, call):
    with pytest.raises(ValueError, match=names):
        call()


def test_meta_tensors_alone_still_trace():
    """All-meta arguments are a shape-only call (what tracing does): no error, nothing run."""
    d = decode_case()
    torch.ops.paged.decode_attention(*(a.to("meta") if isinstance(a, torch.Tensor) else a
                                       for a in d.decode_args(nan_like(d.query))))


def test_content_checks_only_read_used_block_table_entries():
    """Entries past a sequence's length may hold anything (make_case fills them with garbage
    ids); the used ones are checked, in place, on CPU tensors."""
    d = decode_case()
    bt = d.block_tables.clone()
    bt[0, 1:] = -7  # sequence 0 (3 tokens) uses only entry 0
    out = nan_like(d.query)
    torch.ops.paged.decode_attention(out, d.query, d.key_cache, d.value_cache, bt, d.seq_lens, d.scale, None, None)
    assert_close(out, d.reference_prefill(), d.dtype)
    bt[1, 2] = -1  # sequence 1 (17 tokens) uses entries 0..2
    with pytest.raises(ValueError, match="block_tables holds a block id outside the cache"):
        torch.ops.paged.decode_attention(out, d.query, d.key_cache, d.value_cache, bt, d.seq_lens, d.scale, None, None)


# --- defaults, keywords, backend selection (#12 items 9, 10, 11) -----------------------------


def test_optional_arguments_have_defaults_and_backend_ops_take_keywords():
    f8 = small_case(cache_dtype=torch.float8_e4m3fn, scale_kind="head")
    args = f8.prefill_args(nan_like(f8.query))
    ref = f8.reference_prefill()
    by_keyword = nan_like(f8.query)
    paged_ops.backend("cpu").prefill_attention(by_keyword, *args[1:10], k_scale=f8.k_scale, v_scale=f8.v_scale)
    assert_close(by_keyword, ref, f8.dtype)
    public = nan_like(f8.query)
    torch.ops.paged.prefill_attention(public, *args[1:9], k_scale=f8.k_scale, v_scale=f8.v_scale)  # causal=True
    assert torch.equal(public, by_keyword)
    c = decode_case()
    omitted = nan_like(c.query)
    paged_ops.backend("cpu").decode_attention(omitted, *c.decode_args(None)[1:7])  # no scales
    positional = nan_like(c.query)
    paged_ops.backend("cpu").decode_attention(*c.decode_args(positional))
    assert torch.equal(omitted, positional)
    with pytest.raises(ValueError, match="k_scale is required"):  # validated like the public op
        paged_ops.backend("cpu").prefill_attention(nan_like(f8.query), *args[1:10])


@pytest.mark.parametrize("value", ["bogus", "CPU", " cpu"])
def test_bad_backend_env_names_the_valid_ones(monkeypatch, value):
    monkeypatch.setenv("PAGED_OPS_BACKEND", value)
    c = decode_case()
    for call in (lambda: paged_ops.selected_backend("cpu"),
                 lambda: torch.ops.paged.decode_attention(*c.decode_args(nan_like(c.query)))):
        with pytest.raises(ValueError, match=r"PAGED_OPS_BACKEND=.*valid names.*'cpu', 'triton', 'cuda', 'cuda_emu'"):
            call()
    monkeypatch.setenv("PAGED_OPS_BACKEND", "")  # empty = unset
    assert paged_ops.selected_backend("cpu") == "cpu"


def test_env_backend_is_read_per_call(monkeypatch):
    second = next((b for b in ("cuda_emu", "triton") if b in paged_ops.available_backends()), None)
    assert second is not None, "this test needs a second CPU backend (cuda_emu or triton)"
    monkeypatch.setenv("PAGED_OPS_BACKEND", second)
    assert paged_ops.selected_backend("cpu") == second
    monkeypatch.delenv("PAGED_OPS_BACKEND")
    assert paged_ops.selected_backend("cpu") == "cpu"


def _second_cpu_backend() -> str:
    # cuda_emu first: the Triton interpreter is slow.
    names = [b for b in ("cuda_emu", "triton")
             if b in paged_ops.available_backends() and "cpu" in paged_ops.backend(b).devices]
    assert names, "these tests need a second backend that runs on CPU tensors (cuda_emu or triton)"
    return names[0]


def test_use_backend_follows_asyncio_tasks():
    """Two tasks in one thread, interleaving inside their use_backend blocks: each sees its own
    backend, an exit does not pop the other's, and nothing leaks out (#12 item 11)."""
    import asyncio

    other = _second_cpu_backend()
    seen = []

    async def task(name, entered, proceed):
        with paged_ops.use_backend(name):
            entered.set()
            await proceed.wait()
            seen.append((name, paged_ops.selected_backend("cpu")))
        seen.append((name + " after", paged_ops.selected_backend("cpu")))

    async def main():
        a_in, b_in, a_go, b_go = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(task(other, a_in, a_go))
        await a_in.wait()
        b = asyncio.create_task(task("cpu", b_in, b_go))
        await b_in.wait()
        seen.append(("main", paged_ops.selected_backend("cpu")))  # neither block is ours
        a_go.set()  # a leaves its block first, while b is still inside its own
        await a
        b_go.set()
        await b

    asyncio.run(main())
    assert seen == [("main", "cpu"), (other, other), (other + " after", "cpu"), ("cpu", "cpu"),
                    ("cpu after", "cpu")], seen


def test_use_backend_is_per_task_and_routes_the_op():
    """Interleaved tasks forcing different backends: the op each runs goes where its own
    use_backend says (the forced backend does not run on CUDA tensors: the error tells)."""
    import asyncio

    other = _second_cpu_backend()
    c = small_case(dtype=torch.float16)
    results = {}

    async def task(name):
        with paged_ops.use_backend(name):
            await asyncio.sleep(0)
            out = nan_like(c.query)
            torch.ops.paged.prefill_attention(*c.prefill_args(out))
            results[name] = (paged_ops.selected_backend("cpu"), out)
            await asyncio.sleep(0)
            if "cuda" not in paged_ops.backend(name).devices:
                with pytest.raises(RuntimeError, match=f"backend '{name}' \\(forced by use_backend\\) does not run on cuda"):
                    paged_ops.selected_backend("cuda")

    async def main():
        await asyncio.gather(task(other), task("cpu"))

    asyncio.run(main())
    for name in (other, "cpu"):
        assert results[name][0] == name
        direct = nan_like(c.query)
        paged_ops.backend(name).prefill_attention(*c.prefill_args(direct))
        assert torch.equal(results[name][1], direct), name
    assert paged_ops.selected_backend("cpu") == "cpu"


def test_use_backend_does_not_reach_other_threads():
    import threading

    other = _second_cpu_backend()
    seen = {}
    with paged_ops.use_backend(other):
        t = threading.Thread(target=lambda: seen.setdefault("thread", paged_ops.selected_backend("cpu")))
        t.start()
        t.join()
        seen["here"] = paged_ops.selected_backend("cpu")
    assert seen == {"thread": "cpu", "here": other}


def test_backend_call_overrides_use_backend_for_that_call_only():
    other = _second_cpu_backend()
    c = decode_case()
    direct = {name: nan_like(c.query) for name in ("cpu", other)}
    for name, out in direct.items():
        getattr(torch.ops, {"cpu": "paged_cpu", "cuda_emu": "paged_cuda_emu", "triton": "paged_triton"}[name]) \
            .decode_attention(*c.decode_args(out))
    # The two backends round differently on this case, so the bits tell which one ran.
    assert not torch.equal(direct["cpu"], direct[other])
    with paged_ops.use_backend(other):
        routed = nan_like(c.query)
        paged_ops.backend("cpu").decode_attention(*c.decode_args(routed))
        assert torch.equal(routed, direct["cpu"])
        assert paged_ops.selected_backend("cpu") == other
        torch.ops.paged.decode_attention(*c.decode_args(routed))  # the block's backend again
        assert torch.equal(routed, direct[other])
    assert paged_ops.selected_backend("cpu") == "cpu"


# --- torch.compile with dynamic shapes (#12 item 8) -------------------------------------------


def test_torch_compile_dynamic_batch_and_max_seqlen_q_recompiles_at_most_once():
    """A varying number of sequences and a varying max_seqlen_q under dynamic=True: with
    max_seqlen_q an int in the schema, every new value was a recompile (the 9th raised
    FailOnRecompileLimitHit under fullgraph); as a SymInt it is traced symbolically (torch 2.14:
    one compile for all ten batches, no recompile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale):
        torch.ops.paged.prefill_attention(out, query * 1.0, key_cache, value_cache, block_tables, cu_seqlens_q,
                                          seq_lens, max_seqlen_q, scale, True, None, None)
        return out.sum(-1)

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    batches = [([37, 21], [33, 5]), ([70, 9, 30], [20, 2, 11]), ([40, 3, 80, 12], [13, 3, 2, 4]),
               ([100, 64], [12, 50]), ([33, 5, 17], [9, 5, 17]), ([50, 22, 9, 31, 6], [25, 22, 9, 2, 6]),
               ([70, 14], [30, 14]), ([18, 18, 18], [18, 7, 6]), ([90, 60, 45], [45, 60, 44]),
               ([126, 27], [26, 27])]
    for i, (seq_lens, q_lens) in enumerate(batches):
        case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=1, head_size=64, block_size=16)
        if i == 0:
            # Sizes equal in the first call are assumed equal ever after ("duck sizing"), a
            # recompile that has nothing to do with the op: the first batch has no such equal sizes.
            dims = [*case.query.shape, *case.key_cache.shape[:3], *case.block_tables.shape, len(seq_lens) + 1,
                    case.max_seqlen_q]
            dims = [d for d in dims if d > 1]  # 0 and 1 are specialized anyway
            assert len(set(dims)) == len(dims), dims
        out = nan_like(case.query)
        sums = compiled(*case.prefill_args(out)[:9])
        assert_close(out, case.reference_prefill(), case.dtype)
        torch.testing.assert_close(sums, out.sum(-1))
    assert len({max(q) for _, q in batches}) == len(batches)  # every batch a new max_seqlen_q
    assert counter.frame_count <= 2, f"{counter.frame_count - 1} recompiles"


# --- the attention variants (#13): opcheck, torch.compile, bad input -------------------------


def variant_samples():
    """decode/prefill with variants (every variant, the mutable optional lse among them) and
    merge_attention_states with and without out_lse."""
    c = small_case()
    d = decode_case(dtype=torch.bfloat16)
    f8 = small_case(cache_dtype=torch.float8_e5m2, scale_kind="head", dtype=torch.float16)
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(8, 4, 64, generator=g) for _ in range(2)]
    lses = [torch.randn(8, 4, generator=g) for _ in range(2)]
    return {
        "decode_attention": [(d.decode_args(nan_like(d.query)),
                              make_variants(4, softcap=2.0, window_left=5, sinks=True, alibi=True, lse_rows=2))],
        "prefill_attention": [(c.prefill_args(nan_like(c.query)), make_variants(4, window_left=3, lse_rows=8)),
                              (f8.prefill_args(nan_like(f8.query), False),
                               make_variants(4, softcap=1.0, sinks=True, alibi=True, lse_rows=8))],
        "merge_attention_states": [((nan_like(parts[0]), poison(torch.empty(8, 4)), parts[0], lses[0], parts[1],
                                     lses[1]), {}),
                                   ((nan_like(parts[0]), None, parts[0], lses[0], parts[1], lses[1]), {})],
    }


@pytest.mark.parametrize("op", ["decode_attention", "prefill_attention", "merge_attention_states"])
def test_opcheck_variants(op):
    for args, kwargs in variant_samples()[op]:
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES for a in args)
        utils = [u for u in DEFAULT_TEST_UTILS if not (has_fp8 and u == "test_schema")]
        torch.library.opcheck(getattr(torch.ops.paged, op).default, args, kwargs, test_utils=utils)


def test_torch_compile_variants_and_merge_no_recompiles():
    """Cascade attention in one compiled function (fullgraph, dynamic): a prefix pass and a suffix
    pass with the variants writing their lse (the mutable optional argument), merged with and
    without out_lse; batches of different sizes compile once."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(query, key_cache, value_cache, block_tables, seq_lens, sinks, alibi, scale):
        # query: [num_seqs, num_heads, head_size]
        a_out, b_out = torch.empty_like(query), torch.empty_like(query)
        a_lse = query.new_empty(query.shape[:2], dtype=torch.float32)
        b_lse = torch.empty_like(a_lse)
        torch.ops.paged.decode_attention(a_out, query * 1.0, key_cache, value_cache, block_tables, seq_lens, scale,
                                         None, None, softcap=3.0, window_left=40, sinks=sinks, alibi_slopes=alibi,
                                         lse=a_lse)
        torch.ops.paged.decode_attention(b_out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                         None, None, softcap=3.0, lse=b_lse, batch_invariant=True)
        merged, merged_lse, merged_no_lse = torch.empty_like(query), torch.empty_like(a_lse), torch.empty_like(query)
        torch.ops.paged.merge_attention_states(merged, merged_lse, a_out, a_lse, b_out, b_lse)
        torch.ops.paged.merge_attention_states(merged_no_lse, None, a_out, a_lse, b_out, b_lse)
        return a_out, a_lse, b_out, b_lse, merged, merged_lse, merged_no_lse

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    batches = [[37, 21, 9], [70, 9], [40, 3, 80, 12], [100, 64, 7, 5, 19], [33, 5, 17]]
    for i, seq_lens in enumerate(batches):
        case = make_case(seq_lens, num_heads=6, num_kv_heads=2, head_size=64, block_size=16)
        if i == 0:  # no equal sizes in the first call ("duck sizing" would guard on them)
            dims = [*case.query.shape, *case.key_cache.shape[:3], case.block_tables.shape[1]]
            assert len(set(dims)) == len(dims), dims
        kw = make_variants(6, sinks=True, alibi=True)
        args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, kw["sinks"],
                kw["alibi_slopes"], case.scale)
        got, want = compiled(*args), step(*args)
        for g_, w in zip(got, want):
            assert torch.equal(g_, w)
        assert torch.equal(got[4], got[6])
        if i == 0:
            first = counter.frame_count  # what the first call compiled (torch 2.14: two frames)
        ref, ref_lse = case.reference_decode_lse(softcap=3.0, window_left=40, **kw)
        assert_close(got[0], ref, case.dtype)
        assert torch.allclose(got[1].double(), ref_lse, atol=1e-5)
    assert counter.frame_count == first, f"{counter.frame_count - first} recompiles after the first batch"


def variant_bad_inputs():
    d = decode_case()
    c = small_case()
    args = d.decode_args(nan_like(d.query))  # 2 sequences, 4 heads
    num_heads = 4

    def decode(**kw):
        return lambda: torch.ops.paged.decode_attention(*args, **kw)

    yield "softcap negative", "softcap", decode(softcap=-1.0)
    yield "softcap NaN", "softcap", decode(softcap=float("nan"))
    yield "softcap inf", "softcap", decode(softcap=float("inf"))
    yield "softcap past float32", "softcap", decode(softcap=1e39)
    yield "softcap below float32", "softcap", decode(softcap=1e-40)
    yield "window_left < -1", "window_left", decode(window_left=-2)
    for name in ("sinks", "alibi_slopes"):
        yield f"{name} numel", name, decode(**{name: torch.zeros(num_heads + 1)})
        yield f"{name} dtype float64", name, decode(**{name: torch.zeros(num_heads, dtype=torch.float64)})
        yield f"{name} dtype bfloat16", name, decode(**{name: torch.zeros(num_heads, dtype=torch.bfloat16)})
        yield f"{name} device", name, decode(**{name: torch.zeros(num_heads, device="meta")})
        yield f"{name} rank", name, decode(**{name: torch.zeros(1, num_heads)})
        yield f"{name} non-contiguous", name, decode(**{name: torch.zeros(2 * num_heads)[::2]})
    yield "lse rows", "lse", decode(lse=torch.empty(3, num_heads))
    yield "lse heads", "lse", decode(lse=torch.empty(2, num_heads - 1))
    yield "lse transposed shape", "lse", decode(lse=torch.empty(num_heads, 2))
    yield "lse rank", "lse", decode(lse=torch.empty(2 * num_heads))
    yield "lse dtype", "lse", decode(lse=torch.empty(2, num_heads, dtype=torch.float64))
    yield "lse dtype bfloat16", "lse", decode(lse=torch.empty(2, num_heads, dtype=torch.bfloat16))
    yield "lse device", "lse", decode(lse=torch.empty(2, num_heads, device="meta"))
    yield "lse non-contiguous", "lse", decode(lse=torch.empty(num_heads, 2).t())
    out = nan_like(d.query)  # float32 [2, 4, 64]
    yield "lse inside out", "lse overlaps out", lambda: torch.ops.paged.decode_attention(
        out, *args[1:], lse=out.view(-1)[64:72].view(2, num_heads))
    query = d.query.clone()
    yield "lse inside query", "lse overlaps query", lambda: torch.ops.paged.decode_attention(
        nan_like(query), query, *args[2:], lse=query.view(-1)[:8].view(2, num_heads))
    sinks = torch.zeros(2, num_heads)
    yield "lse is sinks", "lse overlaps sinks", decode(sinks=sinks[0], lse=sinks)
    # prefill takes the same checks: one of each kind
    pargs = c.prefill_args(nan_like(c.query))  # 8 query tokens, 4 heads
    yield "prefill softcap", "softcap", lambda: torch.ops.paged.prefill_attention(*pargs, softcap=-0.5)
    yield "prefill window_left", "window_left", lambda: torch.ops.paged.prefill_attention(*pargs, window_left=-7)
    yield "prefill sinks", "sinks", lambda: torch.ops.paged.prefill_attention(*pargs, sinks=torch.zeros(2))
    yield "prefill alibi", "alibi_slopes", lambda: torch.ops.paged.prefill_attention(
        *pargs, alibi_slopes=torch.zeros(4, dtype=torch.float16))
    yield "prefill lse rows = num_seqs", "lse", lambda: torch.ops.paged.prefill_attention(
        *pargs, lse=torch.empty(2, 4))

    # merge_attention_states: each of its 6 arguments wrong in shape, dtype and device
    g = torch.Generator().manual_seed(0)
    m = dict(out=torch.empty(5, 4, 32), out_lse=torch.empty(5, 4), prefix_out=torch.randn(5, 4, 32, generator=g),
             prefix_lse=torch.randn(5, 4, generator=g), suffix_out=torch.randn(5, 4, 32, generator=g),
             suffix_lse=torch.randn(5, 4, generator=g))

    def merge(**changes):
        kw = {**m, **changes}
        return lambda: torch.ops.paged.merge_attention_states(
            kw["out"], kw["out_lse"], kw["prefix_out"], kw["prefix_lse"], kw["suffix_out"], kw["suffix_lse"])

    for name in ("out", "prefix_out", "suffix_out"):
        yield f"merge {name} shape", name, merge(**{name: torch.empty(5, 4, 40)})
        yield f"merge {name} rows", name, merge(**{name: torch.empty(6, 4, 32)})
        yield f"merge {name} rank", name, merge(**{name: torch.empty(5, 128)})
        yield f"merge {name} device", name, merge(**{name: torch.empty(5, 4, 32, device="meta")})
    yield "merge out dtype int", "out", merge(out=torch.empty(5, 4, 32, dtype=torch.int32))
    yield "merge prefix_out dtype", "prefix_out", merge(prefix_out=m["prefix_out"].half())
    yield "merge suffix_out dtype", "suffix_out", merge(suffix_out=m["suffix_out"].bfloat16())
    yield "merge out last dim strided", "out", merge(out=torch.empty(5, 4, 64)[..., ::2])
    for name in ("out_lse", "prefix_lse", "suffix_lse"):
        yield f"merge {name} shape", name, merge(**{name: torch.empty(5, 3)})
        yield f"merge {name} transposed", name, merge(**{name: torch.empty(4, 5)})
        yield f"merge {name} rank", name, merge(**{name: torch.empty(5, 4, 1)})
        yield f"merge {name} dtype", name, merge(**{name: torch.empty(5, 4, dtype=torch.float64)})
        yield f"merge {name} dtype half", name, merge(**{name: torch.empty(5, 4, dtype=torch.float16)})
        yield f"merge {name} device", name, merge(**{name: torch.empty(5, 4, device="meta")})
        yield f"merge {name} non-contiguous", name, merge(**{name: torch.empty(4, 5).t()})
    yield "merge in place (out is prefix_out)", "out overlaps prefix_out", merge(out=m["prefix_out"])
    yield "merge out is suffix_out", "out overlaps suffix_out", merge(out=m["suffix_out"])
    yield "merge out_lse is prefix_lse", "out_lse overlaps prefix_lse", merge(out_lse=m["prefix_lse"])
    yield "merge out_lse inside out", "out_lse overlaps out", merge(out_lse=m["out"].view(-1)[:20].view(5, 4))


VARIANT_BAD = list(variant_bad_inputs())


@pytest.mark.parametrize("what,names,call", VARIANT_BAD, ids=[c[0] for c in VARIANT_BAD])
def test_variant_bad_input_raises_clear_error(what, names, call):
    with pytest.raises(ValueError, match=names):
        call()


def test_reference_merge_ignores_the_out_of_a_side_at_minus_inf():
    # A side with no keys (lse -inf) has a NaN out (reference.attention): the merge is the other
    # side exactly. Before the fix, 0 * NaN made the merged row NaN.
    out, lse = torch.empty(1, 2, 8, dtype=torch.float64), torch.empty(1, 2, dtype=torch.float64)
    side = torch.arange(16, dtype=torch.float64).view(1, 2, 8)
    nan = torch.full((1, 2, 8), float("nan"), dtype=torch.float64)
    reference.merge_attention_states(out, lse, nan, torch.full((1, 2), -float("inf")), side, torch.tensor([[0.5, 2.0]]))
    assert torch.equal(out, side) and torch.equal(lse, torch.tensor([[0.5, 2.0]], dtype=torch.float64))
    reference.merge_attention_states(out, lse, side, torch.tensor([[0.5, 2.0]]), nan, torch.full((1, 2), -float("inf")))
    assert torch.equal(out, side)


# --- the batch-invariant mode's API (#13 item 3) ---------------------------------------------


def test_batch_invariant_context_manager_nests(mode_seen):
    assert mode_seen() is False
    assert mode_seen(batch_invariant=True) is True
    with paged_ops.batch_invariant():
        assert mode_seen() is True
        with paged_ops.batch_invariant(False):
            assert mode_seen() is False
            assert mode_seen(batch_invariant=True) is True  # the call's own argument wins
            with paged_ops.batch_invariant():
                assert mode_seen() is True
            assert mode_seen() is False
        assert mode_seen() is True
    assert mode_seen() is False
    with pytest.raises(KeyError):
        with paged_ops.batch_invariant():
            raise KeyError("restored on the way out")
    assert mode_seen() is False


def test_batch_invariant_is_per_thread(mode_seen):
    import threading

    seen = {}

    def other():
        seen["thread"] = mode_seen()
        with paged_ops.batch_invariant():
            seen["thread inside"] = mode_seen()

    with paged_ops.batch_invariant():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["here"] = mode_seen()
    seen["after"] = mode_seen()
    assert seen == {"thread": False, "thread inside": True, "here": True, "after": False}


def test_batch_invariant_env(mode_seen, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_BATCH_INVARIANT", "1")
    assert mode_seen() is True  # read per call
    with paged_ops.batch_invariant(False):
        assert mode_seen() is False
    for value in ("0", "", "true", "11"):
        monkeypatch.setenv("PAGED_OPS_BATCH_INVARIANT", value)
        assert mode_seen() is False, value
    with paged_ops.batch_invariant():
        assert mode_seen() is True


def test_batch_invariant_reaches_decode(mode_seen, monkeypatch):
    from paged_ops import backends

    seen = []
    monkeypatch.setattr(backends._module("triton"), "decode_attention", lambda *args: seen.append(args[-2]))  # batch_invariant
    d = decode_case()
    with paged_ops.batch_invariant():
        backends.Backend("triton").decode_attention(*d.decode_args(nan_like(d.query)))
    backends.Backend("triton").decode_attention(*d.decode_args(nan_like(d.query)))
    assert seen == [True, False]


def test_batch_invariant_around_a_compiled_call(mode_seen):
    """The mode is read when the op runs, not when it is traced: a compiled function called inside
    the block runs in the mode, the same compiled code outside it does not (no recompile)."""
    from paged_ops import backends

    seen = []
    backends._module("triton").prefill_attention = lambda *args: seen.append(args[-2])  # batch_invariant (window_right last)
    c = small_case()

    def step(query):
        out = torch.empty_like(query)
        torch.ops.paged.prefill_attention(out, query * 1.0, c.key_cache, c.value_cache, c.block_tables, c.cu_seqlens_q,
                                          c.seq_lens, c.max_seqlen_q, c.scale, True, None, None, softcap=2.0)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with paged_ops.use_backend("triton"):
        compiled(c.query)
        with paged_ops.batch_invariant():
            compiled(c.query)
        compiled(c.query)
    assert seen == [False, True, False]

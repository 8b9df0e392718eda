"""What is specific to the CUDA backend on a real GPU: forced launch configurations (split-KV,
one pass, shared-KV chunking for groups > 8, tensor-core vs CUDA-core prefill on the same cases),
the tuner, and issue #13's decode variants (out and lse), merge_attention_states and the
batch-invariant mode (bitwise across batches, configurations and chunked prefill vs decode). The op contract (decode, prefill, reshape_and_cache, fp8, copy, host<->device swap)
runs for backend ``cuda`` on CUDA tensors in tests/test_ops.py. Collected only when a GPU is
present: the cases are parametrized over the available CUDA devices, so without one there is
nothing to run (and nothing reported as skipped-but-passing).
"""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

import paged_ops
from paged_ops import reference, tuning
from paged_ops.testing import FP8_DTYPES as FP8
from paged_ops.testing import assert_close, make_case, nan_like

DEVICES = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
GROUPS = (1, 2, 4, 7, 8)
HEAD_SIZES = (64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gpu():
    return paged_ops.backend("cuda")


def to_device(case, device):
    return case.to(device)  # paged_ops.testing.PagedCase.to


class configured:
    """The GPU attention kernels launched with an explicit configuration, e.g.
    "force_split=1,partition_size=64" (kernels/params.h LaunchConfig's fields;
    torch.ops.paged_cuda_test.*_config: test-only, no validation); "" = the kernels' defaults."""

    def __init__(self, spec: str):
        fields = tuning.cuda_config_fields()
        kw = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}
        assert set(kw) <= set(fields), f"unknown launch config keys {set(kw) - set(fields)}"
        self.config = [kw.get(k, 0) for k in fields]

    def decode_attention(self, *args, **variants):
        torch.ops.paged_cuda_test.decode_attention_config(*args, self.config, **variants)

    def prefill_attention(self, *args, **variants):
        torch.ops.paged_cuda_test.prefill_attention_config(*args, self.config, **variants)


def check_decode(case, ops=None):
    out = nan_like(case.query)
    (ops or gpu()).decode_attention(*case.decode_args(out))
    torch.cuda.synchronize()
    assert_close(out, case.reference_prefill(), case.dtype)


def check_prefill(case, causal=True, ops=None):
    out = nan_like(case.query)
    (ops or gpu()).prefill_attention(*case.prefill_args(out, causal))
    torch.cuda.synchronize()
    assert_close(out, case.reference_prefill(causal), case.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["force_split=1,partition_size=64", "partition_size=-1", ""])
@pytest.mark.parametrize("cache_dtype,scale_kind", [(None, "tensor")] + list(itertools.product(FP8, ("tensor", "head"))))
def test_decode_paths_fp8(device, split, cache_dtype, scale_kind):
    case = make_case([1, 63, 64, 65, 2000], num_heads=14, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.bfloat16, cache_dtype=cache_dtype, scale_kind=scale_kind, layout="HND", seed=1)
    check_decode(to_device(case, device), configured(split))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["force_split=1,partition_size=64", "partition_size=-1", "threads=256,kv_tile=32", ""])
@pytest.mark.parametrize("group,head_size,dtype,cache_dtype", [
    (16, 128, torch.bfloat16, None), (32, 64, torch.float16, torch.float8_e4m3fn), (64, 256, torch.float32, None),
    (80, 128, torch.bfloat16, torch.float8_e5m2)])
def test_decode_large_group(device, split, group, head_size, dtype, cache_dtype):
    # Groups > 8: the shared-KV kernel (cp.async staging, several warp tiles per block; > 64 heads
    # in head chunks), one-pass and split-KV, with lengths around the 64-token staging chunk.
    case = make_case([1, 63, 64, 65, 129, 2000], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=dtype, cache_dtype=cache_dtype, scale_kind="head",
                     layout=("NHD", "HND")[group % 3 == 1], seed=group)
    check_decode(to_device(case, device), configured(split))


PREFILL_GRID = [(bs, g, DTYPES[i % 3], HEAD_SIZES[i % 5], ("NHD", "HND")[i % 2], bool(i % 4))
                for i, (bs, g) in enumerate(itertools.product((1, 3, 16), GROUPS))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["tensor_cores=1", "tensor_cores=-1"])
@pytest.mark.parametrize("block_size,group,dtype,head_size,layout,causal", PREFILL_GRID)
def test_prefill(device, path, block_size, group, dtype, head_size, layout, causal):
    # Both kernels on the same cases: tensor cores (fp16/bf16; fp32 falls back) and CUDA cores.
    seq_lens = [1, 2 * block_size, 210, 90, 6]
    q_lens = [1, block_size, 50, 90, 0]
    case = make_case(seq_lens, q_lens=q_lens, num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                     block_size=block_size, dtype=dtype, layout=layout, seed=block_size * 10 + group)
    check_prefill(to_device(case, device), causal, configured(path))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_tc_matches_cuda_cores(device):
    # The two prefill kernels agree closely with each other (not only each with the reference).
    case = to_device(make_case([700, 300], q_lens=[500, 300], num_heads=32, num_kv_heads=8, head_size=128,
                               block_size=16, dtype=torch.float16, seed=8), device)
    outs = []
    for path in ("tensor_cores=1", "tensor_cores=-1"):
        out = nan_like(case.query)
        configured(path).prefill_attention(*case.prefill_args(out))
        outs.append(out.double())
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_tuner_records_and_uses_config(device, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    case = to_device(make_case([300, 700], num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
                               dtype=torch.float16, seed=5), device)
    out = nan_like(case.query)
    cfg = tuning.tune_cuda_decode(*case.decode_args(out), reps=3, force=True)
    assert tuning.last_config("cuda", "decode_attention")["source"] == "tuned"
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) == cfg
    (entry,) = json.loads((tmp_path / "tuning.json").read_text())["entries"].values()
    assert entry["config"] == cfg and entry["key"][1] == torch.cuda.get_device_properties(device).multi_processor_count
    check_decode(case)  # the tuned configuration is the one in use now
    pcfg = tuning.tune_cuda_prefill(*case.prefill_args(nan_like(case.query)), reps=3, force=True)
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables, case.max_seqlen_q) == pcfg
    check_prefill(case)
    # what the next process starts with: the store, pushed into the extension's table
    torch.ops.paged_cuda.set_tuned_configs([], [], True)
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) is None
    assert tuning.load() == 2
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) == cfg
    check_decode(case)
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path / "empty"))
    assert tuning.load() == 0  # later tests run on the defaults


# ---- the attention variants, merge_attention_states and the batch-invariant mode (issue #13) -------
def variant_args(num_heads, device, seed=0, softcap=0.0, window_left=-1, sinks=False, alibi=False):
    g = torch.Generator().manual_seed(1000 + seed)
    kw = dict(softcap=softcap, window_left=window_left)
    if sinks:
        kw["sinks"] = (torch.randn(num_heads, generator=g) * 2).to(device)
    if alibi:
        kw["alibi_slopes"] = (torch.rand(num_heads, generator=g) * 0.25).to(device)
    return kw


def decode_with_lse(case, ops, **kw):
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"), device=case.device)
    ops.decode_attention(*case.decode_args(out), **kw, lse=lse)
    torch.cuda.synchronize()
    return out, lse


def decode_reference(case, **kw):
    ref = torch.empty(case.query.shape, dtype=torch.float64)
    lse = torch.empty(case.query.shape[:2], dtype=torch.float64)
    kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    reference.decode_attention(*case._on_cpu_in_float64(case.decode_args(ref)), **kw, lse=lse)
    return ref, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["force_split=1,partition_size=64", "partition_size=-1", ""])
@pytest.mark.parametrize("group,variant", [
    (4, dict(softcap=2.0)), (4, dict(window_left=100)), (2, dict(sinks=True)), (16, dict(alibi=True)),
    (7, dict(softcap=3.0, window_left=300, sinks=True, alibi=True)),
    (32, dict(softcap=3.0, window_left=70, sinks=True, alibi=True))])
def test_decode_variants(device, split, group, variant):
    case = to_device(make_case([1, 63, 64, 65, 2000], num_heads=2 * group, num_kv_heads=2, head_size=128,
                               block_size=16, dtype=torch.bfloat16, seed=group), device)
    kw = variant_args(2 * group, device, seed=group, **variant)
    out, lse = decode_with_lse(case, configured(split), **kw)
    ref, ref_lse = decode_reference(case, **kw)
    assert_close(out, ref, case.dtype)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_attention_states(device, dtype):
    g = torch.Generator().manual_seed(0)
    po, so = (torch.randn(33, 4, 128, generator=g).to(dtype).to(device) for _ in range(2))
    a, b = (torch.randn(33, 4, generator=g).mul(5).to(device) for _ in range(2))
    a[0, 0] = float("-inf")
    b[1, 0] = float("-inf")
    out, out_lse = nan_like(po), torch.full_like(a, float("nan"))
    gpu().merge_attention_states(out, out_lse, po, a, so, b)
    torch.cuda.synchronize()
    ref, ref_lse = torch.empty(po.shape, dtype=torch.float64), torch.empty(a.shape, dtype=torch.float64)
    reference.merge_attention_states(ref, ref_lse, po.cpu(), a.cpu(), so.cpu(), b.cpu())
    assert_close(out, ref, dtype)
    assert_close(out_lse, ref_lse, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [4, 16])
def test_batch_invariant(device, group):
    # A row's out and lse are bitwise the same alone, in other batches (that split or not, under
    # configurations that change the plan outside the mode) and as rows of a chunked prefill.
    case = to_device(make_case([5, 3000, 1500, 40], q_lens=[1, 1, 7, 1], num_heads=2 * group, num_kv_heads=2,
                               head_size=128, block_size=16, dtype=torch.bfloat16, seed=group), device)
    kw = variant_args(2 * group, device, seed=1, softcap=3.0, window_left=1000, sinks=True, alibi=True)
    rows = [(s, n - q + i) for s, (n, q) in enumerate(zip([5, 3000, 1500, 40], [1, 1, 7, 1])) for i in range(q)]
    seq = torch.tensor([s for s, _ in rows], device=device)
    dec = dataclasses.replace(case, block_tables=case.block_tables[seq].contiguous(),
                              seq_lens=torch.tensor([p + 1 for _, p in rows], dtype=torch.int32, device=device),
                              cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32, device=device))
    want_out, want_lse = decode_with_lse(dec, gpu(), **kw, batch_invariant=True)
    ref, _ = decode_reference(dec, **kw)
    assert_close(want_out, ref, case.dtype)
    out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"), device=device)
    gpu().prefill_attention(*case.prefill_args(out), **kw, lse=lse, batch_invariant=True)
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for pick, split in (([4], ""), ([9, 4, 0], "force_split=1,partition_size=64"), ([4, 1], "partition_size=-1,threads=256")):
        idx = torch.tensor(pick, device=device)
        sub = dataclasses.replace(dec, query=dec.query[idx].contiguous(), block_tables=dec.block_tables[idx].contiguous(),
                                  seq_lens=dec.seq_lens[idx].contiguous(),
                                  cu_seqlens_q=torch.arange(len(pick) + 1, dtype=torch.int32, device=device))
        o, l = decode_with_lse(sub, configured(split), **kw, batch_invariant=True)  # noqa: E741
        assert torch.equal(o, want_out[idx]) and torch.equal(l, want_lse[idx]), pick


if not DEVICES:
    # No GPU: collect nothing (rather than a wall of "empty parameter set" skips that look like
    # coverage). The GPU numbers are owed until this file runs on a machine with one.
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]

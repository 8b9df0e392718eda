"""CUDA-graph safety of every op (issue #23 item 5), proven on the emulator: no host read of device
memory on the op path.

A CUDA graph replays kernels with whatever the device memory holds at replay; an op that reads a
device tensor on the host (a grid sized from seq_lens, a content check, ``.item()``) either syncs
(illegal while capturing) or bakes the capture-time values into the graph. On the emulator (backend
``cuda_emu``) every "device" tensor is host memory, so nothing would notice such a read; here the
tensors live in the emulator's device memory instead (``paged_cuda_emu_test.device_memory``:
page-aligned buffers, mprotect'ed PROT_NONE after ``close_device_memory(True)``, opened by the
emulator only while a kernel's blocks run or a device copy is made). The public layer sees that
memory as device memory and skips its content checks, exactly as for CUDA tensors. Any host read on
the op path is then a SIGSEGV, so every case runs in a child process (``python -m
tests.test_cuda_graph_safety CASE``) that must exit 0, with outputs equal to the float64 reference
(read after the memory is opened again).

Two controls show the check can fail: a host read of seq_lens before the op (what a launcher that
sized its grid from the lengths would do), and the public layer told that the device memory is host
memory (``device_memory_as_host(True)``: its content checks read seq_lens and the block table on the
host); both must die by SIGSEGV. With PAGED_OPS_CHECK=1 the content checks run through the
emulator's device-to-host copy (a cudaMemcpy's counterpart) and still reject a bad input.

What applies to swap_blocks: block_mapping is a CPU tensor by contract (host-known, read on the host
by design); the blocks move by the target's device copy (cudaMemcpyAsync; the emulator's device_copy),
so src and dst here are device memory and the mapping host memory. Only the dense-block layout is
run: other layouts fall back to torch's strided copy, a host memcpy on the emulator but a device
copy kernel on a GPU.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_bits_equal, assert_close, assert_lse_close, empty_cache, make_case, poison

REPO = Path(__file__).resolve().parents[1]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- the child: one case, its tensors in device memory -------------------------------------------

def emu_test_ops():
    return torch.ops.paged_cuda_emu_test


def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of t in the emulator's device memory: the same storage bytes (so poisoned unused
    cache slots stay poisoned) and the same sizes, strides and offset."""
    if t is None:
        return None
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    nbytes = storage.numel()
    buf = emu_test_ops().device_memory(max(nbytes, 1))[:nbytes]
    buf.copy_(storage)
    return buf.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def device_poisoned(shape, dtype) -> torch.Tensor:
    """An output buffer in device memory, NaN-filled (fp8: 0x7F bytes)."""
    return to_device(poison(torch.empty(shape, dtype=dtype)))


def case_to_device(case):
    return replace(case, **{f: to_device(getattr(case, f)) for f in
                            ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "cu_seqlens_q",
                             "k_scale", "v_scale")})


def variants_to_device(variants: dict) -> dict:
    return {k: to_device(v) if isinstance(v, torch.Tensor) else v for k, v in variants.items()}


def closed(run):
    """run() with device memory unreadable by the host outside kernels; open again afterwards."""
    emu_test_ops().close_device_memory(True)
    try:
        with paged_ops.use_backend("cuda_emu"):
            run()
    finally:
        emu_test_ops().close_device_memory(False)


def check_decode(case, **variants):
    """decode_attention on case (host tensors) with its tensors in closed device memory."""
    ref, ref_lse = case.reference_decode_lse(**variants)
    dev = case_to_device(case)
    out = device_poisoned(case.query.shape, case.dtype)
    lse = device_poisoned(case.query.shape[:2], F32)
    kw = variants_to_device(variants)
    closed(lambda: paged_ops.decode_attention(*dev.decode_args(out), lse=lse, **kw))
    assert_close(out, ref, case.dtype)
    assert_lse_close(lse, ref_lse, case.dtype)


def check_prefill(case, causal=True, **variants):
    ref, ref_lse = case.reference_prefill_lse(causal, **variants)
    dev = case_to_device(case)
    out = device_poisoned(case.query.shape, case.dtype)
    lse = device_poisoned(case.query.shape[:2], F32)
    args = dev.prefill_args(out, causal)  # max_seqlen_q: the host's number, taken while memory is open
    kw = variants_to_device(variants)
    closed(lambda: paged_ops.prefill_attention(*args, lse=lse, **kw))
    assert_close(out, ref, case.dtype)
    assert_lse_close(lse, ref_lse, case.dtype)


def split_kv_used(case) -> bool:
    """Whether the emulator's plan (132 SMs, csrc/kernels/plan.h) splits this decode: blocks
    (sequences x KV heads) under 2 per SM and a context over one 512-token partition."""
    max_ctx = case.block_tables.shape[1] * case.key_cache.shape[1]
    return case.num_seqs * case.key_cache.shape[2] < 2 * 132 and max_ctx > 512


CASES = {}
OPS_OF_CASE = {}


def child_case(*ops):
    """A case of the child, run by the parent in its own process; ops: the ops it runs."""
    def register(fn):
        CASES[fn.__name__] = fn
        OPS_OF_CASE[fn.__name__] = ops
        return fn
    return register


@child_case("decode_attention")
def decode_one_pass():
    check_decode(make_case([1, 17, 40, 33, 0], num_heads=4, num_kv_heads=2, head_size=64, dtype=F16, seed=1))


@child_case("decode_attention")
def decode_split_kv():
    # Long context, one sequence: the split-KV kernels and their reduce, workspace sized on the host.
    case = make_case([1500], num_heads=8, num_kv_heads=2, head_size=128, dtype=BF16, seed=2)
    assert split_kv_used(case)
    check_decode(case)


@child_case("decode_attention")
def decode_variants():
    case = make_case([30, 700], num_heads=4, num_kv_heads=1, head_size=64, dtype=F32, seed=3)
    g = torch.Generator().manual_seed(3)
    check_decode(case, softcap=5.0, window_left=200, sinks=torch.randn(4, generator=g),
                 alibi_slopes=torch.rand(4, generator=g) * 0.1)


@child_case("decode_attention")
def decode_fp8_cache_per_sequence_scales():
    check_decode(make_case([9, 50, 600], num_heads=4, num_kv_heads=2, head_size=64, dtype=F16, cache_dtype=E4M3,
                           scale_kind="seq", seed=4))


@child_case("decode_attention")
def decode_shared_kv_group_16():
    check_decode(make_case([70, 5], num_heads=16, num_kv_heads=1, head_size=64, dtype=F16, seed=5))


@child_case("decode_attention")
def decode_batch_invariant():
    check_decode(make_case([600, 3], num_heads=4, num_kv_heads=2, head_size=64, dtype=BF16, seed=6),
                 batch_invariant=True)


@child_case("prefill_attention")
def prefill_tensor_cores():
    check_prefill(make_case([40, 100, 0], q_lens=[40, 30, 0], num_heads=4, num_kv_heads=2, head_size=64,
                            dtype=F16, seed=7))


@child_case("prefill_attention")
def prefill_cuda_cores_fp8_non_causal_window():
    check_prefill(make_case([20, 75], q_lens=[20, 9], num_heads=4, num_kv_heads=2, head_size=64, dtype=F32,
                            cache_dtype=E5M2, scale_kind="head", seed=8),
                  causal=False, window_left=30, window_right=5)


@child_case("prefill_attention")
def prefill_batch_invariant():
    check_prefill(make_case([300, 12], q_lens=[6, 12], num_heads=4, num_kv_heads=2, head_size=64, dtype=BF16,
                            seed=9), batch_invariant=True)


@child_case("reshape_and_cache")
def reshape_and_cache():
    for cache_dtype, kind in ((F16, None), (E4M3, "head")):
        g = torch.Generator().manual_seed(10)
        num_blocks, block_size, heads, head_size, tokens = 6, 4, 2, 64, 9
        key = torch.randn(tokens, heads, head_size, generator=g).to(F16)
        value = torch.randn(tokens, heads, head_size, generator=g).to(F16)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
        slots[3] = -1  # a skipped token
        scales = ((torch.rand(heads, generator=g) + 0.5), (torch.rand(heads, generator=g) + 0.5)) if kind else (None,) * 2
        kc, vc = (empty_cache(num_blocks, block_size, heads, head_size, cache_dtype) for _ in range(2))
        want_k, want_v = kc.clone(), vc.clone()
        reference.reshape_and_cache(key, value, want_k, want_v, slots, *scales)
        d = [to_device(t) for t in (key, value, kc, vc, slots, *scales)]
        closed(lambda: paged_ops.reshape_and_cache(*d))
        assert_bits_equal(d[2], want_k, f"key_cache {cache_dtype}")
        assert_bits_equal(d[3], want_v, f"value_cache {cache_dtype}")


@child_case("concat_and_cache_mla")
def concat_and_cache_mla():
    for cache_dtype in (BF16, E4M3):
        g = torch.Generator().manual_seed(12)
        num_blocks, block_size, rank, rope_dim, tokens = 4, 16, 512, 64, 9
        latent = torch.randn(tokens, rank, generator=g).to(BF16)
        rope = torch.randn(tokens, rope_dim, generator=g).to(BF16)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
        slots[2] = -1  # a skipped token
        scale = torch.rand(1, generator=g) + 0.5 if cache_dtype == E4M3 else None
        cache = empty_cache(num_blocks, block_size, 1, rank + rope_dim, cache_dtype)
        want = cache.clone()
        reference.concat_and_cache_mla(latent, rope, want, slots, scale)
        d = [to_device(t) for t in (latent, rope, cache, slots, scale)]
        closed(lambda: paged_ops.concat_and_cache_mla(*d))
        assert_bits_equal(d[2], want, f"latent_cache {cache_dtype}")


@child_case("merge_attention_states")
def merge_attention_states():
    g = torch.Generator().manual_seed(11)
    tokens, heads, head_size = 5, 4, 64
    p_out, s_out = (torch.randn(tokens, heads, head_size, generator=g).to(BF16) for _ in range(2))
    p_lse, s_lse = (torch.randn(tokens, heads, generator=g) * 3 for _ in range(2))
    p_lse[0, 1] = -math.inf  # a prefix over no key
    want, want_lse = torch.empty(tokens, heads, head_size, dtype=torch.float64), torch.empty(tokens, heads,
                                                                                           dtype=torch.float64)
    reference.merge_attention_states(want, want_lse, p_out, p_lse, s_out, s_lse)
    out, out_lse = device_poisoned((tokens, heads, head_size), BF16), device_poisoned((tokens, heads), F32)
    d = [to_device(t) for t in (p_out, p_lse, s_out, s_lse)]
    closed(lambda: paged_ops.merge_attention_states(out, out_lse, *d))
    assert_close(out, want, BF16)
    assert_lse_close(out_lse, want_lse, BF16)


@child_case("merge_states")
def merge_states():
    g = torch.Generator().manual_seed(12)
    tokens, num_states, heads, head_size = 3, 5, 2, 128
    states = torch.randn(tokens, num_states, heads, head_size, generator=g).to(F16)
    states_lse = torch.randn(tokens, num_states, heads, generator=g) * 2
    states_lse[1, 2] = -math.inf
    want, want_lse = torch.empty(tokens, heads, head_size, dtype=torch.float64), torch.empty(tokens, heads,
                                                                                           dtype=torch.float64)
    reference.merge_states(want, want_lse, states, states_lse)
    out, out_lse = device_poisoned((tokens, heads, head_size), F16), device_poisoned((tokens, heads), F32)
    d = [to_device(t) for t in (states, states_lse)]
    closed(lambda: paged_ops.merge_states(out, out_lse, *d))
    assert_close(out, want, F16)
    assert_lse_close(out_lse, want_lse, F16)


@child_case("quantize_fp8", "dequantize_fp8")
def fp8_quantize_dequantize():
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(1000, generator=g) * 40).to(BF16)
    scale = torch.tensor([0.7])
    want = torch.empty(1000, dtype=E4M3)
    reference.quantize_fp8(want, x, scale)
    q = device_poisoned((1000,), E4M3)
    dx, dscale = to_device(x), to_device(scale)
    closed(lambda: paged_ops.quantize_fp8(q, dx, dscale))
    assert_bits_equal(q, want, "quantize_fp8")
    want_back = torch.empty(1000, dtype=F16)
    reference.dequantize_fp8(want_back, want, scale)
    back = device_poisoned((1000,), F16)
    closed(lambda: paged_ops.dequantize_fp8(back, q, dscale))
    assert_bits_equal(back, want_back, "dequantize_fp8")


def random_caches(n, dtype, g):
    caches = []
    for _ in range(n):
        c = empty_cache(8, 4, 2, 32, dtype)
        c.view(torch.uint8).copy_(torch.randint(0, 120, c.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        caches.append(c)
    return caches


@child_case("copy_blocks")
def copy_blocks():
    # The mapping on the device (a graph replays whatever it holds) and on the host (allowed).
    for mapping_on_device in (True, False):
        g = torch.Generator().manual_seed(14)
        kcs, vcs = random_caches(2, F16, g), random_caches(2, E4M3, g)
        mapping = torch.tensor([[0, 5], [2, 6], [0, 7]])
        want_k, want_v = [c.clone() for c in kcs], [c.clone() for c in vcs]
        reference.copy_blocks(want_k, want_v, mapping)
        dk, dv = [to_device(c) for c in kcs], [to_device(c) for c in vcs]
        dmap = to_device(mapping) if mapping_on_device else mapping
        closed(lambda: paged_ops.copy_blocks(dk, dv, dmap))
        for got, want in zip(dk + dv, want_k + want_v):
            assert_bits_equal(got, want, f"copy_blocks, mapping on the device: {mapping_on_device}")


@child_case("swap_blocks")
def swap_blocks():
    g = torch.Generator().manual_seed(15)
    (src,) = random_caches(1, BF16, g)
    dst = empty_cache(7, 4, 2, 32, BF16)
    mapping = torch.tensor([[1, 6], [4, 0], [5, 3]])  # on the CPU, as the contract says
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    dsrc, ddst = to_device(src), to_device(dst)
    closed(lambda: paged_ops.swap_blocks(dsrc, ddst, mapping))
    assert_bits_equal(ddst, want, "swap_blocks")


# Controls: each must die by SIGSEGV (CONTROLS), or pass (forced content checks).

def decode_control_case():
    case = make_case([12, 40], num_heads=4, num_kv_heads=2, head_size=64, dtype=F16, seed=16)
    return case_to_device(case), device_poisoned(case.query.shape, F16)


@child_case("decode_attention")
def control_host_read_of_seq_lens():
    dev, out = decode_control_case()

    def broken_op():  # what a launcher sizing its grid from the lengths would do first
        assert int(dev.seq_lens.max()) > 0
        paged_ops.decode_attention(*dev.decode_args(out))

    closed(broken_op)


@child_case("decode_attention")
def control_validation_reads_device_memory():
    dev, out = decode_control_case()
    emu_test_ops().device_memory_as_host(True)
    closed(lambda: paged_ops.decode_attention(*dev.decode_args(out)))


@child_case("decode_attention")
def forced_content_checks():
    """PAGED_OPS_CHECK=1 (set by the parent): the checks read device memory by a device copy, so a
    good call passes and a seq_len past the block table is rejected, with memory closed."""
    assert os.environ.get("PAGED_OPS_CHECK") == "1"
    case = make_case([12, 40], num_heads=4, num_kv_heads=2, head_size=64, dtype=F16, seed=17)
    check_decode(case)
    capacity = case.block_tables.shape[1] * case.key_cache.shape[1]
    bad = case_to_device(replace(case, seq_lens=torch.tensor([12, capacity + 1], dtype=torch.int32)))
    out = device_poisoned(case.query.shape, F16)
    errors = []

    def run():
        try:
            paged_ops.decode_attention(*bad.decode_args(out))
        except ValueError as e:
            errors.append(str(e))

    closed(run)
    assert errors and f"seq_lens max {capacity + 1} exceeds what block_tables covers" in errors[0], errors


def child_main(name: str) -> None:
    if "cuda_emu" not in paged_ops.available_backends():
        sys.exit("the cuda_emu backend is not built")
    CASES[name]()
    print(f"{name}: ok")


# ---- the parent: one child per case --------------------------------------------------------------

if __name__ != "__main__" and "cuda_emu" not in paged_ops.available_backends():  # built where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

CONTROLS = ("control_host_read_of_seq_lens", "control_validation_reads_device_memory")
OP_CASES = [n for n in CASES if n not in CONTROLS and n != "forced_content_checks"]


def run_child(name: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PAGED_OPS_CHECK", "PAGED_OPS_BACKEND")}
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "tests.test_cuda_graph_safety", name], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=600)


def outcome(p: subprocess.CompletedProcess) -> str:
    how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
    return f"{how}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


def test_every_op_has_a_case():
    covered = {op for name in OP_CASES for op in OPS_OF_CASE[name]}
    assert covered == set(paged_ops.OPS), set(paged_ops.OPS) ^ covered


@pytest.mark.parametrize("name", OP_CASES)
def test_op_reads_no_device_memory_on_the_host(name):
    p = run_child(name)
    assert p.returncode == 0, f"{name}: {outcome(p)}"
    assert f"{name}: ok" in p.stdout


@pytest.mark.parametrize("name", CONTROLS)
def test_a_host_read_of_device_memory_is_caught(name):
    p = run_child(name)
    assert p.returncode == -signal.SIGSEGV, f"{name} should die by SIGSEGV: {outcome(p)}"


def test_forced_content_checks_copy_from_the_device():
    p = run_child("forced_content_checks", PAGED_OPS_CHECK="1")
    assert p.returncode == 0, outcome(p)


# ---- the triton backend's launchers ----------------------------------------------------------------
# Their grids and splits come from shapes (decode: the block table's width; prefill: num_tokens +
# num_seqs tiles), never from tensor contents. copy_blocks built its table of cache addresses on the
# host and copied it to the device on every call (a pageable copy: a host sync, illegal in a capture);
# it is now built once per set of caches.

def copy_blocks_matches_reference(backend: str, kcs, vcs, mapping, what: str) -> None:
    """backend's copy_blocks on the caches equals the reference's, bit for bit."""
    want_k, want_v = [c.clone() for c in kcs], [c.clone() for c in vcs]
    reference.copy_blocks(want_k, want_v, mapping)
    paged_ops.backend(backend).copy_blocks(kcs, vcs, mapping)
    for got, want in zip(kcs + vcs, want_k + want_v):
        assert_bits_equal(got, want, what)


def test_triton_copy_blocks_builds_its_address_table_once():
    if "triton" not in paged_ops.available_backends():
        pytest.skip("the triton backend is not available")
    from paged_ops.triton import cache as triton_cache

    g = torch.Generator().manual_seed(18)
    kcs, vcs = random_caches(2, F16, g), random_caches(2, F16, g)
    triton_cache._address_table.cache_clear()
    for step, mapping in enumerate((torch.tensor([[0, 5], [2, 6]]), torch.tensor([[1, 7], [3, 4]]))):
        copy_blocks_matches_reference("triton", kcs, vcs, mapping, f"call {step}")
        info = triton_cache._address_table.cache_info()
        assert (info.misses, info.hits) == (1, step), f"call {step}: the table was built again ({info})"


# The C++ backends' copy_blocks uploaded the caches' descriptors on every call, through a pinned
# buffer: a captured graph would replay that copy after the buffer was reused. Now a set of caches
# is uploaded once (binding::descriptor_table); another set, or the same caches reallocated, is new.
def test_cuda_copy_blocks_uploads_descriptors_once_per_set_of_caches():
    ops = emu_test_ops()
    g = torch.Generator().manual_seed(19)
    kcs, vcs = random_caches(2, F16, g), random_caches(2, F16, g)
    before = ops.copy_blocks_descriptor_tables()
    for step, mapping in enumerate((torch.tensor([[0, 5], [2, 6]]), torch.tensor([[1, 7], [3, 4]]))):
        copy_blocks_matches_reference("cuda_emu", kcs, vcs, mapping, f"call {step}")
        if step == 0:
            # + 0 only if an earlier test had these very caches (same addresses and shapes)
            first = ops.copy_blocks_descriptor_tables()
            assert first - before in (0, 1)
        assert ops.copy_blocks_descriptor_tables() == first, f"call {step}: the descriptors were uploaded again"
    other_k, other_v = random_caches(2, F16, g), random_caches(2, F16, g)
    copy_blocks_matches_reference("cuda_emu", other_k, other_v, torch.tensor([[4, 1]]), "another set of caches")
    assert ops.copy_blocks_descriptor_tables() == first + 1


if __name__ == "__main__":
    child_main(sys.argv[1])

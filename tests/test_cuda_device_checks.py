"""GPU-only checks of the CUDA kernels that the CPU emulator cannot stand for (issue #11 item 5), run
by bench/device_check.sh next to tests/test_cuda_gpu.py (and under compute-sanitizer):

* odd cache views: a base one or three elements past an aligned address and rows one element
  wider than the head, so every vector load and cp.async must fall back to a narrower width
  (a wrong alignment decision faults on a GPU, not on the emulator);
* the tensor-core prefill at head sizes 8, 24, 136, 200 (zero-padded k-steps) and fp8 with head 24
  (24-byte fp8 rows: 8-byte staging copies);
* one real cache over 2^31 elements (head-major, as the contract allows): reads and writes past
  2^31 elements through every attention and cache op;
* the extreme-value cases of tests/test_cuda_extreme_values.py on the GPU kernels.

Collected only with a GPU (parametrized over the CUDA devices; nothing to run, or skip, without one).
"""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import FP8_DTYPES, assert_close, make_case, nan_like, poison

DEVICES = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def gpu():
    return paged_ops.backend("cuda")


def to_device(case, device):
    return case.to(device)  # paged_ops.testing.PagedCase.to


def odd_view(c: torch.Tensor, shift: int) -> torch.Tensor:
    """c's values in a view whose base is `shift` elements past an aligned address and whose rows are
    `shift` elements wider than the head (so no stride is a multiple of a vector either)."""
    buf = poison(torch.empty(c.shape[:-1] + (c.shape[-1] + shift,), dtype=c.dtype, device=c.device))
    view = buf[..., shift:]
    view.copy_(c)
    return view


def run_decode(case, ops=None):
    out = nan_like(case.query)
    (ops or gpu()).decode_attention(*case.decode_args(out))
    torch.cuda.synchronize()
    return out


def run_prefill(case, causal=True, config=None):
    out = nan_like(case.query)
    if config is None:
        gpu().prefill_attention(*case.prefill_args(out, causal))
    else:
        torch.ops.paged_cuda_test.prefill_attention_config(*case.prefill_args(out, causal), config)
    torch.cuda.synchronize()
    return out


TC, CUDA_CORES = [0, 0, 0, 0, 1], [0, 0, 0, 0, -1]  # LaunchConfig [threads, partition_size, kv_tile, force_split, tensor_cores]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, None), (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float32, None)])
def test_odd_cache_views(device, shift, dtype, cache_dtype):
    for group in (2, 16):  # decode_kernel and the shared-KV (cp.async) kernel
        case = make_case([1, 33, 70], q_lens=[1, 9, 70], num_heads=2 * group, num_kv_heads=2, head_size=64,
                         block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=group + shift)
        case = to_device(case, device)
        case.key_cache, case.value_cache = odd_view(case.key_cache, shift), odd_view(case.value_cache, shift)
        decode = make_case([1, 33, 70], num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=16,
                           dtype=dtype, cache_dtype=cache_dtype, seed=group + shift)
        decode = to_device(decode, device)
        decode.key_cache, decode.value_cache = odd_view(decode.key_cache, shift), odd_view(decode.value_cache, shift)
        assert_close(run_decode(decode), decode.reference_prefill(), dtype)
        for config in (TC, CUDA_CORES):
            assert_close(run_prefill(case, config=config), case.reference_prefill(), dtype)
    # reshape_and_cache into an odd view: the written rows read back as the reference writes them
    kc = odd_view(poison(torch.empty(6, 16, 2, 64, dtype=cache_dtype or dtype, device=device)), shift)
    vc = odd_view(poison(torch.empty(6, 16, 2, 64, dtype=cache_dtype or dtype, device=device)), shift)
    k, v = torch.randn(20, 2, 64).to(dtype), torch.randn(20, 2, 64).to(dtype)
    slots = torch.randperm(96)[:20]
    scale = torch.tensor([0.03]) if cache_dtype else None
    rk, rv = kc.cpu().clone(), vc.cpu().clone()
    reference.reshape_and_cache(k, v, rk, rv, slots, scale, scale)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    gpu().reshape_and_cache(k.to(device), v.to(device), kc, vc, slots.to(device), dev(scale), dev(scale))
    torch.cuda.synchronize()
    for got, want in ((kc, rk), (vc, rv)):
        assert torch.equal(got.cpu().view(torch.uint8 if got.element_size() == 1 else torch.int16),
                           want.view(torch.uint8 if want.element_size() == 1 else torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [8, 24, 136, 200])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_tensor_cores_head_sizes(device, head_size, dtype):
    case = to_device(make_case([7, 90], q_lens=[7, 70], num_heads=6, num_kv_heads=2, head_size=head_size,
                               block_size=16, dtype=dtype, seed=head_size), device)
    for causal in (True, False):
        assert_close(run_prefill(case, causal, TC), case.reference_prefill(causal), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_fp8_head_24(device, cache_dtype):
    for group in (2, 16):
        case = to_device(make_case([1, 40, 129], num_heads=2 * group, num_kv_heads=2, head_size=24, block_size=16,
                                   dtype=torch.float16, cache_dtype=cache_dtype, scale_kind="head", seed=group),
                         device)
        assert_close(run_decode(case), case.reference_prefill(), torch.float16)
        pcase = to_device(make_case([40, 129], q_lens=[40, 20], num_heads=2 * group, num_kv_heads=2, head_size=24,
                                    block_size=16, dtype=torch.float16, cache_dtype=cache_dtype, seed=group), device)
        for config in (TC, CUDA_CORES):
            assert_close(run_prefill(pcase, config=config), pcase.reference_prefill(), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_cache_over_2_31_elements(device):
    # Head-major fp16 caches [kv_heads, num_blocks, block_size, head_size] seen through the contract's
    # [num_blocks, block_size, kv_heads, head_size] view: 2.68e9 elements (5.4 GB) each. The live
    # blocks are the last ones, so KV heads 2 and 3 sit past 2^31 elements.
    kv_heads, bs, D, nb = 4, 16, 128, 327680
    kc = torch.empty(kv_heads, nb, bs, D, dtype=torch.float16, device=device).permute(1, 2, 0, 3)
    vc = torch.empty(kv_heads, nb, bs, D, dtype=torch.float16, device=device).permute(1, 2, 0, 3)
    assert kc.storage_offset() == 0 and (kv_heads - 1) * kc.stride(2) + (nb - 1) * kc.stride(0) > 2**31
    seq_lens, q_lens = [40, 70], [40, 9]
    live = torch.arange(nb - 8, nb)  # 8 blocks, used in reverse order: 3 for 40 tokens, 5 for 70
    r = live.flip(0)
    block_tables = torch.stack([torch.cat([r[:3], r[:2]]), r[3:]]).to(torch.int32)  # unused entries: live ids
    g = torch.Generator().manual_seed(7)
    k = torch.randn(sum(seq_lens), kv_heads, D, generator=g).half()
    v = torch.randn(sum(seq_lens), kv_heads, D, generator=g).half()
    slots = torch.cat([block_tables[s, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for s, n in enumerate(seq_lens)])
    gpu().reshape_and_cache(k.to(device), v.to(device), kc, vc, slots.to(device), None, None)
    # The same batch on small CPU caches holding only the live blocks (ids remapped to 0..7).
    remap = {int(b): i for i, b in enumerate(live)}
    small_bt = block_tables.clone().apply_(lambda b: remap[b])
    small_k = torch.zeros(8, bs, kv_heads, D, dtype=torch.float16)
    small_v = torch.zeros(8, bs, kv_heads, D, dtype=torch.float16)
    small_slots = torch.tensor([remap[int(s) // bs] * bs + int(s) % bs for s in slots])
    reference.reshape_and_cache(k, v, small_k, small_v, small_slots, None, None)
    torch.cuda.synchronize()
    assert torch.equal(kc[live].cpu(), small_k) and torch.equal(vc[live].cpu(), small_v)
    # copy_blocks within the big cache, then back: the block holds the same bytes
    gpu().copy_blocks([kc], [vc], torch.tensor([[int(live[0]), nb - 20]], device=device))
    torch.cuda.synchronize()
    assert torch.equal(kc[nb - 20].cpu(), small_k[0]) and torch.equal(vc[nb - 20].cpu(), small_v[0])

    num_heads = 16
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, D, generator=g).half()
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ref = torch.empty(q.shape, dtype=torch.float64)
    reference.prefill_attention(ref, q.double(), small_k, small_v, small_bt, cu, sl, max(q_lens), D ** -0.5, True,
                                None, None)
    for config in (TC, CUDA_CORES):
        out = torch.full_like(q, float("nan"), device=device)
        torch.ops.paged_cuda_test.prefill_attention_config(out, q.to(device), kc, vc, block_tables.to(device),
                                                           cu.to(device), sl.to(device), max(q_lens), D ** -0.5,
                                                           True, None, None, config)
        torch.cuda.synchronize()
        assert_close(out, ref, torch.float16)
    # decode: the last query token of each sequence
    qd = q[cu[1:] - 1]
    refd = ref[cu[1:] - 1]
    for config in ([0, 0, 0, 0, 0], [0, 16, 0, 1, 0]):  # one pass, forced split-KV
        out = torch.full_like(qd, float("nan"), device=device)
        torch.ops.paged_cuda_test.decode_attention_config(out, qd.to(device), kc, vc, block_tables.to(device),
                                                          sl.to(device), D ** -0.5, None, None, config)
        torch.cuda.synchronize()
        assert_close(out, refd, torch.float16)


# ---- small cases for compute-sanitizer racecheck / synccheck (bench/device_check.sh: -k sanitize) ----
# The two kernels that stage through shared memory between barriers: the shared-KV decode
# (cp.async double buffer; one-pass and split-KV, chunks that straddle partitions) and the
# tensor-core prefill (several row tiles and KV tiles per block).

@pytest.mark.parametrize("device", DEVICES)
def test_sanitize_shared_kv_decode(device):
    case = to_device(make_case([1, 63, 64, 65, 129], num_heads=32, num_kv_heads=2, head_size=128, block_size=16,
                               dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn, scale_kind="head", seed=4),
                     device)
    ref = case.reference_prefill()
    for config in ([0, 0, 0, 0, 0], [256, 48, 7, 1, 0], [64, -1, 5, 0, 0]):
        out = nan_like(case.query)
        torch.ops.paged_cuda_test.decode_attention_config(*case.decode_args(out), config)
        torch.cuda.synchronize()
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_sanitize_tensor_core_prefill(device):
    case = to_device(make_case([150, 40], q_lens=[100, 40], num_heads=8, num_kv_heads=2, head_size=72,
                               block_size=16, dtype=torch.float16, seed=6), device)
    out = nan_like(case.query)
    args = list(case.prefill_args(out))
    args[7] = 30  # a short max_seqlen_q hint: blocks loop over several row tiles
    torch.ops.paged_cuda_test.prefill_attention_config(*args, TC)
    torch.cuda.synchronize()
    assert_close(out, case.reference_prefill(), torch.float16)


# ---- the extreme-value cases of tests/test_cuda_extreme_values.py on the GPU kernels -------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype,k_scale", [(torch.float8_e5m2, 2.0), (torch.float8_e4m3fn, 300.0)])
def test_prefill_tensor_cores_fp8_beyond_fp16_range(device, cache_dtype, k_scale):
    seq_lens, bs, mag = [70, 33], 16, 1.0e5
    case = make_case(seq_lens, q_lens=[70, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=bs,
                     dtype=torch.float16, cache_dtype=cache_dtype, seed=3)
    g = torch.Generator().manual_seed(0)
    case.k_scale = case.v_scale = torch.tensor([k_scale])
    for s, n in enumerate(seq_lens):
        slots = case.block_tables[s, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        reference.reshape_and_cache((torch.randn(n, 2, 64, generator=g) * mag).half(),
                                    (torch.randn(n, 2, 64, generator=g) * mag / 8).half(),
                                    case.key_cache, case.value_cache, slots, case.k_scale, case.v_scale)
    case.scale = 0.1 / mag
    case = to_device(case, device)
    assert_close(run_prefill(case, config=TC), case.reference_prefill(), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [TC, CUDA_CORES])
@pytest.mark.parametrize("max_seqlen_q", [1, 2**32 + 1])
def test_prefill_every_row_whatever_max_seqlen_q(device, config, max_seqlen_q):
    case = to_device(make_case([90, 40, 3], q_lens=[90, 1, 3], num_heads=8, num_kv_heads=2, head_size=64,
                               block_size=16, dtype=torch.float16, seed=11), device)
    out = nan_like(case.query)
    args = list(case.prefill_args(out))
    args[7] = max_seqlen_q
    torch.ops.paged_cuda_test.prefill_attention_config(*args, config)
    torch.cuda.synchronize()
    assert_close(out, case.reference_prefill(), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,config", [(torch.float32, CUDA_CORES), (torch.float16, TC)])
def test_prefill_nan_query_row(device, dtype, config):
    case = make_case([40, 20], q_lens=[40, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=5)
    case.query[3, 1, :] = float("nan")
    case.query[45, 2, 7] = float("inf")
    case = to_device(case, device)
    out = run_prefill(case, config=config).cpu()
    ref = case.reference_prefill()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close(out[~torch.isnan(ref)], ref[~torch.isnan(ref)], dtype)


if not DEVICES:
    # No GPU: collect nothing (see tests/test_cuda_gpu.py).
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]

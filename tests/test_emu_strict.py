"""The strict CUDA emulator (csrc/emu/cuda_emu.h, issue #11 item 2): each rule a GPU enforces and
x86 does not, checked against NVIDIA's documents (PTX ISA, CUDA C++ Programming Guide), and each
shown to catch a kernel that breaks it (torch.ops.paged_cuda_emu_test.strict runs tiny rule-
breaking kernels, csrc/cuda_emu/selftest.cpp).

  * alignment: every pointer a kernel makes with reinterpret_cast is checked against the alignment
    of the type it points to (uint4/float4/int4: 16, float2/uint2: 8, __half2/bf162/float: 4);
    every cp.async has a size of 4, 8 or 16 (.cg: 16 only) and both addresses aligned to it;
  * cp.async is asynchronous: the destination is NaN from issue until the wait_group / wait_all
    that covers its commit group; a thread exiting with copies in flight, or reaching a barrier
    with copies not committed, is an error;
  * fiber order: the fibers of a block run in a seeded random order between synchronisation
    points by default (CUDA_EMU_SCHEDULE / set_schedule: forward, reverse, random[:seed]), so a
    missing __syncthreads changes results;
  * a launch over 48 KB of dynamic shared memory without cudaFuncSetAttribute on that kernel, or
    with more threads than its __launch_bounds__, is rejected;
  * mma.m16n8k16: registers built from the PTX ISA's fragment formulas, not the kernels' loaders;
  * thread-block clusters (sm_90): a launch is a whole number of clusters of at most 8 blocks (16
    with the kernel's non-portable attribute); a cluster's blocks run at once, one turn each between
    cluster barriers in the schedule's order; map_shared_rank only after the first barrier.cluster,
    only into a block that has not exited (whose shared memory turns to NaN when it does), and
    every thread of every block reaches every cluster barrier.
"""
from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import paged_ops
from paged_ops.testing import assert_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

selftest = torch.ops.paged_cuda_emu_test
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def schedule():
    """schedule("reverse") forces a fiber order for the following launches; reset afterwards."""
    yield selftest.set_schedule
    selftest.set_schedule("")


# ---- alignment -----------------------------------------------------------------------------------
MISALIGNED = ["uint4_load_off2", "float4_load_off4", "float2_load_off4", "int4_load_off8", "uint2_load_off4",
              "half2_load_off2", "bf162_load_off2", "float_load_off2", "uint4_store_off8", "float2_store_off4"]


@pytest.mark.parametrize("case", MISALIGNED)
def test_misaligned_vector_access_raises(case):
    with pytest.raises(RuntimeError, match="misaligned address"):
        selftest.strict(case)


def test_aligned_vector_accesses_pass():
    selftest.strict("vectors_aligned")


def misaligned_views(case):
    # Each cache as a view one element past the start of a wider buffer: a base address that is
    # 2-byte (16-bit), 4-byte (fp32) or 1-byte (fp8) aligned only, as a sliced cache may be.
    for name in ("key_cache", "value_cache"):
        c = getattr(case, name)
        wide = torch.empty(c.shape[:-1] + (c.shape[-1] + 1,), dtype=c.dtype)[..., 1:]
        wide.copy_(c)
        setattr(case, name, wide)
    return case


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, None), (torch.float32, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("op", ["decode", "prefill", "prefill_cuda_cores"])
def test_kernels_on_misaligned_cache_views(op, dtype, cache_dtype):
    # The kernels must fall back to scalar loads on such views: a vector load there faults on a
    # GPU, and on the strict emulator (forcing their vector path makes these fail with
    # "misaligned address").
    emu = paged_ops.backend("cuda_emu")
    q_lens = [1, 1, 1] if op == "decode" else [5, 3, 40]
    case = misaligned_views(make_case([5, 17, 40], q_lens=q_lens, num_heads=4, num_kv_heads=2, head_size=64,
                                      block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=5))
    out = nan_like(case.query)
    if op == "decode":
        emu.decode_attention(*case.decode_args(out))
    elif op == "prefill":
        emu.prefill_attention(*case.prefill_args(out))
    else:  # launch config: threads, partition, kv_tile, force_split, tc = -1 (CUDA cores)
        torch.ops.paged_cuda_emu_test.prefill_attention_config(*case.prefill_args(out), [0, 0, 0, 0, -1])
    assert_close(out, case.reference_prefill(), dtype)


@pytest.mark.parametrize("case,message", [
    ("cp_async_src_off1", "misaligned address: cp.async.cg source"),
    ("cp_async_src_off8", "misaligned address: cp.async.cg source"),
    ("cp_async_dst_off4", "misaligned address: cp.async.cg destination"),
    ("cp_async_8_off4", "misaligned address: cp.async.ca source"),
    ("cp_async_4_off2", "misaligned address: cp.async.ca source"),
    ("cp_async_size_2", "cp-size must be 4, 8 or 16"),
    ("cp_async_size_12", "cp-size must be 4, 8 or 16"),
    ("cp_async_cg_8", r"\.cg copies exactly 16 B"),
    ("cp_async_zfill_past_cp_size", "src-size 20 > cp-size 16"),
])
def test_cp_async_rules(case, message):
    with pytest.raises(RuntimeError, match=message):
        selftest.strict(case)


# ---- asynchronous cp.async -----------------------------------------------------------------------
SRC = torch.arange(1024, dtype=torch.float32) + 0.25  # what selftest.strict's cp.async kernels copy
THREADS = 32


def test_cp_async_waited_copies_arrive():
    out = selftest.strict("cp_async_ok")[: 4 * THREADS].view(THREADS, 4)
    # thread t reads the row of thread t + 1 after wait_group 0 + __syncthreads
    assert torch.equal(out, SRC[: 4 * THREADS].view(THREADS, 4).roll(-1, 0))
    selftest.strict("cp_async_ca_sizes_ok")


def test_cp_async_read_before_wait_sees_nan():
    out = selftest.strict("cp_async_no_wait")[: 4 * THREADS]
    assert torch.isnan(out).all()


def test_cp_async_wait_group_leaves_most_recent_groups_pending():
    out = selftest.strict("cp_async_wait_too_loose")[: 8 * THREADS]
    assert torch.equal(out[: 4 * THREADS], SRC[: 4 * THREADS])  # the older group: complete
    assert torch.isnan(out[4 * THREADS:]).all()                  # the most recent: still in flight


def test_cp_async_committed_group_may_cross_a_barrier():
    # Double buffering keeps the next tile in flight across __syncthreads; legal, data after the wait.
    out = selftest.strict("cp_async_pipelined")[: 4 * THREADS].view(THREADS, 4)
    assert torch.equal(out, SRC[: 4 * THREADS].view(THREADS, 4).roll(-1, 0))


def test_cp_async_wait_all_commits_first():
    out = selftest.strict("cp_async_wait_all")[: 4 * THREADS]
    assert torch.equal(out, SRC[: 4 * THREADS])


def test_cp_async_src_size_zero_fills_the_rest():
    # PTX's src-size: the first src-size bytes from the source, zeros after them (the pipelined
    # prefill's padding rows and columns: prefill.cuh copy_row).
    out = selftest.strict("cp_async_zfill")[: 4 * THREADS].view(THREADS, 4)
    want = SRC[: 4 * THREADS].view(THREADS, 4).clone()
    want[0::3] = 0
    want[1::3, 2:] = 0
    assert torch.equal(out, want)


@pytest.mark.parametrize("case,message", [
    ("cp_async_exit_pending", "exited with .* cp.async copies it never waited for"),
    ("cp_async_barrier_uncommitted", "__syncthreads reached with cp.async copies not committed"),
])
def test_cp_async_unwaited_copies_raise(case, message):
    with pytest.raises(RuntimeError, match=message):
        selftest.strict(case)


# ---- fiber order ---------------------------------------------------------------------------------
EXPECTED_SUM = 128 * 129 / 2  # sum_last_kernel: 1 + ... + 128 per block


def test_missing_barrier_hidden_in_program_order(schedule):
    # The old emulator's blind spot: in program order the last thread runs after every write.
    schedule("forward")
    assert (selftest.strict("missing_barrier")[:8] == EXPECTED_SUM).all()


@pytest.mark.parametrize("mode", ["reverse", "random", "random:1", "random:2", "random:12345"])
def test_missing_barrier_caught_out_of_order(schedule, mode):
    schedule(mode)
    sums = selftest.strict("missing_barrier")[:8]
    assert not (sums == EXPECTED_SUM).all(), f"{mode}: a missing __syncthreads went unnoticed"
    assert (selftest.strict("with_barrier")[:8] == EXPECTED_SUM).all()


def test_schedule_from_environment():
    # The default (random, seed 0) and CUDA_EMU_SCHEDULE, read at every launch.
    code = ("import torch, paged_ops; s = torch.ops.paged_cuda_emu_test; "
            "print(bool((s.strict('missing_barrier')[:8] == 8256).all()))")
    run = lambda env: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                     env={**os.environ, **env}, check=True).stdout.split()[-1]
    assert run({"CUDA_EMU_SCHEDULE": "forward"}) == "True"
    assert run({"CUDA_EMU_SCHEDULE": "reverse"}) == "False"
    assert run({"CUDA_EMU_SCHEDULE": ""}) == "False"  # default: random


def test_bad_schedule_name_raises(schedule):
    with pytest.raises(RuntimeError, match="not forward, reverse or random"):
        schedule("sideways")


@pytest.mark.parametrize("mode", ["forward", "reverse", "random", "random:3"])
def test_multi_tile_kernels_in_every_fiber_order(schedule, mode):
    # Sequences spanning several KV tiles and row tiles, so that every barrier between staging a
    # tile and reading it (and between reading it and staging the next) matters: tensor-core and
    # CUDA-core prefill, shared-KV decode (cp.async double buffering, group 16). Dropping the
    # tensor-core prefill's "previous KV tile is no longer read" barrier gives a relative error
    # of ~0.4 here in random order (~0.04 in program order); the suite's short cases miss it.
    schedule(mode)
    emu = paged_ops.backend("cuda_emu")
    lens = [150, 70, 33]
    for dtype in (torch.float16, torch.float32):
        case = make_case(lens, q_lens=lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                         seed=11)
        out = nan_like(case.query)
        emu.prefill_attention(*case.prefill_args(out))
        assert_close(out, case.reference_prefill(), dtype)
    case = make_case([150, 70, 33, 1], num_heads=32, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.bfloat16, seed=12)
    out = nan_like(case.query)
    emu.decode_attention(*case.decode_args(out))
    assert_close(out, case.reference_prefill(), torch.bfloat16)


# The real kernels in reverse and in other random orders than the suite's default (random:0):
# one case of each kernel family and barrier structure (one-pass / split-KV / shared-KV decode with
# cp.async double buffering, CUDA-core and tensor-core prefill, cache kernels).
KERNEL_SUBSET = ("test_decode_split_kv or test_decode_large_group_configs or test_prefill_launch_configs "
                 "or test_decode_one_pass_forced or test_prefill_fp8 or test_reshape_and_cache_strided_key "
                 "or test_copy_blocks or test_quantize_dequantize or test_emu_mma_matches_matmul "
                 "or (test_prefill and default)")


@pytest.mark.parametrize("mode", ["reverse", "random:7"])
def test_kernels_pass_in_other_fiber_orders(mode):
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "tests/test_cuda_emu.py", "-k", KERNEL_SUBSET],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "CUDA_EMU_SCHEDULE": mode})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert re.search(r"\d+ passed", res.stdout), res.stdout[-2000:]


# ---- dynamic shared memory opt-in, launch bounds -------------------------------------------------
def test_dynamic_smem_over_48k_needs_the_kernels_opt_in():
    selftest.strict("smem_48k_no_optin")  # the default limit: 48 KB
    selftest.strict("smem_64k_optin")
    for case in ("smem_64k_no_optin", "smem_64k_optin_other_kernel", "smem_64k_optin_too_small"):
        with pytest.raises(RuntimeError, match="cudaFuncAttributeMaxDynamicSharedMemorySize"):
            selftest.strict(case)
    selftest.strict("smem_optin_over_limit")  # cudaFuncSetAttribute itself refuses > 227 KB


def test_launch_over_launch_bounds_raises():
    selftest.strict("bounds_ok")
    with pytest.raises(RuntimeError, match=r"over the kernel's __launch_bounds__\(64\)"):
        selftest.strict("bounds_over")


def test_every_kernel_restates_its_launch_bounds():
    # The emulator sees __launch_bounds__ only through PAGED_LAUNCH_BOUNDS_CHECK(n), the first
    # statement of each kernel; it must be there and carry the same n.
    kernels = 0
    for path in sorted((ROOT / "csrc" / "kernels").glob("*.cuh")):
        src = path.read_text()
        for m in re.finditer(r"__global__\s+void\s+__launch_bounds__\(([^)]*)\)\s+(\w+)\s*\(", src):
            kernels += 1
            body = src[src.index("{", m.end()) + 1:]
            first = body.strip().split(";", 1)[0]
            # the first argument, the most threads a launch may have; a second (min blocks per
            # SM) only steers the register allocation and never fails a launch
            max_threads = m.group(1).split(",")[0].strip()
            assert first == f"PAGED_LAUNCH_BOUNDS_CHECK({max_threads})", (path.name, m.group(2), first)
        unbounded = re.findall(r"__global__\s+void\s+(?!__launch_bounds__)(\w+)\s*\(", src)
        assert not unbounded, f"{path.name}: kernels without __launch_bounds__: {unbounded}"
    assert kernels >= 9


# ---- mma.m16n8k16 against the PTX ISA fragment formulas --------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_ptx_fragments(dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(16, 16, generator=g).to(dtype)
    b = torch.randn(16, 8, generator=g).to(dtype)
    d, regs = selftest.mma_ptx(a, b, 0)
    ref = a.double() @ b.double()
    # fp32 accumulation of 16 exact products: far inside 1e-5 relative
    assert (d.double() - ref).norm() <= 1e-6 * ref.norm()
    # the kernels' loaders (A; B from [k][n] and from [n][k]) give the ISA's registers, bit for bit
    assert torch.equal(regs[:, 1], regs[:, 0]), "load_a_frag / load_b_frag_kn differ from the PTX ISA layout"
    assert torch.equal(regs[:, 2], regs[:, 0]), "load_a_frag / load_b_frag_nk differ from the PTX ISA layout"


@pytest.mark.parametrize("mutation", [1, 2])
def test_mma_ptx_check_catches_a_wrong_layout(mutation):
    # The same comparison with the ISA side broken on purpose (A rows / B k-halves swapped) fails.
    g = torch.Generator().manual_seed(4)
    a = torch.randn(16, 16, generator=g).half()
    b = torch.randn(16, 8, generator=g).half()
    d, regs = selftest.mma_ptx(a, b, mutation)
    ref = a.double() @ b.double()
    assert (d.double() - ref).norm() > 0.1 * ref.norm()
    assert not torch.equal(regs[:, 1], regs[:, 0])
    assert math.isfinite(float(d.sum()))


# ---- thread-block clusters -----------------------------------------------------------------------
CLUSTER_THREADS = 64  # selftest.cluster's block


def ring_expected(grid, cluster):
    """cluster_ring_kernel's output: each block reads its right neighbour's (rank + 1 mod the
    cluster's size, ranks x-fastest within the cluster, PTX %cluster_ctarank) values, flat x 1000 + t."""
    gx, gy, gz = grid
    cx, cy, cz = cluster if any(cluster) else (1, 1, 1)
    n = cx * cy * cz
    out = torch.empty(gx * gy * gz, CLUSTER_THREADS)
    for bz in range(gz):
        for by in range(gy):
            for bx in range(gx):
                rank = bx % cx + cx * (by % cy + cy * (bz % cz))
                r = (rank + 1) % n
                nx, ny, nz = bx - bx % cx + r % cx, by - by % cy + (r // cx) % cy, bz - bz % cz + r // (cx * cy)
                out[bx + gx * (by + gy * bz)] = (nx + gx * (ny + gy * nz)) * 1000 + torch.arange(CLUSTER_THREADS)
    return out.flatten()


CLUSTER_SHAPES = [([4, 1, 1], [2, 1, 1]), ([4, 2, 2], [2, 2, 1]), ([8, 2, 1], [8, 1, 1]), ([2, 3, 4], [1, 1, 2])]


@pytest.mark.parametrize("mode", ["forward", "reverse", "random", "random:7"])
@pytest.mark.parametrize("grid,cluster", CLUSTER_SHAPES)
def test_cluster_blocks_read_each_other_shared_memory(schedule, mode, grid, cluster):
    schedule(mode)
    out = selftest.cluster("ok", grid, cluster, False)
    assert torch.equal(out, ring_expected(grid, cluster))


def test_launch_without_clusters_is_a_cluster_of_one():
    out = selftest.cluster("ok", [3, 2, 1], [0, 0, 0], False)
    assert torch.equal(out, ring_expected([3, 2, 1], [0, 0, 0]))


def test_sixteen_block_clusters_need_the_non_portable_attribute():
    with pytest.raises(RuntimeError, match="over the portable 8"):
        selftest.cluster("ok", [16, 1, 1], [16, 1, 1], False)
    assert torch.equal(selftest.cluster("ok", [16, 1, 1], [16, 1, 1], True), ring_expected([16, 1, 1], [16, 1, 1]))
    with pytest.raises(RuntimeError, match="over 16"):
        selftest.cluster("ok", [32, 1, 1], [32, 1, 1], True)


@pytest.mark.parametrize("grid,cluster", [([3, 1, 1], [2, 1, 1]), ([4, 3, 1], [1, 2, 1]), ([4, 1, 1], [0, 1, 1])])
def test_cluster_launch_shape_rules(grid, cluster):
    with pytest.raises(RuntimeError, match="invalid cluster launch"):
        selftest.cluster("ok", grid, cluster, False)


CLUSTER_MISUSE = [
    ("no_first_sync", "before the cluster's first barrier.cluster"),
    ("no_last_sync", "has exited: its shared memory is gone"),
    ("rank_exits", "exited while the others wait at barrier.cluster"),
    ("thread_exits", r"barrier.cluster reached after 1 thread|thread exited while \d+ thread\(s\) of its block wait"),
    ("map_global", "outside this block's dynamic shared memory"),
    ("map_rank_over", "map_shared_rank to rank 4 of a cluster of 4"),
]


@pytest.mark.parametrize("mode", ["forward", "reverse", "random"])
@pytest.mark.parametrize("case,message", CLUSTER_MISUSE)
def test_cluster_rules_broken_raise(schedule, mode, case, message):
    schedule(mode)
    with pytest.raises(RuntimeError, match=message if "|" in message else re.escape(message)):
        selftest.cluster(case, [8, 1, 1], [4, 1, 1], False)


@pytest.mark.parametrize("mode", ["forward", "reverse", "random", "random:3"])
def test_cluster_read_after_the_last_barrier_sees_nan(schedule, mode):
    # A block reading its neighbour's shared memory after the last cluster barrier may find it gone
    # (the guide: a block must not exit while others access its shared memory). The block whose turn
    # comes last in that round always does: every other block has exited before it reads.
    schedule(mode)
    out = selftest.cluster("read_after_last_sync", [8, 1, 1], [4, 1, 1], False).view(8, CLUSTER_THREADS)
    stale = out.isnan().all(dim=1)
    assert int(stale.sum()) >= 2, "one block a cluster reads a neighbour that has exited"
    good = ~out.isnan().any(dim=1)
    assert torch.equal(out[good], ring_expected([8, 1, 1], [4, 1, 1]).view(8, CLUSTER_THREADS)[good])


@pytest.mark.parametrize("mode", ["forward", "reverse", "random", "random:5"])
def test_missing_cluster_barrier_between_write_and_remote_read(schedule, mode):
    # Values written after one barrier.cluster and read by the neighbour before the next: in every
    # turn order some block runs before its right neighbour has written, and reads the NaN its
    # shared memory starts with. With the barrier between, every block reads them.
    schedule(mode)
    racy = selftest.cluster("write_after_sync", [8, 1, 1], [4, 1, 1], False).view(8, CLUSTER_THREADS)
    assert bool(racy.isnan().all(dim=1).any()), f"{mode}: a missing barrier.cluster went unnoticed"
    synced = selftest.cluster("write_sync_read", [8, 1, 1], [4, 1, 1], False)
    assert torch.equal(synced, ring_expected([8, 1, 1], [4, 1, 1]))

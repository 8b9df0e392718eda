"""The emulator's ldmatrix (csrc/emu/cuda_emu.h, issue #23 item 4), checked against the PTX ISA's
definition ("Warp-level matrix load instruction: ldmatrix"), not against the kernels that use it:

  * the fragment: lane i receives row i / 4, elements 2 (i % 4) and 2 (i % 4) + 1 of each matrix
    (lower index in the low half), matrix m in register m; .trans the same of the transposed matrix;
    lanes 0-7 / 0-15 / 0-31 supply the row addresses of .x1 / .x2 / .x4;
  * each rule shown to catch a broken kernel (torch.ops.paged_cuda_emu_test.ldmatrix runs a
    one-warp kernel with one lane doing one thing wrong): a misaligned row address, a row outside
    shared memory, a lane executing another shape or the other .trans, a lane that exited, a read
    of rows whose cp.async is still in flight (no wait, a wait_group too loose);
  * multi-stage cp.async groups (wait_group N > 0): exactly the N most recent groups stay in flight;
  * .trans vs plain swapped in a P V product: the numbers are wrong (caught by comparing with a matmul);
  * bank conflicts are counted per 8x8 matrix: an unswizzled 128-byte pitch costs 7 extra wavefronts
    per matrix, the XOR swizzle and a 144-byte pitch none; the tensor-core prefill kernel's ldmatrix
    reads are conflict-free.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops
from paged_ops.testing import assert_close, make_case, nan_like

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

selftest = torch.ops.paged_cuda_emu_test

# selftest_ldmatrix.cpp's enums
FILL_STORE, FILL_ASYNC, FILL_ASYNC_NO_WAIT, FILL_ASYNC_STAGES = 0, 1, 2, 3
NONE, MISALIGNED, OUTSIDE, SHAPE, TRANS, EXIT = 0, 1, 2, 3, 4, 5


def source(seed=0) -> torch.Tensor:
    """32 rows x 8 distinct 16-bit values: matrix m is rows 8m .. 8m + 7."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(30000, generator=g)[: 32 * 8].to(torch.int16).view(32, 8) - 15000


def expected_fragment(src: torch.Tensor, num: int, trans: bool) -> torch.Tensor:
    """The PTX ISA's ldmatrix figure, element by element: [32 lanes, 4 registers] (unused: 0)."""
    out = torch.zeros(32, 4, dtype=torch.int64)
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for m in range(num):
            mat = src[8 * m: 8 * m + 8].to(torch.int64) & 0xFFFF
            if trans:
                lo, hi = mat[col, row], mat[col + 1, row]
            else:
                lo, hi = mat[row, col], mat[row, col + 1]
            out[lane, m] = lo | (hi << 16)
    return out


def as_u32(regs: torch.Tensor) -> torch.Tensor:
    return regs.to(torch.int64) & 0xFFFFFFFF


def load(num=4, trans=False, pitch=16, swizzle=False, fill=FILL_STORE, wait_n=0, mutation=NONE, bad_lane=0,
         seed=0):
    src = source(seed)
    return src, selftest.ldmatrix(src, num, trans, pitch, swizzle, fill, wait_n, mutation, bad_lane)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("pitch,swizzle", [(16, False), (48, False), (128, True)])
def test_fragment_layout_is_the_ptx_figure(num, trans, pitch, swizzle):
    src, regs = load(num, trans, pitch, swizzle, seed=num + 3 * trans + pitch)
    got = as_u32(regs)
    assert torch.equal(got[:, :num], expected_fragment(src, num, trans)[:, :num])
    assert (regs[:, num:] == 0).all()  # registers the shape does not have: untouched


def test_fragment_after_cp_async_wait():
    src, regs = load(4, True, pitch=32, fill=FILL_ASYNC)
    assert torch.equal(as_u32(regs), expected_fragment(src, 4, True))


# ---- each check, and the broken kernel it catches --------------------------------------------------
@pytest.mark.parametrize("num,bad_lane", [(1, 7), (2, 12), (4, 29)])
def test_misaligned_row_address_raises(num, bad_lane):
    with pytest.raises(RuntimeError, match=f"misaligned address: ldmatrix.m8n8.x{num} row address of lane {bad_lane}"):
        load(num, mutation=MISALIGNED, bad_lane=bad_lane)


def test_unused_lane_address_is_ignored():
    # .x1 takes addresses from lanes 0-7 only: lane 20's misaligned address is never used.
    src, regs = load(1, mutation=MISALIGNED, bad_lane=20)
    assert torch.equal(as_u32(regs)[:, :1], expected_fragment(src, 1, False)[:, :1])


def test_row_outside_shared_memory_raises():
    with pytest.raises(RuntimeError, match="row address of lane 3 .* not inside the block's dynamic shared memory"):
        load(4, mutation=OUTSIDE, bad_lane=3)


@pytest.mark.parametrize("num", [1, 2, 4])
def test_lane_with_another_shape_raises(num):
    with pytest.raises(RuntimeError, match="lanes of one warp execute different instructions"):
        load(num, mutation=SHAPE, bad_lane=5)


@pytest.mark.parametrize("trans", [False, True])
def test_lane_with_the_other_trans_raises(trans):
    with pytest.raises(RuntimeError, match=r"different instructions .*\.trans"):
        load(4, trans, mutation=TRANS, bad_lane=17)


def test_exited_lane_raises():
    with pytest.raises(RuntimeError, match="exited"):
        load(4, mutation=EXIT, bad_lane=31)


def test_read_with_cp_async_in_flight_raises():
    # cp.async, commit, __syncthreads (legal with the group committed), then the read: no wait.
    with pytest.raises(RuntimeError, match="while a cp.async of thread .* is still in flight"):
        load(4, fill=FILL_ASYNC_NO_WAIT)


# ---- multi-stage cp.async groups -------------------------------------------------------------------
# Matrix m's rows are commit group m (4 groups); wait_group n leaves the n most recent in flight, so
# matrices 0 .. 3 - n are readable and matrix 4 - n is not.
@pytest.mark.parametrize("wait_n,readable", [(3, 1), (2, 2), (0, 4)])
def test_wait_group_n_completes_all_but_the_n_most_recent(wait_n, readable):
    src, regs = load(readable, fill=FILL_ASYNC_STAGES, wait_n=wait_n)
    assert torch.equal(as_u32(regs)[:, :readable], expected_fragment(src, readable, False)[:, :readable])


@pytest.mark.parametrize("wait_n,num", [(3, 2), (2, 4), (1, 4)])
def test_wait_group_too_loose_raises(wait_n, num):
    with pytest.raises(RuntimeError, match="still in flight"):
        load(num, fill=FILL_ASYNC_STAGES, wait_n=wait_n)


# ---- .trans vs plain: the P V product ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_trans_fragment_feeds_mma_as_b(dtype):
    g = torch.Generator().manual_seed(7)
    A = torch.randn(16, 16, generator=g).to(dtype)
    V = torch.randn(16, 8, generator=g).to(dtype)  # [k][n], as V's [token][dim] rows
    ref = A.double() @ V.double()
    assert_close(selftest.ldmatrix_mma(A, V, True), ref, torch.float32)
    # The mutation (plain ldmatrix where .trans is needed) is not a rule the hardware can see; its
    # numbers are wrong, which the comparison with the matmul catches.
    wrong = selftest.ldmatrix_mma(A, V, False).double()
    assert (wrong - ref).norm() > 0.1 * ref.norm()


# ---- bank conflicts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pitch,swizzle,extra_per_matrix", [(128, False, 7), (128, True, 0), (144, False, 0),
                                                              (64, False, 3), (16, False, 0)])
def test_bank_conflicts_counted_per_matrix(pitch, swizzle, extra_per_matrix):
    selftest.ldmatrix_stats(True)
    load(4, pitch=pitch, swizzle=swizzle)
    instructions, matrices, extra = selftest.ldmatrix_stats(True)
    assert (instructions, matrices) == (1, 4)
    assert extra == 4 * extra_per_matrix


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 96])
def test_tensor_core_prefill_reads_are_conflict_free(dtype, head_size):
    case = make_case([70, 130], q_lens=[70, 9], num_heads=4, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, seed=head_size)
    out = nan_like(case.query)
    selftest.ldmatrix_stats(True)
    selftest.prefill_attention_config(*case.prefill_args(out), [0, 0, 0, 0, 1])
    instructions, matrices, extra = selftest.ldmatrix_stats(True)
    assert_close(out, case.reference_prefill(), dtype)
    assert instructions > 0, "the tensor-core prefill reads its tiles by ldmatrix"
    assert extra == 0, f"{extra} bank-conflict wavefronts over {matrices} matrices"

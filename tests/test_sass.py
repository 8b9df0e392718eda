"""The static cost report (bench/sass.py, issue #23 item 1) on the built extension's sm_80 and sm_90
SASS: no kernel spills, and no kernel family regresses past the thresholds below.

TARGETS are issue #23's; CURRENT is what today's kernels reach (measured on the build these
thresholds were set against, with the report's numbers in the comments), a little loosened so that
noise from an unrelated edit does not fail the suite. ENFORCED picks, per family, which row the test
holds the build to: flip a family to TARGETS when its rewrite lands.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import sass

# Reported: the A100 and H100 / H200 archs, those of them the build carries (the default and CI
# builds carry both; a build for one arch only, e.g. PAGED_OPS_CUDA_ARCHS=90, is checked on it).
ARCHS = ["sm_80", "sm_90"]

# The issue's targets. max_instr_per_byte: KV-loop instructions per byte one warp loads per
# iteration, at most 1 / 4.13 so the issue-rate ceiling is >= 90% of 4.8 TB/s on an H200
# (0.9 * 4.8e12 / (132 SMs * 4 issue/clk * 1.98e9) = 4.13 B per warp-instruction).
# min_bandwidth_bound: the report's static bound (min of its issue, Little and dependent-chain
# ceilings) for the sm_90 code on an H200, as a share of 4.8 TB/s. Spills: 0.
TARGETS = {
    "decode_kernel": dict(max_regs=128, min_occupancy=0.25, max_instr_per_byte=0.242, min_bandwidth_bound=0.9,
                          max_spill_bytes=0),
    "prefill_tc_kernel": dict(min_hmma_share=0.09, max_spill_bytes=0),
    "prefill_tc_pipelined_kernel": dict(min_hmma_share=0.09, max_spill_bytes=0),
}

# Today's kernels (the rewrites of issue #23 merged; sm_80 and sm_90, `python -m bench.sass --full`):
# decode_kernel (81 instantiations per arch, one kernel for every group) 76-128 registers and no
# spills (the register and spill targets are met), occupancy 25-37.5% on sm_90 (18.8% on sm_80 at
# the A100's 164 KB of shared memory); its general loop 0.24-0.68 loop instructions per byte on sm_90
# (0.20-0.49 on sm_80), static bound on sm_90 32-65% of 4.8 TB/s: issue rate caps it at G = 4 and the
# dependent-load chain (5 rounds per step-loop iteration since the page is found by FastDivmod, 6 since
# the ALiBi slopes come from the block's shared-memory copy; 8-14 and 22-35% before) elsewhere, Little 422%+. prefill_tc_kernel (the general tensor-core kernel: fp8 caches, odd views) HMMA
# 0.5-2.1%, its 64 B stack frame the local array of the cold add-back of non-finite V rows (0 bytes
# of spill stores by ptxas). prefill_tc_pipelined_kernel (cp.async + ldmatrix, FA2's structure and
# schedule, 128-row tiles at value heads <= 128) is compiled twice per head tile (bench/sass.py
# path_of): 'plain' 6.6-12.6% HMMA (<T, 128, 128, plain>, the issue's shape: 10.5-10.6%, the
# target met; 64: 6.8%, 256: 6.6-6.7%, DeepSeek's 192 / 128: 12.5-12.6%), 'score mods' (soft-cap /
# ALiBi) 5.3-10.3% (4.4-9.0% before the soft-cap by common.cuh SoftCapByExp, five instructions a score
# where tanh_fast took twelve), against FlashInfer's 8.7-8.9% measured by this tool. 255 registers (247-249 at
# value tile 256 on sm_90). Since the ldmatrix rows of a lane became four pointers plus constants
# (LdmatrixRows), the scale moved into the softmax's exponent, one block-table entry a thread and
# tile (copy_row) and the score modifiers one multiply into the tanh: loop instructions 3-18% fewer,
# stack frames per value tile (the row's args[3]): at 128-row tiles (value tiles <= 128) ptxas'
# spills of loop-invariant scalars and the running m / l beside 192 registers of accumulators and
# scores (FA2's flash_fwd_kernel at this tile keeps 64-192 B), 80-136 B plain (104-152 before),
# 120-144 B with the score mods (128-184; 144 on sm_80 at 128 since SoftCapByExp, 136 before, the
# loop's local accesses unchanged at 32); at value tile 64 8-40 B (0-16 before: ptxas' choice at the 255
# cap, no local access in the loop), at 256 none. The no-spill target is met at value tile 256 only.
CURRENT = {
    "decode_kernel": dict(max_regs=128, min_occupancy=0.1875, max_instr_per_byte=0.72, min_bandwidth_bound=0.3,
                          max_spill_bytes=0),
    "prefill_tc_kernel": dict(min_hmma_share=0.004, max_spill_bytes=64),
    "prefill_tc_pipelined_kernel (plain)": dict(min_hmma_share=0.064, max_spill_bytes={64: 32, 128: 136, 256: 0}),
    "prefill_tc_pipelined_kernel (score mods)": dict(min_hmma_share=0.052,
                                                     max_spill_bytes={64: 40, 128: 144, 256: 0}),
    # Over an fp8 cache (K / V staged in fp8 by copy_row, one row a thread, the staging rows swizzled by
    # row; widened to 16 bits in shared memory by a rolled loop): plain 5.8-10.4% (head 128: 9.9-10.4%;
    # 192 / 128 takes 32-key tiles there, 7.3-7.7%), score mods 5.0-8.4% (4.2-7.3% before SoftCapByExp);
    # stack 0-104 B plain (0 at 256,
    # 56-64 at 192 / 128, 64-96 at 64; 0-32 at 64 before stop 45), 56-152 B with the score mods (312
    # before at head 128). The general kernel they replace for these heads: 0.6-2.1%.
    "prefill_tc_pipelined_kernel (plain, fp8)": dict(min_hmma_share=0.056,
                                                     max_spill_bytes={64: 96, 128: 104, 256: 0}),
    "prefill_tc_pipelined_kernel (score mods, fp8)": dict(min_hmma_share=0.049,
                                                          max_spill_bytes={64: 152, 128: 144, 256: 0}),
}

# decode_kernel is compiled twice per shape (bench/sass.py path_of): the fast path (plan.h
# decode_fast_path: 16-byte copies, head 64 / 128 / 256, any block size; no soft-cap / ALiBi code
# but in its score-mods instances below) and the general loop, which keeps every case and today's
# CURRENT figures above. The fast loop sums a step's dot products by recursive halving
# (decode.cuh reduce_scatter_scores: N - 1 shuffles for N scores, not N log2(TPT)) and hands them back
# by N indexed shuffles (G = 1 without modifiers keeps the butterfly); each score's owner applies the
# row mask and the softmax (decode.cuh OwnedSoftmax: one exponential a score, not one a score on every
# lane), and at G = 4 each lane computes its scores in its own order (q's heads and the rows it reads
# permuted), so the halving selects nothing. On sm_90 (81 instantiations, 27
# of them 16-bit or fp32 caches): 63-128 registers, no spills, 1 round of dependent loads (the block
# table), occupancy 25-43.8%; 16-bit and
# fp32 caches 0.09-0.18 loop instructions per byte and a static bound of 100% of 4.8 TB/s
# (<bf16, bf16, 16, 4>, the issue's 32 / 8-head shape: 0.172, issue ceiling 126%; 0.199 and 110% with
# the halving's selects and the mask and softmax on every lane's gathered scores; 0.213 and 102% while
# it read K rows under a branch and widened bf16's high halves in two instructions; 0.227 and 96% with
# the butterfly before); fp8 caches 0.13-0.19 and 100% (two elements a cvt.rn.f16x2.e4m3x2 / e5m2x2: common.cuh
# fp8x4_to_float), so all 81 meet the issue's targets. On sm_80 (no fp8 cvt before sm_89) fp8
# converts by common.cuh fp8x2_to_half2_bits, 8-10 integer / half instructions a pair: 0.08-0.19
# instructions per byte, bound 100% of an A100's 2.039 TB/s (the library's per-element conversion it
# replaced: 0.75 and 40% at G = 1, 2).
# Held at 0.22 instructions per byte (the issue's 0.242 less the margin the branch-free K rows, the
# two-instruction bf16 pair, the owners' softmax and the select-free halving won; the most now is
# 0.211, the G = 4 score-mods instances over fp8 caches at TPT 8 with fp32 queries, 0.196 over 16-bit
# ones; 0.219 before the owners' softmax).
FAST_PATH = dict(max_regs=128, max_spill_bytes=0, max_instr_per_byte=0.22, min_bandwidth_bound=0.9)

# The fast loop with the soft-cap and ALiBi compiled in (decode_kernel<T, KV, TPT, G, true, true>, 81
# instantiations per arch: 27 over caches of the query's dtype, 0.22-0.35 of 4.8 TB/s on sm_90 in the
# general loop before; 54 over fp8 caches since stop 49, the general loop's 32-65% before): the slopes
# from a shared-memory copy (no global load in the loop but its copies: 1 round), the cap by common.cuh tanh_fast for 16-bit queries, each applied by the lane that
# owns the score after reduce_scatter_scores (every lane of the token group capped all 16 scores of a
# G = 4 step before: 0.308-0.331 instructions per byte, 66-71%). sm_90: 0.10-0.20, bound 100% (G = 4
# 16-bit: 0.183-0.196; 0.207-0.219 and 99-100% before the owners' softmax and the select-free
# halving), fp8 0.12-0.21, 100%; sm_80 0.09-0.14, fp8 0.10-0.20, 100%. 70-128 registers, no spills:
# the issue's targets.
FAST_SCORE_MODS = FAST_PATH

# Which row each family is held to. Families not named here must not spill at all.
ENFORCED = {
    "decode_kernel (general)": CURRENT["decode_kernel"],
    "decode_kernel (fast)": FAST_PATH,
    "decode_kernel (fast, score mods)": FAST_SCORE_MODS,
    "prefill_tc_kernel": CURRENT["prefill_tc_kernel"],
    "prefill_tc_pipelined_kernel (plain)": CURRENT["prefill_tc_pipelined_kernel (plain)"],
    "prefill_tc_pipelined_kernel (score mods)": CURRENT["prefill_tc_pipelined_kernel (score mods)"],
    "prefill_tc_pipelined_kernel (plain, fp8)": CURRENT["prefill_tc_pipelined_kernel (plain, fp8)"],
    "prefill_tc_pipelined_kernel (score mods, fp8)": CURRENT["prefill_tc_pipelined_kernel (score mods, fp8)"],
}


@pytest.fixture(scope="module")
def rows():
    so = sass.default_so()
    if sass.elf_section(so, ".nv_fatbin") is None:
        pytest.skip(f"{Path(so).name} has no CUDA device code (a CPU-only torch build): nothing to report")
    archs = [a for a in ARCHS if a in sass.archs_in(so)]
    assert archs, f"{Path(so).name} carries SASS for none of {ARCHS} (only {sorted(sass.archs_in(so))})"
    return sass.cached_rows(so, archs)


def _family(row: dict) -> str:
    """The row's kernel family, decode_kernel's two loops apart (bench/sass.py path_of)."""
    return row["family"] + (f" ({row['path']})" if row.get("path") else "")


def _limits(family: str) -> dict:
    return ENFORCED.get(family, dict(max_spill_bytes=0))


def _limit(lim: dict, key: str, row: dict, default):
    """lim[key], or its entry for the row's fourth template argument: decode_kernel's head tile G,
    prefill_tc_pipelined_kernel's value tile DV."""
    value = lim.get(key, default)
    return value[int(row["args"][3])] if isinstance(value, dict) else value


def test_report_covers_the_archs_and_every_launch(rows):
    assert {r["arch"] for r in rows} == set(ARCHS) & sass.archs_in(sass.default_so())
    unknown = sorted({r["family"] for r in rows if "threads" not in r})
    assert not unknown, f"kernels without a launch configuration in bench/sass.py's LAUNCH: {unknown}"
    for r in rows:
        if r["family"].startswith(("decode_kernel", "prefill")):
            assert "loop" in r, f"no KV loop found in {r['arch']} {r['name']}"


# The pipelined prefill's interior tile per warp (bench/sass.py tile_path: the loop's head, the interior
# body, the latch; the edge body and the cold add-back off it), the tensor-core share of what it issues,
# by value tile. Over 16-bit caches, sm_80 and sm_90: plain 17.0-17.1% at 64 (747-753 instructions),
# 24.4-27.6% at 128 (1047-1163; 12.8% before copy_row, by the same count with its rolled copy loops
# counted per pass), 19.2-19.4% at 256; score mods 9.8-10.0%, 15.9-19.0%, 15.9-16.2% (1274-1307,
# 1575-1700, 788-807 instructions; 7.3-7.4%, 12.6-15.0%, 13.9-14.2% before SoftCapByExp). No nested loop on
# the path (the fp8 kernels' rolled widening is a loop there: their count is a lower bound, not held).
TILE_PATH_HMMA = {"plain": {64: 0.16, 128: 0.22, 256: 0.18}, "score mods": {64: 0.095, 128: 0.15, 256: 0.15}}


def test_prefill_tile_path(rows):
    held = [r for r in rows if r["family"] == "prefill_tc_pipelined_kernel" and r["path"] in TILE_PATH_HMMA]
    assert held, "no pipelined prefill kernel over a 16-bit cache in the build"
    bad = []
    for r in held:
        tp = r["loop"].get("tile_path")
        floor = TILE_PATH_HMMA[r["path"]][int(r["args"][3])]
        if tp is None or tp["nested_loops"] or tp["hmma_share"] < floor:
            bad.append(f"{r['arch']} {r['name']}: tile path {tp and {k: tp[k] for k in ('instructions', 'hmma_share', 'nested_loops')}}, HMMA floor {floor}")
    assert not bad, "\n".join(bad)


def test_no_spills(rows):
    over = [f"{r['arch']} {r['name']}: stack {r['stack']} B, local {r['local']} B" for r in rows
            if r["stack"] + r["local"] > _limit(_limits(_family(r)), "max_spill_bytes", r, 0)]
    assert not over, "spills:\n" + "\n".join(over)


@pytest.mark.parametrize("family", sorted(ENFORCED))
def test_thresholds(rows, family):
    lim, mine = ENFORCED[family], [r for r in rows if _family(r) == family]
    assert mine, f"no {family} in the build"
    bad = []
    for r in mine:
        where = f"{r['arch']} {r['name']}"
        if r["regs"] > (most := _limit(lim, "max_regs", r, 255)):
            bad.append(f"{where}: {r['regs']} registers > {most}")
        if r["occupancy"] < (least := _limit(lim, "min_occupancy", r, 0)):
            bad.append(f"{where}: occupancy {r['occupancy']:.3f} < {least}")
        if r["hmma_share"] < lim.get("min_hmma_share", 0):
            bad.append(f"{where}: HMMA {r['hmma_share']:.2%} of instructions < {lim['min_hmma_share']:.0%}")
        if r["loop"]["instructions_per_byte"] > (most := _limit(lim, "max_instr_per_byte", r, float("inf"))):
            bad.append(f"{where}: {r['loop']['instructions_per_byte']:.3f} loop instructions per byte > {most}")
        bound = r["loop"].get("bound_share", 0) if "loop" in r else 0
        if r["arch"] == "sm_90" and bound < (least := _limit(lim, "min_bandwidth_bound", r, 0)):
            bad.append(f"{where}: static bandwidth bound {bound:.0%} of 4.8 TB/s < {least:.0%}")
    assert not bad, "\n".join(bad)


def test_pipelined_prefill_meets_the_hmma_target_at_the_issue_shape(rows):
    """Issue #23 item 3's static target (TARGETS: tensor-core instructions >= 9% of the kernel's),
    held on the pipelined kernel at the anchors' shape: fp16 / bf16, head 128, no soft-cap or ALiBi,
    on every arch the build carries (10.2-10.3% at this build), and over fp8 caches (9.5-9.9%: the
    general kernel they took before reached 0.6-2.1%)."""
    lim = TARGETS["prefill_tc_pipelined_kernel"]
    mine = [r for r in rows
            if r["family"] == "prefill_tc_pipelined_kernel" and r["args"][2:] == ["128", "128", "false"]]
    assert len(mine) == 6 * len({r["arch"] for r in rows}), "the head-128 plain instances (2 dtypes x 3 caches)"
    low = [f"{r['arch']} {r['name']}: HMMA {r['hmma_share']:.2%}" for r in mine
           if r["hmma_share"] < lim["min_hmma_share"]]
    assert not low, "\n".join(low)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_fast_path_meets_the_issue_targets(rows, arch):
    """Issue #23 item 2's static targets (TARGETS above), held on the fast path of every
    instantiation: 16-bit, fp32 and fp8 caches, and the 81 with the soft-cap / ALiBi compiled in. sm_90: fp8 by two elements a cvt (common.cuh
    fp8x4_to_float: the scalar conversion left fp8 at G = 4 at 83-88%). sm_80 (an A100, whose bound
    the report rates at 2.039 TB/s): GPUs before sm_89 have no fp8 cvt, and the library's software
    conversion, one element at a time, left the fp8 instances at G = 1, 2 at 0.75 instructions per
    byte and a 40% bound (common.cuh fp8x2_to_half2_bits since); its occupancy is the A100's (164 KB
    of shared memory: 18.8% at 16-bit caches), so it is held on sm_90 only."""
    lim = TARGETS["decode_kernel"]
    min_occupancy = lim["min_occupancy"] if arch == "sm_90" else 0
    mine = [r for r in rows if r["arch"] == arch
            and _family(r) in ("decode_kernel (fast)", "decode_kernel (fast, score mods)")]
    if not mine:
        pytest.skip(f"the build carries no {arch} code")
    bad = [f"{r['name']}: {r['regs']} registers, occupancy {r['occupancy']:.3f}, "
           f"{r['loop']['instructions_per_byte']:.3f} instructions per byte, bound {r['loop']['bound_share']:.0%}"
           for r in mine
           if r["regs"] > lim["max_regs"] or r["occupancy"] < min_occupancy
           or r["loop"]["instructions_per_byte"] > lim["max_instr_per_byte"]
           or r["loop"]["bound_share"] < lim["min_bandwidth_bound"] or r["stack"] + r["local"] > 0]
    assert len(mine) == 81 + 81 and not bad, "\n".join(bad) or f"{len(mine)} instantiations, expected 162"


# Decode calls at their plan's grid (bench/sass.py call_bound, sm_90 on an H200): the issue's
# 64 x 4096 (32 / 8 heads) target is >= 90%, its batch-1 one >= 80%. Today: 64 x 4096 100% (512 CTAs,
# one wave). Batch 1 x 4096: a thread-block cluster of 16 blocks (8 warps, 256-token partitions) per KV
# head, 128 CTAs in one wave, 100% steady, partials pushed into each other's shared memory and merged
# there (plan.h plan_cluster_merge, decode.cuh push_partial): 81% with the model's assumed 200 ns for
# the cluster's exchange (the remote stores and one barrier; its one wave's latency and the exchange
# against 3.5 us of KV bytes; 83% at 100 ns, 79.5% at 300 ns), so the 80% holds if the exchange costs
# under ~270 ns, which no GPU has measured. Before (a reduce kernel after 296 CTAs of 112-token
# partitions): 71%, 74% the most its two latencies allowed. 1 x 32768 97% (95% before).
# 64 x 4096 over 48-token pages (no power of two): the fast loop as at 16 (locate_tile's FastDivmod);
# before, the general loop took it (its sm_90 bound 40-60%). Heads of 96 (Phi-3's): the fast loop with
# the 16 lanes' last 4 idle, 96 / 128 of the head-128 loop's bytes for the same instructions, so the
# issue rate caps it at G = 4 (82%; 76% before the K rows were read without a branch); before, the general
# loop (at most 32% at G = 4: its head-128 figure).
CALL_SHARES = {"64 x 4096, 32 / 8 heads": 0.9, "1 x 4096, 32 / 8 heads": 0.8, "1 x 4096, 64 / 8 heads": 0.8,
               "1 x 32768, 32 / 8 heads": 0.95, "64 x 4096, 32 / 8 heads, block 48": 0.9,
               "64 x 4096, 32 / 8 heads, head 96": 0.7}


def test_decode_calls_at_their_grids(rows):
    calls = {c["shape"]: c for c in sass.decode_call_rows(rows)}
    if not calls:
        pytest.skip("no sm_90 code or no cuda_emu backend (its decode_plan hook gives the grids)")
    bad = [f"{shape}: {calls[shape]['share']:.0%} < {least:.0%}" for shape, least in CALL_SHARES.items()
           if calls[shape]["share"] < least]
    assert not bad, "\n".join(bad)
    assert all(c["kernel"].endswith("true, false>") for c in calls.values()), "the issue's shapes: the fast path"
    assert all(calls[shape]["plan"]["cluster_blocks"] == 16 for shape in calls if shape.startswith("1 x")), \
        "batch 1: one cluster of 16 blocks per KV head (plan.h plan_cluster_merge)"


def test_call_bound_arithmetic():
    h200 = sass.DEVICES["sm_90"]
    row = dict(warps=16, blocks=4, loop=dict(issue_share=0.96, little_share=6.0, chain_share=3.0))
    plan = dict(grid_x=1, grid_y=8, grid_z=37, threads=128, split=1, partition_size=112)
    c = sass.call_bound(row, plan, 1, 4096, 32, 8, h200, 600)
    warps = 296 * 4 / 132
    assert c["ctas"] == 296 and c["waves"] == 1 and c["warps_per_sm"] == pytest.approx(warps)
    assert c["steady_share"] == pytest.approx(min(0.96, 3.0 * warps / 16))
    kv, ws = 8 * 4096 * 2 * 128 * 2, 2 * 32 * 37 * 130 * 4
    assert c["kv_bytes"] == kv and c["workspace_bytes"] == ws
    assert c["seconds"] == pytest.approx((kv + ws) / (c["steady_share"] * 4.8e12) + 2 * 600e-9)
    assert c["share"] == pytest.approx(kv / 4.8e12 / c["seconds"])
    # 3.5 us of KV bytes beside two latencies (the wave's, the merge's): 74% whatever the loop does.
    assert c["latency_ceiling"] == pytest.approx(kv / 4.8e12 / (kv / 4.8e12 + 1.2e-6))
    assert 0.74 < c["latency_ceiling"] < 0.75
    # In clusters (plan.h plan_cluster_merge): no partials in memory and no reduce kernel, the
    # assumed exchange instead of the second latency.
    cluster = sass.call_bound(row, dict(plan, grid_z=16, threads=256, cluster_blocks=16), 1, 4096, 32, 8, h200, 600,
                              exchange_ns=300)
    assert cluster["ctas"] == 128 and cluster["workspace_bytes"] == 0 and cluster["waves"] == 1
    assert cluster["warps_per_sm"] == pytest.approx(128 * 8 / 132)
    assert cluster["seconds"] == pytest.approx(kv / (cluster["steady_share"] * 4.8e12) + 900e-9)
    assert cluster["latency_ceiling"] == pytest.approx(kv / 4.8e12 / (kv / 4.8e12 + 0.9e-6))
    one_pass = sass.call_bound(row, dict(plan, grid_x=64, grid_z=1, split=0), 64, 4096, 32, 8, h200, 600)
    assert one_pass["workspace_bytes"] == 0 and one_pass["waves"] == 1
    assert one_pass["warps_per_sm"] == pytest.approx(512 * 4 / 132)  # 64 x 8 CTAs of 4 warps
    # Heads of 96 on the fast loop's 16 lanes: its copies past the head idle, every ceiling 96 / 128 of
    # the loop's static bytes; the general loop's copies are laid out by the row, not by the lanes.
    fast = dict(row, args=["__nv_bfloat16", "__nv_bfloat16", "16", "4", "true", "false"])
    narrow = sass.call_bound(fast, dict(plan, grid_x=64, grid_z=1, split=0), 64, 4096, 32, 8, h200, 600, head=96)
    assert narrow["steady_share"] == pytest.approx(0.96 * 0.75)
    assert narrow["kv_bytes"] == 64 * 8 * 4096 * 2 * 96 * 2
    general = dict(fast, args=fast["args"][:4] + ["false", "true"])
    assert sass.call_bound(general, dict(plan, grid_x=64, grid_z=1, split=0), 64, 4096, 32, 8, h200, 600,
                           head=96)["steady_share"] == pytest.approx(0.96)


def test_launch_table_follows_plan_h():
    """bench/sass.py's launch shapes are transcribed from csrc/kernels/plan.h: its constants must agree."""
    plan = (Path(sass.ROOT) / "csrc" / "kernels" / "plan.h").read_text()
    for name, value in sass.PLAN.items():
        m = re.search(rf"constexpr int {name} = ([0-9 *]+);", plan) or re.search(rf"\b{name} = ([0-9 *]+)[,;]", plan)
        assert m, f"{name} is no longer in plan.h: update bench/sass.py's PLAN / LAUNCH"
        assert eval(m.group(1)) == value, f"plan.h {name} = {m.group(1)}, bench/sass.py says {value}: update it"


# ---- the report's own arithmetic, on known inputs ------------------------------------------------
# (offset, instruction, write scoreboard, wait mask): rendered as cuobjdump prints it, the control
# word in bits 41.. of the second 64-bit word.
LOOP_SASS = [
    (0x00, "LDC R1, c[0x0][0x28]", 7, 0),
    (0x10, "@!P0 LDG.E.128 R4, desc[UR4][R2.64]", 0, 0),
    (0x20, "LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R6.64]", 7, 0),
    (0x30, "LDGDEPBAR", 7, 0),
    (0x40, "DEPBAR.LE SB0, 0x1", 7, 0),
    (0x50, "LDG.E.U16 R8, desc[UR4][UR6.64]", 1, 0),
    (0x60, "HMMA.16816.F32.BF16 R8, R12, R14, R8", 7, 0b11),
    (0x70, "@P1 BRA 0x10", 7, 0),
    (0x80, "EXIT", 7, 0),
    (0x90, "BRA 0x90", 7, 0),
    (0xA0, "NOP", 7, 0),
]


def _cuobjdump_text(instrs) -> str:
    lines = ["\t\tFunction : _Z4loopv"]
    for off, text, wb, wait in instrs:
        high = ((wait << 11) | (7 << 8) | (wb << 5) | 1) << 41
        lines += [f"        /*{off:04x}*/                   {text} ;   /* 0x000000000000000 */",
                  f"                                              /* 0x{high:016x} */"]
    return "\n".join(lines) + "\n"


def test_parse_mix_and_loop():
    instrs = sass.counted(sass.parse_sass(_cuobjdump_text(LOOP_SASS), "sm_90")[("sm_90", "_Z4loopv")])
    assert len(instrs) == 9  # NOP and the trailing self-branch dropped
    assert instrs[1][3:5] == (0, 0) and instrs[6][3:5] == (7, 0b11)  # scoreboards read back
    assert [i[5] for i in instrs[:3]] == [False, True, False] and instrs[7][5]  # guard predicates
    mix = sass.mix(instrs)
    assert (mix["LDG"], mix["LDGSTS"], mix["HMMA"], mix["BRANCH"], mix["total"]) == (2, 1, 1, 2, 9)
    loop = sass.main_loop(instrs)
    # 16 B x 32 lanes (LDG.128) + 16 B x 32 (LDGSTS.128) + 2 B once (uniform address)
    assert loop["bytes_per_warp"] == 512 + 512 + 2 and loop["instructions"] == 7
    # DEPBAR.LE 1 leaves two commit groups of 512 B outstanding, with the next LDG.128 on top; the
    # HMMA waits for both LDG scoreboards, so they never add up across iterations
    assert loop["in_flight_bytes_per_warp"] == 512 + 2 * 512
    assert loop["dependent_load_rounds"] == 1  # both LDGs issued before the one wait


def test_main_loop_is_the_kv_loop_inside_a_heavier_row_tile_loop():
    """A prefill row tile loads its Q rows (and slopes) once, then runs the KV loop many times: where the
    row tile's own loads outweigh one KV tile's (fp8 caches at head 64 with the score modifiers), the
    KV loop nested in it, holding the math, is still the main loop (the row tile loop was taken)."""
    nested = [
        (0x00, "LDG.E.128 R4, desc[UR4][R2.64]", 7, 0),  # row tile: Q rows, 3 x 512 B
        (0x10, "LDG.E.128 R8, desc[UR4][R2.64+0x10]", 7, 0),
        (0x20, "LDG.E.128 R12, desc[UR4][R2.64+0x20]", 7, 0),
        (0x30, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]", 7, 0),  # KV loop: one 512 B copy
        (0x40, "HMMA.16816.F32.BF16 R8, R12, R14, R8", 7, 0),
        (0x50, "LDS R9, [R3]", 7, 0),  # a staging loop in the KV loop: loads, no math
        (0x60, "@P2 BRA 0x50", 7, 0),
        (0x70, "@P1 BRA 0x30", 7, 0),
        (0x80, "STG.E.128 desc[UR4][R2.64], R4", 7, 0),
        (0x90, "@P0 BRA 0x0", 7, 0),
        (0xA0, "EXIT", 7, 0),
    ]
    instrs = sass.counted(sass.parse_sass(_cuobjdump_text(nested), "sm_90")[("sm_90", "_Z4loopv")])
    loop = sass.main_loop(instrs)
    assert (loop["start"], loop["end"], loop["bytes_per_warp"], loop["nested_loops"]) == ("0x30", "0x70", 512, 1)


def test_tile_path():
    """An edge / interior split in the loop: the interior tile falls through and jumps over the edge body
    to the latch; the cold code after the edge body is off the path too."""
    split = [
        (0x00, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]", 7, 0),  # loop head
        (0x10, "@P0 BRA 0x60", 7, 0),  # edge tile: jump to the edge body
        (0x20, "HMMA.16816.F32.BF16 R8, R12, R14, R8", 7, 0),  # interior body
        (0x30, "@P1 BRA 0x40", 7, 0),  # a branch inside the interior body: both sides counted
        (0x40, "HMMA.16816.F32.BF16 R8, R12, R14, R8", 7, 0),
        (0x50, "BRA 0xa0", 7, 0),  # interior done: over the edge body to the latch
        (0x60, "FSEL R8, R8, -INF, P2", 7, 0),  # edge body
        (0x70, "HMMA.16816.F32.BF16 R8, R12, R14, R8", 7, 0),
        (0x80, "@!P3 BRA 0xa0", 7, 0),
        (0x90, "FFMA R8, R9, R10, R8", 7, 0),  # cold add-back
        (0xA0, "IADD3 R2, R2, 0x40, RZ", 7, 0),  # latch
        (0xB0, "@P4 BRA 0x0", 7, 0),
        (0xC0, "EXIT", 7, 0),
    ]
    instrs = sass.counted(sass.parse_sass(_cuobjdump_text(split), "sm_90")[("sm_90", "_Z4loopv")])
    loop = sass.main_loop(instrs)
    assert loop["instructions"] == 12
    path = sass.tile_path(instrs, loop)
    # the head (2), the interior body with its jump to the latch (4), the latch (2)
    assert [path[k] for k in ("instructions", "hmma", "nested_loops")] == [8, 2, 0]
    assert sass.tile_path(instrs[:2] + instrs[10:], sass.main_loop(instrs[:2] + instrs[10:])) is None


def test_dependent_load_chain():
    """A block-table entry loaded, waited for, then the K row it addresses: two latencies per token."""
    chain = [
        (0x00, "LDG.E R2, desc[UR4][R4.64]", 0, 0),  # block-table entry
        (0x10, "IMAD.WIDE R6, R2, 0x100, R8", 7, 0b1),  # its address, waiting for it
        (0x20, "LDG.E.128 R12, desc[UR4][R6.64]", 1, 0),  # the K row
        (0x30, "FFMA R16, R12, R13, R16", 7, 0b10),
        (0x40, "@P0 BRA 0x0", 7, 0),
        (0x50, "EXIT", 7, 0),
    ]
    instrs = sass.counted(sass.parse_sass(_cuobjdump_text(chain), "sm_90")[("sm_90", "_Z4loopv")])
    loop = sass.main_loop(instrs)
    assert loop["dependent_load_rounds"] == 2 and loop["in_flight_bytes_per_warp"] == 512
    h200 = sass.DEVICES["sm_90"]
    c = sass.ceilings(h200, loop, resident_warps=16, latency_ns=600)
    assert c["chain_bytes_s"] == pytest.approx(132 * 16 * (128 + 512) / (2 * 600e-9))
    assert c["bound_share"] == pytest.approx(min(c["issue_share"], c["little_share"], c["chain_share"], 1.0))


def test_occupancy_rules():
    h200 = sass.DEVICES["sm_90"]
    assert sass.occupancy(h200, 255, 128, 1024, 65536)["blocks"] == 2  # 8 warps of 8192 registers
    assert sass.occupancy(h200, 61, 128, 1024, 9216)["occupancy"] == 0.5  # 64 regs: 8 blocks of 4 warps
    assert sass.occupancy(h200, 32, 256, 1024, 100 * 1024)["limiter"] == "shared"
    assert sass.occupancy(sass.DEVICES["sm_80"], 32, 128, 0, 200 * 1024)["blocks"] == 0  # over 163 KiB


def test_split_name():
    fam, args = sass.split_name("void paged_cuda::decode::decode_kernel<__nv_bfloat16, X<1, 2>, 16, 4>(int, bool)")
    assert fam == "decode_kernel" and args == ["__nv_bfloat16", "X<1, 2>", "16", "4"]

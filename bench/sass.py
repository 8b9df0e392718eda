"""Static cost report of the CUDA kernels, read from their compiled SASS (issue #23 item 1).

    python -m bench.sass [--so PATH] [--arch sm_80,sm_90] [--json OUT] [--md OUT] [--full] [--anchors]

For every kernel the extension's fatbinary holds, per arch: registers, stack / local (spill) bytes,
static shared memory (`cuobjdump -res-usage`), the dynamic shared memory and block size of its launch
(the LAUNCH table below, transcribed from csrc/kernels/plan.h at a reference shape), occupancy at that
launch, the instruction mix by opcode family (`cuobjdump --dump-sass`), and for the attention kernels
the main KV loop and the bandwidth ceilings it gives. `--anchors` reports FlashInfer's paged decode /
prefill and FlashAttention-2's forward kernels the same way (bench/sass_anchor_build.py compiles them).

The model (everything below is static; each number is an estimate of a ceiling, not a measurement):
- Occupancy: the CUDA occupancy calculator's rules with the limits of the CUDA C++ Programming
  Guide's "Technical Specifications per Compute Capability" table: 64 K registers per SM, allocated
  per warp in units of 256; at most 2048 threads (64 warps) and 32 blocks per SM; shared memory
  228 KiB per SM on 9.0 (227 KiB per block), 164 KiB on 8.0 (163 KiB per block), plus 1 KiB
  reserved per block. sm_90 code is rated on an H200 (H100's SM), sm_80 on an A100.
- Main KV loop: every backward branch closes a loop [target, branch]. The main loop is the
  innermost one holding at least half the global-load bytes of the loop that holds the most and at
  least half the kernel's math instructions (HMMA / HGMMA, or FFMA in a kernel without them), so a
  staging loop inside the KV loop is not taken for it; loops nested inside it count once (their trip
  count is not static). Bytes per iteration per warp:
  LDG / LDGSTS width (.128 = 16 B, .64 = 8, plain = 4, .U16 / .S16 = 2, .U8 / .S8 = 1) x 32 lanes
  (x 1 when the address is a uniform register only). TMA copies (UTMALDG) have a run-time box and
  are counted, not sized.
- Issue ceiling: an SM issues at most 4 warp-instructions per clock (4 schedulers, Hopper tuning
  guide / H100 whitepaper); at 1.98 GHz boost on 132 SMs (H200 product brief) a loop of I
  instructions moving B bytes per warp can request at most 132 * 4 * 1.98e9 * B / I bytes/s.
- Little's law ceiling: bytes in flight per warp = the most bytes the loop has requested and not yet
  waited for, followed through two iterations: an LDG until the first instruction that waits on its
  scoreboard (the control bits of the SASS), LDGSTS until `DEPBAR.LE SB0, N` retires its commit
  group; bandwidth = 132 SMs * resident warps per SM * bytes in flight per warp / latency. That is
  the peak in flight, so an upper bound.
- Dependent-load chain ceiling: a warp issues in order, so an iteration that issues and waits for R
  rounds of LDGs, each issued after waiting for the previous (a block-table entry, then the K row it
  addresses), takes at least R latencies: bandwidth <= 132 * resident warps * bytes per iteration
  / (R * latency).
- The latency is an ASSUMPTION: 600 ns, an unloaded Hopper HBM latency of the order of 500 ns (the
  order pointer-chasing microbenchmarks publish: Chips and Cheese, "Nvidia's H100: Funny L2, and
  Tons of Bandwidth", 2023; Luo et al., arXiv:2402.13499; their exact figures not re-checked here)
  plus queueing under load. `--latency-ns` changes it.
- Decode calls (call_bound): a plan in thread-block clusters merges its partials through distributed
  shared memory, which is taken to cost 200 ns (DEFAULT_EXCHANGE_NS: the blocks' stores into each
  other's shared memory, then one cluster barrier, in series, each ~200 cycles, the order Luo et al.
  publish for Hopper's SM-to-SM network; ANOTHER ASSUMPTION, not re-checked). `--exchange-ns` changes it.
- The ceilings are shares of the H200's 4.8 TB/s HBM3e (H200 product brief); the smallest of them
  and 100% is the kernel's static bound. All assume a grid that fills every SM at the kernel's
  occupancy (a shape's grid fill, e.g. the split-KV plan's, is not modelled) and ignore barriers,
  shared-memory and tensor-core throughput; the loop body is walked in address order (both sides of
  a branch inside it counted). sm_80 figures use A100-SXM4-80GB (108 SMs, 1.41 GHz, 2.039 TB/s)
  with the same assumed latency.
- Tile path (the pipelined prefill, TILE_PATH_FAMILIES): the instructions an interior tile issues per
  warp, the loop's head, the fall-through of its edge / interior branch and the latch (tile_path); a
  nested loop on it ("tile path loops": the fp8 kernels' rolled widening) is counted once, so there it is a
  lower bound. The static loop counts take the edge body and the cold add-back as if they ran.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / "build" / "sass-cache"
DEFAULT_LATENCY_NS = 600.0
# A cluster's merge of its partials (decode.cuh push_partial): each block's stores into the others'
# shared memory, then one cluster barrier (its release waits for them), in series, each taken as ~100 ns
# (~200 cycles at 1.98 GHz). An assumption: no GPU has timed it here (bench/device_check.sh measures
# batch 1 when one is lent).
DEFAULT_EXCHANGE_NS = 200.0


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    clock_hz: float
    dram_bytes_s: float
    smem_per_sm: int
    smem_per_block: int
    regs_per_sm: int = 65536
    max_threads: int = 2048
    max_blocks: int = 32
    reg_unit: int = 256  # registers allocated per warp in units of this many
    reserved_smem: int = 1024  # per block, compute capability >= 8.0
    # sm_90 cubins report that reserved KiB in -res-usage's SHARED (FlashInfer's decode, with no
    # static __shared__, shows SHARED:1024 on sm_90 and 0 on sm_80), so it is not added twice.
    reserved_in_static: bool = False
    issue_per_clock: int = 4  # warp-instructions per SM per clock (4 schedulers)


DEVICES = {
    "sm_90": Device("H200", 132, 1.98e9, 4.8e12, 228 * 1024, 227 * 1024, reserved_in_static=True),
    "sm_80": Device("A100-SXM4-80GB", 108, 1.41e9, 2.039e12, 164 * 1024, 163 * 1024),
}

# ---- launch configurations ---------------------------------------------------------------------
# Block size and dynamic shared memory of each kernel at a reference shape (head size from the
# template where it has one, else 128; GQA group = the head tile, 16 for the shared-KV kernel;
# 16-bit cache unless the template says fp8), transcribed from csrc/kernels/plan.h (plan_decode,
# plan_prefill, decode_smem, merge_floats) and the launchers in csrc/kernels/*.cuh. Update it
# with plan.h. Anchors: from their launchers, cited in bench/sass_anchors/*.cu.


# csrc/kernels/plan.h's constants the formulas below use (tests/test_sass.py checks them against
# plan.h, so a plan change fails the suite until this table follows it).
PLAN = dict(kDecodeThreads=128, kDecodeStages=3, kDecodeStageBytes=16 * 1024, kMaxHeadsPerThread=4,
            kPrefillThreads=128, kPrefillKvTile=32, kTcRows=64, kTcKv=32, kTcThreads=128)


def _elem(type_name: str) -> int:
    return 1 if any(t in type_name for t in ("fp8", "e4m3", "e5m2", "char")) else 4 if type_name == "float" else 2


def _merge_floats(ntg: int, gstride: int, d: int) -> int:  # plan.h merge_floats
    return ntg * gstride * (d + 2)


def _decode(args):  # decode_kernel<T, KV, TPT, G, kFast, kScoreMods>, group = G: plan_decode_shape + decode_smem
    tpt, g, elem = int(args[2]), int(args[3]), _elem(args[1])
    head, threads = 8 * tpt, PLAN["kDecodeThreads"]  # each lane owns 8 dims (lanes_per_token)
    ntg = threads // tpt  # one head tile: every token group serves it
    pitch = (head * elem + 15) // 16 * 16
    rows_per_step = 2 if elem == 4 else 4  # decode_rows_per_step
    tile = max(1, min(ntg * rows_per_step, PLAN["kDecodeStageBytes"] // (2 * pitch)))
    stages = PLAN["kDecodeStages"]
    ring = stages * tile * 2 * 8 + stages * 2 * tile * pitch  # offsets (int64 K, V) + K and V rows
    return threads, max(ring, _merge_floats(ntg, g, head) * 4), f"head {head}, group {g}, tile {tile}"


def _decode_wide(args):  # decode_wide_kernel<T, KV, G, KC, VC> at absorbed MLA: Dk 576, Dv 512, 16 heads, 1 KV head
    elem, dk, dv, group, tpt = _elem(args[1]), 576, 512, 16, 32
    threads = min(256, max(PLAN["kDecodeThreads"], group * tpt))  # G = 1: one head tile per token group
    ntg = threads // tpt
    pitch = (dk * elem + 15) // 16 * 16
    tile = max(1, PLAN["kDecodeStageBytes"] // pitch)  # V read from the staged K rows (values_in_key_rows)
    stages = PLAN["kDecodeStages"]
    ring = stages * tile * 2 * 8 + stages * tile * pitch
    return threads, max(ring, _merge_floats(ntg, 1, dv) * 4), f"head {dk}/{dv} latent, group {group}, tile {tile}"


def _prefill(args, d=128):  # prefill_kernel<T, KV> (prefill_wide_kernel: head 576): rows = threads / 8
    threads, bn = PLAN["kPrefillThreads"], PLAN["kPrefillKvTile"]
    rows = threads // 8
    smem = lambda bn: (rows * d + bn * (d + 1) + rows * bn + 3 * rows) * 4  # noqa: E731 plan.h prefill_cuda_core_smem
    while bn > 1 and smem(bn) > 99 * 1024:  # plan.h kPrefillMaxSmem
        bn //= 2
    return threads, smem(bn), f"head {d}, {bn}-key tiles"


def _prefill_tc_pipelined(args):  # prefill_tc_pipelined_kernel<T, KV, DK, DV, kScoreMods>: Q, K of DK, V of DV
    dk, dv, fp8 = int(args[2]), int(args[3]), _elem(args[1]) == 1
    rows = PLAN["kTcRows"] * (2 if dv <= 128 else 1)  # plan.h tc_pipelined_rows (tc_pipelined_row_frags)
    # plan.h tc_pipelined_smem: 16-bit Q, K, V tiles, and an fp8 cache's staging tiles
    smem = lambda bn: ((rows + bn) * dk + bn * dv) * 2 + (bn * (dk + dv) if fp8 else 0)  # noqa: E731
    kv = 64 if dv <= 128 and smem(64) <= 99 * 1024 else 32  # plan.h tc_pipelined_kv_tile (kPrefillMaxSmem)
    mods = ", soft-cap / ALiBi" if args[4] == "true" else ""
    return PLAN["kTcThreads"], smem(kv), f"head {dk}/{dv}, {rows} x {kv} tiles{', fp8 staged' if fp8 else ''}{mods}"


def _prefill_tc(args):  # prefill_tc_kernel<T, KV, DMAX>: Q, K, V tiles of 16-bit elements, head DMAX
    d = int(args[2])
    return PLAN["kTcThreads"], (PLAN["kTcRows"] + 2 * PLAN["kTcKv"]) * (d + 8) * 2, f"head {d}"


LAUNCH = [
    ("decode_kernel", _decode),
    ("decode_wide_kernel", _decode_wide),
    ("decode_reduce_kernel", lambda a: (128, 0, "")),
    ("prefill_kernel", _prefill),
    ("prefill_wide_kernel", lambda a: _prefill(a, 576)),
    ("prefill_tc_kernel", _prefill_tc),
    ("prefill_tc_pipelined_kernel", _prefill_tc_pipelined),
    ("merge_kernel", lambda a: (256, 0, "")),
    ("merge_states_kernel", lambda a: (256, 0, "")),
    ("reshape_and_cache_kernel", lambda a: (256, 0, "8+ KV heads x head 128")),
    ("quantize_kernel", lambda a: (256, 0, "")),
    ("dequantize_kernel", lambda a: (256, 0, "")),
    ("copy_blocks_kernel", lambda a: (256, 0, "")),
    ("image_probe_kernel", lambda a: (32, 0, "never launched: cudaFuncGetAttributes' probe")),
    # anchors (bench/sass_anchors/*.cu state where each number comes from)
    ("BatchDecodeWithPagedKVCacheKernel", lambda a: (128, 8192 + 1024, "bf16, head 128, group 4")),
    ("BatchPrefillWithPagedKVCacheKernel", lambda a: (128, 65536, "bf16, head 128, CTA 128 x 64")),
    ("flash_fwd_kernel", lambda a: (128, 65536, "bf16, head 128, 128 x 64 tiles")),
    ("flash_fwd_splitkv_kernel", lambda a: (128, 81920, "bf16, head 128, 64 x 128 tiles")),
]
ATTENTION = ("decode", "prefill", "Decode", "Prefill", "flash_fwd")


def path_of(family: str, args: list[str]) -> str:
    """decode_kernel's compiled KV loops (its kFast, kScoreMods template arguments, plan.h
    decode_fast_path): 'fast' (16-byte copies, one head size for keys and values, up to the lanes' 8 x TPT,
    any block size, no soft-cap / ALiBi code), 'fast, score mods' (the same with them, any
    cache) or 'general' (every case);
    prefill_tc_pipelined_kernel's two (kScoreMods, plan.h score_mods): 'plain' (the scores take one
    multiply) or 'score mods' (soft-cap / ALiBi), each with ', fp8' over an fp8 cache (staged tiles
    widened in shared memory); '' elsewhere."""
    if family == "decode_kernel" and len(args) == 6:
        return ("fast" + (", score mods" if args[5] == "true" else "")) if args[4] == "true" else "general"
    if family == "prefill_tc_pipelined_kernel" and len(args) == 5:  # its kScoreMods instance or the plain one
        return ("score mods" if args[-1] == "true" else "plain") + (", fp8" if _elem(args[1]) == 1 else "")
    return ""


def launch_of(family: str, args: list[str]):
    """(threads, dynamic smem bytes, shape note) of a kernel family, or None when not in LAUNCH."""
    for name, fn in LAUNCH:
        if family == name:
            try:
                return fn(args)
            except (IndexError, ValueError):
                return None
    return None


# ---- tools -------------------------------------------------------------------------------------
def find_tool(name: str) -> str | None:
    """cuobjdump / nvdisasm / cu++filt: CUDA_HOME/bin, PATH, then the copy Triton's package ships."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", ""), "bin", name), shutil.which(name) or ""]
    try:
        import triton  # noqa: PLC0415

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cuobjdump(path: str, *args: str) -> str:
    tool = find_tool("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (CUDA_HOME/bin, PATH, or triton/backends/nvidia/bin)")
    return subprocess.run([tool, *args, path], check=True, capture_output=True, text=True).stdout


def archs_in(path: str) -> set[str]:
    """The SASS archs (sm_XX) a cubin / .so carries (`cuobjdump -lelf`; a cubin's own name otherwise)."""
    try:
        listing = cuobjdump(path, "-lelf")
    except subprocess.CalledProcessError:
        listing = ""
    return set(re.findall(r"\.(sm_\d+)\.", listing)) or set(re.findall(r"\.(sm_\d+)\.cubin$", path))


def demangle(names: list[str]) -> dict[str, str]:
    """Itanium names to C++ (one c++filt / cu++filt process for all); unchanged when neither exists."""
    tool = find_tool("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def split_name(demangled: str) -> tuple[str, list[str]]:
    """'void ns::kernel<A, B<C, D>, 4>(args)' -> ('kernel', ['A', 'B<C, D>', '4'])."""
    demangled = demangled.replace("(anonymous namespace)", "anonymous")
    depth, end = 0, len(demangled)
    for i, ch in enumerate(demangled):  # the parameter list: the first '(' outside template brackets
        depth += (ch in "<(") - (ch in ">)")
        if ch == "(" and depth == 1:
            end = i
            break
    head = demangled[:end]
    lt = head.find("<")
    base, targs = (head, "") if lt < 0 else (head[:lt], head[lt + 1 : head.rfind(">")])
    family = base.split()[-1].split("::")[-1]
    args, depth, cur = [], 0, ""
    for ch in targs:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        args.append(cur.strip())
    return family, args


# ---- parsing -----------------------------------------------------------------------------------
_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_res_usage(text: str, arch: str) -> dict[tuple[str, str], dict]:
    """{(arch, mangled): {regs, stack, shared, local}} from `cuobjdump -res-usage -arch <arch>`."""
    return {(arch, f.group(1)): dict(regs=int(f.group(2)), stack=int(f.group(3)), shared=int(f.group(4)),
                                     local=int(f.group(5))) for f in _RES.finditer(text)}


# One instruction: its line (offset, predicate, opcode, operands; the low 64 bits) and the next line
# (the high 64 bits, whose bits 41.. are the control word: stall 4, yield 1, write scoreboard 3,
# read scoreboard 3, wait mask 6 -- the layout the Volta+ assemblers (maxas / CuAssembler) document).
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);[^\n]*\n"
                    r"(?:\s*/\* 0x([0-9a-f]{16}) \*/)?")


def parse_sass(text: str, arch: str) -> dict[tuple[str, str], list[tuple]]:
    """{(arch, mangled): [(offset, opcode, operands, write scoreboard, wait mask, predicated)]} from
    `cuobjdump --dump-sass -arch <arch>`; scoreboard 7 = none (also when the control word is absent);
    predicated: the instruction carries a guard predicate (@P0, @!UP1, ...; @PT counts as none)."""
    out = {}
    for chunk in text.split("Function : ")[1:]:
        name, _, body = chunk.partition("\n")
        instrs = []
        for m in _INSTR.finditer(body):
            ctl = int(m.group(5), 16) >> 41 if m.group(5) else 7 << 5
            guard = (m.group(2) or "").strip()
            instrs.append((int(m.group(1), 16), m.group(3), m.group(4).strip(), (ctl >> 5) & 7, (ctl >> 11) & 0x3F,
                           guard not in ("", "@PT")))
        out[(arch, name.strip())] = instrs
    return out


# ---- instruction mix ---------------------------------------------------------------------------
FAMILIES = [  # (family, opcode bases: the opcode before its first '.')
    ("HMMA", ("HMMA",)), ("HGMMA", ("HGMMA",)), ("LDSM", ("LDSM",)), ("LDGSTS", ("LDGSTS",)),
    ("TMA", ("UTMALDG", "UTMAPF", "UBLKCP", "UTMASTG")), ("LDG", ("LDG",)), ("LDS", ("LDS",)),
    ("STS", ("STS",)), ("STG", ("STG",)), ("LDL/STL", ("LDL", "STL")), ("PRMT", ("PRMT",)),
    ("CVT", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")), ("SHFL", ("SHFL",)), ("BAR", ("BAR",)),
    ("MUFU", ("MUFU",)), ("IMAD/IADD", ("IMAD", "IADD", "VIADD")),
    ("FP32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP")),
    ("BRANCH", ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT")),
]


def family_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    return next((fam for fam, bases in FAMILIES if base in bases), "other")


def counted(instrs):
    """Instructions that issue: NOPs and the trailing self-branch (`BRA` to itself) dropped."""
    return [i for i in instrs if i[1] != "NOP" and not (i[1] == "BRA" and _target(i) == i[0])]


def mix(instrs) -> dict[str, int]:
    c = Counter(family_of(i[1]) for i in instrs)
    c["total"] = len(instrs)
    return dict(c)


def _target(instr) -> int | None:
    m = re.search(r"0x([0-9a-f]+)\s*$", instr[2].strip())
    return int(m.group(1), 16) if instr[1].startswith(("BRA", "JMP")) and m else None


_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def load_bytes_per_warp(instr) -> int:
    """Global bytes one warp requests with this instruction (0 for anything but LDG / LDGSTS)."""
    op, operands = instr[1], instr[2]
    mods = op.split(".")
    if mods[0] not in ("LDG", "LDGSTS"):
        return 0
    width = next((_WIDTH[m] for m in mods[1:] if m in _WIDTH), 4)
    addresses = re.findall(r"\[([^\]]*)\]", operands.split("desc")[-1])  # desc[UR][addr]: the address
    uniform = bool(addresses) and not re.search(r"(?<![U\w])R\d+", addresses[-1])
    return width * (1 if uniform else 32)


# ---- loops -------------------------------------------------------------------------------------
def loops(instrs) -> list[tuple[int, int]]:
    """[(start, end)] instruction index ranges closed by backward branches, innermost first."""
    index = {ins[0]: k for k, ins in enumerate(instrs)}
    found = {(index[t], k) for k, ins in enumerate(instrs)
             if (t := _target(ins)) is not None and t < ins[0] and t in index}
    return sorted(found, key=lambda r: r[1] - r[0])


def in_flight_bytes(body) -> tuple[int, int]:
    """(peak, rounds) of a loop body followed through two passes (so loads for the next iteration count).
    peak: the most global bytes one warp has requested and not yet waited for -- an LDG until an
    instruction waits on its write scoreboard, LDGSTS bytes until `DEPBAR.LE SB0, N` retires their
    commit group (LDGDEPBAR). rounds: the longest chain of LDGs one iteration issues and waits for,
    each issued after waiting for the previous (an address loaded from the block table, then K)."""
    pending, level, groups, group, peak = [0] * 6, [0] * 6, [], 0, 0
    for second in (False, True):
        reached = rounds = 0  # chain depth this iteration has waited through
        for ins in body:
            for sb in range(6):
                if ins[4] >> sb & 1:
                    reached, pending[sb], level[sb] = max(reached, level[sb]), 0, 0
            base = ins[1].split(".")[0]
            if base == "DEPBAR" and (m := re.search(r"SB0,\s*0x([0-9a-f]+)", ins[2])):
                del groups[: max(0, len(groups) - int(m.group(1), 16))]
            elif base == "LDGDEPBAR":
                groups, group = groups + [group], 0
            elif base == "LDGSTS":
                group += load_bytes_per_warp(ins)
            elif base == "LDG" and ins[3] < 6:
                pending[ins[3]] += load_bytes_per_warp(ins)
                level[ins[3]] = max(level[ins[3]], reached + 1)
            if second:
                peak, rounds = max(peak, sum(pending) + sum(groups) + group), max(rounds, reached)
        level = [0] * 6  # loads left for the next iteration overlap it: they start no chain there
    return peak, rounds


def main_loop(instrs) -> dict | None:
    """The KV loop: the innermost loop holding >= half the global-load bytes of the heaviest loop and
    >= half the kernel's math (its HMMA / HGMMA, or FFMA without tensor cores), so a staging loop
    nested in the KV loop is not taken for it; then any loop nested in that one that loads and holds
    >= half its math (the KV loop inside a row tile loop whose own loads weigh more)."""
    tensor = any(i[1].startswith(("HMMA", "HGMMA")) for i in instrs)
    found, loads, math_ops = loops(instrs), [0], [0]
    for ins in instrs:
        loads.append(loads[-1] + load_bytes_per_warp(ins))
        math_ops.append(math_ops[-1] + ins[1].startswith(("HMMA", "HGMMA") if tensor else ("FFMA",)))
    spans = [(s, e, loads[e + 1] - loads[s], math_ops[e + 1] - math_ops[s]) for s, e in found]
    if not spans or max(x[2] for x in spans) == 0:
        return None
    heaviest = max(x[2] for x in spans)
    candidates = [x for x in spans if x[2] * 2 >= heaviest]
    s, e, nbytes, math = next((x for x in candidates if x[3] * 2 >= math_ops[-1]), candidates[0])
    # Then inward: a loop nested in the one found that loads from global memory and holds >= half its
    # math runs many times a pass of the outer one: it is the KV loop (a prefill row tile's own loads,
    # its Q rows and ALiBi slopes, outweigh one KV tile's over an fp8 cache at head 64; a staging loop
    # nested in a KV loop holds no math).
    while inner := next((x for x in spans if s <= x[0] and x[1] <= e and (x[0], x[1]) != (s, e)
                         and x[3] * 2 >= math > 0 and x[2] > 0), None):
        s, e, nbytes, math = inner
    body = instrs[s : e + 1]
    peak, rounds = in_flight_bytes(body)
    return dict(start=hex(instrs[s][0]), end=hex(instrs[e][0]), instructions=len(body), bytes_per_warp=nbytes,
                ldgsts_bytes_per_warp=sum(load_bytes_per_warp(i) for i in body if i[1].startswith("LDGSTS")),
                commit_groups=sum(i[1] == "LDGDEPBAR" for i in body), in_flight_bytes_per_warp=peak,
                dependent_load_rounds=rounds,
                nested_loops=sum(1 for a, b in found if s <= a and b <= e and (a, b) != (s, e)),
                instructions_per_byte=len(body) / nbytes, mix=mix(body))


# Kernels whose KV loop compiles a tile's work twice, an edge body and an interior one chosen per tile
# by a block-uniform branch (prefill.cuh tile_step): their tile path is reported.
TILE_PATH_FAMILIES = ("prefill_tc_pipelined_kernel",)


def tile_path(instrs, loop: dict) -> dict | None:
    """The instructions an interior tile issues per warp in the main loop, where the static loop
    count takes every body once (the edge body, the cold add-back) and a nested loop once whatever its
    trip count. The split is the loop's first predicated forward branch whose target follows an
    unpredicated forward jump (the interior body's end, jumping over the edge body to the latch): the
    path is the loop up to that branch, its fall-through up to the jump, and the latch from the jump's
    target to the back-edge; every branch inside taken as falling through, both sides counted.
    nested_loops: backward branches left on the path (their bodies counted once); None: no split."""
    start, end = int(loop["start"], 16), int(loop["end"], 16)
    index = {ins[0]: k for k, ins in enumerate(instrs)}
    for k in range(index[start], index[end] + 1):
        ins, t = instrs[k], _target(instrs[k])
        if not (ins[1] == "BRA" and ins[5] and t is not None and ins[0] < t <= end and t in index):
            continue
        jump = instrs[index[t] - 1]
        x = _target(jump)
        if jump[1] == "BRA" and not jump[5] and x is not None and t < x <= end and x in index:
            path = instrs[index[start] : index[t]] + instrs[index[x] : index[end] + 1]
            hmma = sum(i[1].startswith(("HMMA", "HGMMA")) for i in path)
            on_path = {i[0] for i in path}
            nested = sum(1 for i in path[:-1] if (b := _target(i)) is not None and b < i[0] and b in on_path)
            return dict(instructions=len(path), hmma=hmma, hmma_share=hmma / len(path), nested_loops=nested)
    return None


# ---- occupancy and ceilings --------------------------------------------------------------------
def occupancy(dev: Device, regs: int, threads: int, static_smem: int, dynamic_smem: int) -> dict:
    """Resident blocks / warps per SM and the limiting resource (CUDA occupancy calculator rules)."""
    smem = static_smem + dynamic_smem
    block_smem = smem + (0 if dev.reserved_in_static and static_smem >= dev.reserved_smem else dev.reserved_smem)
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / dev.reg_unit) * dev.reg_unit
    limits = {
        "warps": dev.max_threads // 32 // warps,
        "blocks": dev.max_blocks,
        "registers": (dev.regs_per_sm // regs_per_warp) // warps,
        "shared": dev.smem_per_sm // block_smem if smem <= dev.smem_per_block else 0,
    }
    blocks = min(limits.values())
    return dict(blocks=blocks, warps=blocks * warps, occupancy=blocks * warps * 32 / dev.max_threads,
                limiter=min(limits, key=limits.get))


def ceilings(dev: Device, loop: dict, resident_warps: int, latency_ns: float) -> dict:
    """Issue-rate and Little's-law bandwidth ceilings (bytes/s, and as a share of the DRAM peak)."""
    issue = dev.sms * dev.issue_per_clock * dev.clock_hz * loop["bytes_per_warp"] / loop["instructions"]
    little = dev.sms * resident_warps * loop["in_flight_bytes_per_warp"] / (latency_ns * 1e-9)
    rounds = loop["dependent_load_rounds"]
    chain = dev.sms * resident_warps * loop["bytes_per_warp"] / (rounds * latency_ns * 1e-9) if rounds else math.inf
    return dict(issue_bytes_s=issue, issue_share=issue / dev.dram_bytes_s, little_bytes_s=little,
                little_share=little / dev.dram_bytes_s, chain_bytes_s=chain, chain_share=chain / dev.dram_bytes_s,
                bound_share=min(issue, little, chain, dev.dram_bytes_s) / dev.dram_bytes_s)


# ---- the report --------------------------------------------------------------------------------
def kernel_rows(path: str, archs: list[str], latency_ns: float = DEFAULT_LATENCY_NS) -> list[dict]:
    """One row per (kernel, arch) of a cubin / fatbinary-carrying .so."""
    res, sass = {}, {}
    with ThreadPoolExecutor(4) as pool:  # the cuobjdump processes run side by side
        usages = {a: pool.submit(cuobjdump, path, "-res-usage", "-arch", a) for a in archs}
        dumps = {a: pool.submit(cuobjdump, path, "--dump-sass", "-arch", a) for a in archs}
        for arch in archs:
            res.update(parse_res_usage(usages[arch].result(), arch))
            sass.update(parse_sass(dumps[arch].result(), arch))
    names = demangle(sorted({m for _, m in res}))
    rows = []
    for (arch, mangled), usage in sorted(res.items(), key=lambda kv: (kv[0][0], names[kv[0][1]])):
        instrs = counted(sass.get((arch, mangled), []))
        family, args = split_name(names[mangled])
        row = dict(arch=arch, family=family, args=args, name=names[mangled], mangled=mangled, **usage,
                   mix=mix(instrs), path=path_of(family, args))
        row["hmma_share"] = (row["mix"].get("HMMA", 0) + row["mix"].get("HGMMA", 0)) / max(len(instrs), 1)
        launch, dev = launch_of(family, args), DEVICES.get(arch)
        if launch and dev:
            threads, dyn_smem, shape = launch
            row.update(threads=threads, dynamic_smem=dyn_smem, shape=shape,
                       **occupancy(dev, usage["regs"], threads, usage["shared"], dyn_smem))
        if any(a in family for a in ATTENTION) and (loop := main_loop(instrs)):
            row["loop"] = loop
            if family in TILE_PATH_FAMILIES and (tp := tile_path(instrs, loop)):
                loop["tile_path"] = tp
            if "warps" in row:
                row["loop"].update(ceilings(dev, loop, row["warps"], latency_ns))
        rows.append(row)
    return rows


def elf_section(path: str, name: str) -> bytes | None:
    """The bytes of a 64-bit little-endian ELF file's section (None: no such section, or not ELF)."""
    data = Path(path).read_bytes()
    if data[:5] != b"\x7fELF\x02":
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        header = shoff + i * shentsize
        at = names + struct.unpack_from("<I", data, header)[0]
        if data[at : data.index(b"\0", at)] == name.encode():
            offset, size = struct.unpack_from("<QQ", data, header + 0x18)
            return data[offset : offset + size]
    return None


def cached_rows(path: str, archs: list[str], latency_ns: float = DEFAULT_LATENCY_NS, keep: int = 4) -> list[dict]:
    """kernel_rows, kept under build/sass-cache by a digest of the device code (the .so's .nv_fatbin,
    or the whole file) and of this module (a changed model or launch table redoes it), so relinking
    the host code does not; the newest `keep` are kept."""
    code = elf_section(path, ".nv_fatbin") or Path(path).read_bytes()
    digest = hashlib.sha1(code + Path(__file__).read_bytes() + repr((archs, latency_ns)).encode()).hexdigest()[:16]
    cache = CACHE_DIR / f"{Path(path).name}-{digest}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    rows = kernel_rows(path, archs, latency_ns)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rows))
    for old in sorted(CACHE_DIR.glob("*.json"), key=os.path.getmtime)[:-keep]:
        old.unlink(missing_ok=True)
    return rows


def default_so() -> str:
    """The extension: paged_ops/_C*.so in the tree, else where the (editable) install put it."""
    found = sorted(glob.glob(str(ROOT / "paged_ops" / "_C*.so")))
    if not found:
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.find_spec("paged_ops._C")
        found = [spec.origin] if spec and spec.origin else []
    if not found:
        raise FileNotFoundError("paged_ops._C not built: run `make build` or pass --so")
    return found[0]


def _rng(vals, fmt="{}"):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


MIX_COLUMNS = ["HMMA", "HGMMA", "LDSM", "LDGSTS", "TMA", "LDG", "LDS", "STS", "STG", "PRMT", "CVT", "SHFL",
               "BAR", "MUFU", "IMAD/IADD", "BRANCH", "total"]


def markdown(rows: list[dict], full: bool = False) -> str:
    """Per family and arch (ranges over its instantiations), or per instantiation with `full`."""
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["family"], r.get("path", ""), r["arch"], r["args"])):
        label = r["family"] + (f" ({r['path']})" if r.get("path") and not full else "")
        groups.setdefault((r["arch"], label) + ((tuple(r["args"]),) if full else ()), []).append(r)
    head = ["arch", "kernel", "n", "regs", "stack", "local", "smem (st+dyn)", "threads", "occupancy",
            "HMMA %", *MIX_COLUMNS, "loop instr", "loop HMMA", "tile path instr", "tile path HMMA %", "tile path loops",
            "loop B/warp", "instr/B", "in flight B/warp",
            "rounds", "issue ceiling", "Little ceiling", "chain ceiling", "bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, rs in groups.items():
        loops_ = [r["loop"] for r in rs if "loop" in r]
        name = key[1] + (f"<{', '.join(key[2])}>" if full else "")
        cells = [key[0], name, str(len(rs)), _rng([r["regs"] for r in rs]), _rng([r["stack"] for r in rs]),
                 _rng([r["local"] for r in rs]), _rng([r["shared"] + r.get("dynamic_smem", 0) for r in rs]),
                 _rng([r.get("threads") for r in rs]), _rng([r.get("occupancy") for r in rs], "{:.1%}"),
                 _rng([100 * r["hmma_share"] for r in rs], "{:.1f}"),
                 *[_rng([r["mix"].get(c, 0) for r in rs]) for c in MIX_COLUMNS],
                 _rng([lp["instructions"] for lp in loops_]),
                 _rng([lp["mix"].get("HMMA", 0) + lp["mix"].get("HGMMA", 0) for lp in loops_]),
                 _rng([lp["tile_path"]["instructions"] for lp in loops_ if "tile_path" in lp]),
                 _rng([100 * lp["tile_path"]["hmma_share"] for lp in loops_ if "tile_path" in lp], "{:.1f}"),
                 _rng([lp["tile_path"]["nested_loops"] for lp in loops_ if "tile_path" in lp]),
                 _rng([lp["bytes_per_warp"] for lp in loops_]),
                 _rng([lp["instructions_per_byte"] for lp in loops_], "{:.3f}"),
                 _rng([lp["in_flight_bytes_per_warp"] for lp in loops_], "{:.0f}"),
                 _rng([lp["dependent_load_rounds"] for lp in loops_]),
                 _rng([lp.get("issue_share") for lp in loops_], "{:.0%}"),
                 _rng([lp.get("little_share") for lp in loops_], "{:.0%}"),
                 _rng([lp.get("chain_share") for lp in loops_ if lp.get("chain_share", math.inf) < math.inf], "{:.0%}"),
                 _rng([lp.get("bound_share") for lp in loops_], "{:.0%}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- decode calls: a kernel's bound at the grid its plan launches ---------------------------------
# The issue's decode shapes (bf16, head 128, block 16), and its batch-64 one over pages of 48 tokens
# (a block size no power of two, as hybrid models' attention pages are) and with heads of 96 (Phi-3's;
# narrower than the 16 lanes' 128): (label, num_seqs, seq_len, num_heads, num_kv_heads, block_size,
# head_size).
DECODE_SHAPES = [("64 x 4096, 32 / 8 heads", 64, 4096, 32, 8, 16, 128),
                 ("1 x 4096, 32 / 8 heads", 1, 4096, 32, 8, 16, 128),
                 ("1 x 4096, 64 / 8 heads", 1, 4096, 64, 8, 16, 128),
                 ("1 x 32768, 32 / 8 heads", 1, 32768, 32, 8, 16, 128),
                 ("64 x 4096, 32 / 8 heads, block 48", 64, 4096, 32, 8, 48, 128),
                 ("64 x 4096, 32 / 8 heads, head 96", 64, 4096, 32, 8, 16, 96)]
PLAN_FIELDS = ("grid_x", "grid_y", "grid_z", "threads", "split", "partition_size", "heads_per_thread",
               "tile_tokens", "smem", "blocks_per_sm", "fast_path", "score_mods",
               "cluster_blocks", "tpt")  # csrc/cuda_emu/backend.cpp decode_plan


def decode_plan(num_seqs: int, seq_len: int, num_heads: int, num_kv_heads: int, sms: int, head: int = 128,
                block: int = 16) -> dict | None:
    """plan_decode's launch (csrc/kernels/plan.h) for a bf16 decode call on a device of `sms` SMs, by the
    emulator's hook (None when the cuda_emu backend is not built). The caches are one block: the plan
    reads only shapes (the block table's width bounds the context)."""
    import torch  # noqa: PLC0415

    import paged_ops  # noqa: F401, PLC0415

    if not hasattr(torch.ops, "paged_cuda_emu_test") or not hasattr(torch.ops.paged_cuda_emu_test, "decode_plan"):
        return None
    t = torch.ops.paged_cuda_emu_test
    bf = torch.bfloat16
    cache = torch.zeros(1, block, num_kv_heads, head, dtype=bf)
    query = torch.zeros(num_seqs, num_heads, head, dtype=bf)
    tables = torch.zeros(num_seqs, (seq_len + block - 1) // block, dtype=torch.int32)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    before = t.set_num_sms(sms)
    try:
        plan = t.decode_plan(torch.empty_like(query), query, cache, cache, tables, lens, [0] * 5)
    finally:
        t.set_num_sms(before)
    return dict(zip(PLAN_FIELDS, plan))


def call_bound(row: dict, plan: dict, num_seqs: int, seq_len: int, num_heads: int, num_kv_heads: int,
               dev: Device, latency_ns: float, head: int = 128, elem: int = 2,
               exchange_ns: float = DEFAULT_EXCHANGE_NS) -> dict:
    """The share of the DRAM peak one decode call reaches by the static model, at its plan's grid:
    - resident warps per SM: the kernel's occupancy, or fewer when the grid is smaller
      (CTAs x warps / SMs); the Little and chain ceilings scale with them, the issue ceiling not;
    - a head narrower than its lanes (96 on the fast loop's 16: 8 x TPT = 128 elements) leaves the
      copies of the lanes past it idle, so every ceiling moves head / (8 x TPT) of the loop's static
      bytes (decode.cuh copy_tile_rows_fixed);
    - bytes: the KV cache (K and V rows of every token) and, split, the partials the kernel writes
      and the reduce kernel reads back (2 x rows x heads x partitions x (Dv + 2) floats); q and out are
      left out;
    - time: bytes at the steady-state bound, plus one latency per wave of CTAs (the first tiles of
      a wave wait a whole latency before any byte arrives) and one for the reduce kernel (its loads
      wait for the decode kernel's stores), or, where the plan merges in thread-block clusters
      (plan["cluster_blocks"] > 1: no partials in global memory, no reduce kernel), exchange_ns for
      the cluster's barriers and shared-memory loads; launch gaps are left out;
    - latency_ceiling: the share with the same latencies at a 100% steady bound and no partial bytes."""
    ctas = plan["grid_x"] * plan["grid_y"] * plan["grid_z"]
    warps_per_cta = plan["threads"] // 32
    warps = min(row["warps"], ctas * warps_per_cta / dev.sms)
    lp = row["loop"]
    fast = row.get("args", [""] * 5)[4] == "true"  # decode_kernel<T, KV, TPT, G, kFast, kScoreMods>
    fill = min(1.0, head / (8 * int(row["args"][2]))) if fast else 1.0
    steady = min(lp["issue_share"] * fill, lp["little_share"] * fill * warps / row["warps"],
                 lp["chain_share"] * fill * warps / row["warps"], 1.0)
    kv = num_seqs * num_kv_heads * seq_len * 2 * head * elem
    cluster = plan.get("cluster_blocks", 0) > 1
    reduce = bool(plan["split"]) and not cluster
    workspace = 2 * num_seqs * num_heads * plan["grid_z"] * (head + 2) * 4 if reduce else 0
    waves = math.ceil(ctas / max(row["blocks"] * dev.sms, 1))
    latencies = latency_ns * 1e-9 * (waves + reduce) + (exchange_ns * 1e-9 if cluster else 0.0)
    seconds = (kv + workspace) / (steady * dev.dram_bytes_s) + latencies
    # What the latencies alone leave: the share at a 100% steady bound with no partial bytes. A
    # split call's second latency is the reduce kernel's (its loads wait for the partials' stores), a
    # clustered one's the exchange, so no plan passes latency_ceiling whatever its KV loop does.
    kv_seconds = kv / dev.dram_bytes_s
    return dict(ctas=ctas, warps_per_sm=warps, steady_share=steady, kv_bytes=kv, workspace_bytes=workspace,
                waves=waves, seconds=seconds, share=kv_seconds / seconds,
                latency_ceiling=kv_seconds / (kv_seconds + latencies))


def decode_call_rows(rows: list[dict], latency_ns: float = DEFAULT_LATENCY_NS,
                     exchange_ns: float = DEFAULT_EXCHANGE_NS) -> list[dict]:
    """call_bound of DECODE_SHAPES on an H200, for the sm_90 decode_kernel the plan launches."""
    dev, out = DEVICES["sm_90"], []
    for label, seqs, ctx, heads, kv_heads, block, head in DECODE_SHAPES:
        plan = decode_plan(seqs, ctx, heads, kv_heads, dev.sms, head=head, block=block)
        if plan is None:
            return []
        fast, mods = bool(plan["fast_path"]), bool(plan["score_mods"] or not plan["fast_path"])
        args = ["__nv_bfloat16", "__nv_bfloat16", str(plan["tpt"]), str(plan["heads_per_thread"]), str(fast).lower(),
                str(mods).lower()]
        row = next((r for r in rows if r["arch"] == "sm_90" and r["family"] == "decode_kernel" and r["args"] == args
                    and "warps" in r and "issue_share" in r.get("loop", {})), None)
        if row:
            out.append(dict(shape=label, kernel=f"decode_kernel<{', '.join(args)}>", plan=plan,
                            **call_bound(row, plan, seqs, ctx, heads, kv_heads, dev, latency_ns, head=head,
                                         exchange_ns=exchange_ns)))
    return out


CALL_NOTE = ("Decode calls: the sm_90 kernel their plan (csrc/kernels/plan.h, by the emulator's decode_plan on "
             "132 SMs) launches, at the grid it launches: resident warps from the grid, the KV bytes plus the "
             "split-KV partials written and read back, one latency per wave and one for the reduce kernel, or "
             f"for a plan in thread-block clusters (partition 'x n, cluster') no partials in memory and "
             f"{DEFAULT_EXCHANGE_NS:.0f} ns (assumed) for the cluster's exchange "
             "(latencies alone allow: the share at a 100% steady bound with those latencies and no partials) "
             "(bench/sass.py call_bound).\n")


def call_markdown(calls: list[dict]) -> str:
    head = ["decode call (bf16; head 128, block 16 unless named)", "kernel", "CTAs", "partition", "warps / SM", "steady bound",
            "workspace / KV bytes", "waves", "share of 4.8 TB/s", "latencies alone allow"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in calls:
        part = f"{c['plan']['partition_size']} x {c['plan']['grid_z']}" if c["plan"]["split"] else "one pass"
        if c["plan"].get("cluster_blocks", 0) > 1:
            part += ", cluster"
        lines.append("| " + " | ".join([c["shape"], c["kernel"], str(c["ctas"]), part, f"{c['warps_per_sm']:.1f}",
                                        f"{c['steady_share']:.0%}", f"{c['workspace_bytes'] / c['kv_bytes']:.1%}",
                                        str(c["waves"]), f"{c['share']:.0%}", f"{c['latency_ceiling']:.0%}"]) + " |")
    return "\n".join(lines) + "\n"


def model_note(latency_ns: float) -> str:
    h, a = DEVICES["sm_90"], DEVICES["sm_80"]
    return (f"Ceilings are static estimates (bench/sass.py's docstring), shares of the DRAM peak: sm_90 code on an "
            f"{h.name} ({h.sms} SMs, {h.clock_hz / 1e9:.2f} GHz, {h.dram_bytes_s / 1e12:.1f} TB/s), sm_80 on an "
            f"{a.name} ({a.sms}, {a.clock_hz / 1e9:.2f}, {a.dram_bytes_s / 1e12:.3f}). Issue = SMs x 4 warp-instr/clk "
            "x clock x loop bytes per warp / loop instructions; Little = SMs x resident warps x bytes in flight per "
            f"warp / {latency_ns:.0f} ns (an assumed latency); chain = SMs x resident warps x loop bytes / (rounds of "
            "dependent loads x latency). Occupancy and smem at the launch shapes of "
            "bench/sass.py's LAUNCH table; bound = min(issue, Little, chain, 100%).\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--so", help="extension (.so) or cubin; default paged_ops/_C*.so")
    ap.add_argument("--arch", default="sm_80,sm_90")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--full", action="store_true", help="one row per instantiation, not per family")
    ap.add_argument("--latency-ns", type=float, default=DEFAULT_LATENCY_NS)
    ap.add_argument("--exchange-ns", type=float, default=DEFAULT_EXCHANGE_NS,
                    help="a thread-block cluster's merge of its partials (decode calls)")
    ap.add_argument("--anchors", action="store_true", help="FlashInfer / FlashAttention-2, compiled here")
    ap.add_argument("--flashinfer", default=os.environ.get("FLASHINFER_DATA"), help="flashinfer/data dir")
    ap.add_argument("--flash-attn", default=os.environ.get("FLASH_ATTN_SRC"), help="csrc/flash_attn/src dir")
    ap.add_argument("--cccl", default=os.environ.get("CCCL_INCLUDE"), help="CCCL >= 3.1 include dir")
    a = ap.parse_args(argv)
    archs = a.arch.split(",")
    if a.anchors:
        from bench.sass_anchor_build import build_anchors  # noqa: PLC0415

        paths = build_anchors(archs, flashinfer=a.flashinfer, flash_attn=a.flash_attn, cccl=a.cccl)
        rows = [r for p in paths for r in kernel_rows(p, sorted(set(archs) & archs_in(p)), a.latency_ns)]
    else:
        so = a.so or default_so()
        rows = cached_rows(so, sorted(set(archs) & archs_in(so)), a.latency_ns)
    table = markdown(rows, a.full) + "\n" + model_note(a.latency_ns)
    calls = [] if a.anchors else decode_call_rows(rows, a.latency_ns, a.exchange_ns)
    if calls:
        table += "\n" + call_markdown(calls) + "\n" + CALL_NOTE
    print(table)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(model=__doc__, latency_ns=a.latency_ns, rows=rows, calls=calls),
                                           indent=1))
    if a.md:
        Path(a.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

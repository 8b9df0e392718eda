"""Compile the attention kernels ahead of time for a CUDA architecture, without a GPU.

The interpreter checks what the kernels compute, not whether they lower for a real GPU,
fit its shared memory, or spill registers. Triton can compile for any target with the
ptxas it ships, so this module compiles each kernel with the JIT's usual specialization
(16-byte aligned pointers, strides divisible by 16) and reports its resources::

    python -m paged_ops.triton.aot --arch 90          # the default (untuned) configs
    python -m paged_ops.triton.aot --arch 80 --json

Must run without TRITON_INTERPRET (the kernels have to be JIT functions, not interpreted).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ._common import INTERPRET, compute_dtype, dot_precision, fp8_format, head_pad, next_pow2, tl_dtype
from . import decode, prefill

# Shared memory per block on the architectures we care about (opt-in maximum).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _arg_type(name: str, dtype: torch.dtype, cache_fp8: bool) -> str:
    # The attention kernels' argument naming convention decides the type of every argument.
    if name in ("out_ptr", "q_ptr"):
        return "*" + _TYPE_NAMES[dtype]
    if name in ("k_cache_ptr", "v_cache_ptr"):
        return "*u8" if cache_fp8 else "*" + _TYPE_NAMES[dtype]
    if name in ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"):
        return "*i32"
    if name.endswith("_ptr"):
        return "*fp32"
    if name == "qk_scale_log2":
        return "fp32"
    return "i32"


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) from ptxas -v."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch_name}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0


def compile_kernel(kernel, constexprs: dict, dtype: torch.dtype, cache_fp8: bool, arch: int,
                   num_warps: int, num_stages: int) -> dict:
    """Compile one specialization; returns {"shared", "registers", "spills"} (bytes, count, bytes)."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype, cache_fp8) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (signature[n].startswith("*") or n.startswith("stride"))}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    registers, spills = _ptxas_usage(compiled.asm["ptx"], arch)
    return {"shared": compiled.metadata.shared, "registers": registers, "spills": spills}


def _common_constexprs(dtype, cache_dtype, head_size, group, block_size) -> dict:
    cdtype = compute_dtype(dtype)  # not interpreting here: bf16 stays bf16
    return dict(GROUP_SIZE=group, HEAD_SIZE=head_size, KV_BLOCK_SIZE=block_size,
                K_PER_HEAD=True, V_PER_HEAD=False, FP8_FORMAT=fp8_format(cache_dtype),
                COMPUTE_DTYPE=tl_dtype(cdtype), DOT_PRECISION=dot_precision(cdtype), HEAD_PAD=head_pad(head_size))


def decode_report(dtype, cache_dtype, head_size, group, arch, block_size=16, config=None, split=True) -> dict:
    config = config or decode.default_config(head_size, dtype)
    constexprs = dict(_common_constexprs(dtype, cache_dtype, head_size, group, block_size), SPLIT=split,
                      BLOCK_M=max(16, next_pow2(group)), BLOCK_N=config["BLOCK_N"])
    return compile_kernel(decode._decode_kernel, constexprs, dtype, cache_dtype != dtype, arch,
                          config["num_warps"], config["num_stages"])


def prefill_report(dtype, cache_dtype, head_size, group, arch, block_size=16, config=None, causal=True) -> dict:
    config = config or prefill.default_config(head_size, dtype)
    constexprs = dict(_common_constexprs(dtype, cache_dtype, head_size, group, block_size), CAUSAL=causal,
                      BLOCK_M=max(config["BLOCK_M"], next_pow2(group)), BLOCK_N=config["BLOCK_N"])
    return compile_kernel(prefill._prefill_kernel, constexprs, dtype, cache_dtype != dtype, arch,
                          config["num_warps"], config["num_stages"])


def default_config_reports(arch: int, quick: bool = False) -> list[dict]:
    """Resources of the default config of both attention kernels over dtypes and head sizes."""
    heads = (128,) if quick else (64, 80, 128, 256)
    dtypes = (torch.float16, torch.float32) if quick else (torch.float16, torch.bfloat16, torch.float32)
    rows = []
    for head_size in heads:
        for dtype in dtypes:
            # fp8 caches are read as bytes (no Triton fp8 types), so they compile on any arch
            caches = [dtype] + ([torch.float8_e4m3fn] if dtype != torch.float32 else [])
            for cache_dtype in caches:
                for op, report in (("decode", decode_report), ("prefill", prefill_report)):
                    usage = report(dtype, cache_dtype, head_size, 4, arch)
                    rows.append({"op": op, "dtype": str(dtype), "cache": str(cache_dtype),
                                 "head_size": head_size, **usage})
    return rows


def main(argv=None) -> int:
    if INTERPRET:
        print("unset TRITON_INTERPRET: the kernels must be JIT functions to compile them", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--quick", action="store_true", help="head 128, fp16/fp32 only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = default_config_reports(args.arch, args.quick)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"sm_{args.arch} {r['op']:8s} {r['dtype']:15s} cache {r['cache']:20s} head {r['head_size']:3d}: "
                  f"smem {r['shared']:6d} B, {r['registers']:3d} regs, spills {r['spills']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())

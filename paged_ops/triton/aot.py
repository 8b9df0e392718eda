"""Compile the Triton kernels ahead of time for a CUDA architecture, without a GPU.

The interpreter checks what the kernels compute, not whether they lower for a real GPU, fit
its shared memory, or spill registers. Triton compiles for any target with the ptxas it
ships, so this module runs the backend's host code on small CPU tensors with every kernel
replaced by a recorder (nothing is launched), then compiles each recorded launch exactly as
the JIT would on a GPU: the same binder turns the real arguments into the specialization
(pointer alignment, integers equal to 1 or divisible by 16, ``do_not_specialize``), so the
divisibility hints come from real strides (a head size of 72 gives strides that are not
multiples of 16), and the same key tells how many variants the JIT would compile::

    python -m paged_ops.triton.aot --arch 90          # default configs, resources per kernel
    python -m paged_ops.triton.aot --arch 80 --json

Must run without TRITON_INTERPRET (the kernels have to be JIT functions, not interpreted).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ._common import INTERPRET, Variants
from . import cache, decode, fp8, prefill

# Shared memory per block on the architectures we care about (opt-in maximum).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

# Every kernel of the backend, by the module attribute its host code launches it through.
KERNELS = {
    "decode": (decode, "_decode_kernel"),
    "decode_reduce": (decode, "_decode_reduce_kernel"),
    "prefill": (prefill, "_prefill_kernel"),
    "reshape_and_cache": (cache, "_reshape_and_cache_kernel"),
    "copy_blocks": (cache, "_copy_blocks_kernel"),
    "quantize_fp8": (fp8, "_quantize_kernel"),
    "dequantize_fp8": (fp8, "_dequantize_kernel"),
}


@dataclass
class Launch:
    """One recorded kernel launch: the kernel (a JITFunction) and its arguments."""
    name: str
    kernel: object
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a kernel while host code runs: ``kernel[grid](...)`` records, launches nothing."""

    def __init__(self, name, kernel, sink):
        self.name, self.kernel, self.sink = name, kernel, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append(Launch(self.name, self.kernel, args, kwargs))


@contextlib.contextmanager
def record_launches(sms: int = 132):
    """Yields a list that collects the launches of the backend's host code; ``sms`` is the SM
    count the split heuristic sees (the host tensors are on CPU)."""
    if INTERPRET:
        raise RuntimeError("unset TRITON_INTERPRET: the kernels must be JIT functions to compile them")
    launches: list[Launch] = []
    saved = [(module, attr, getattr(module, attr)) for module, attr in KERNELS.values()]
    saved_sms = decode.num_sms
    try:
        for name, (module, attr) in KERNELS.items():
            setattr(module, attr, _Recorder(name, getattr(module, attr), launches))
        decode.num_sms = lambda device: sms
        yield launches
    finally:
        for module, attr, kernel in saved:
            setattr(module, attr, kernel)
        decode.num_sms = saved_sms


def _backend(arch: int):
    return make_backend(GPUTarget("cuda", arch, 32))


def specialize(launch: Launch, arch: int = 90):
    """(JIT cache key, ASTSource, options) of a launch, as the JIT would build them on a GPU."""
    kernel = launch.kernel
    backend = _backend(arch)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args,
                                                              specialization, options)
    key = (launch.name, str(specialization), str(sorted(options.__dict__.items())))
    return key, ASTSource(kernel, signature, constexprs, attrs), options


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


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile one recorded launch for ``sm_<arch>``: {"shared", "registers", "spills"}."""
    _, src, options = specialize(launch, arch)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], arch)
    return {"shared": compiled.metadata.shared, "registers": registers, "spills": spills}


# ---------------------------------------------------------------------------------------------
# The launches of one op call on realistic (small, CPU) tensors.

NUM_KV_HEADS, GROUP, BLOCK_SIZE = 2, 4, 16


def _cache(num_blocks, head_size, dtype, num_kv_heads=NUM_KV_HEADS):
    # [num_blocks, block_size, num_kv_heads, head_size], contiguous: the engine's layout.
    return torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_size).to(dtype)


def _caches(head_size, cache_dtype, value_head_size=None, num_kv_heads=NUM_KV_HEADS, value_in_key=False):
    """(key_cache, value_cache): values of value_head_size (default head_size); value_in_key:
    value_cache = key_cache[..., :value_head_size], absorbed MLA's latent view."""
    kc = _cache(4, head_size, cache_dtype, num_kv_heads)
    vs = value_head_size or head_size
    return kc, kc[..., :vs] if value_in_key else _cache(4, vs, cache_dtype, num_kv_heads)


def _scales(cache_dtype, num_kv_heads=NUM_KV_HEADS):
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.ones(num_kv_heads), torch.ones(1)  # per-head k, per-tensor v: both code paths
    return None, None


def _variants(spec: str, num_heads: int):
    """A _common.Variants from a '+'-joined spec of softcap, window, sinks, alibi, lse ('' or
    'all' for none / every one); the window is 4096 keys, the tensors are small CPU tensors."""
    parts = {"softcap", "window", "sinks", "alibi", "lse"} if spec == "all" else set(filter(None, spec.split("+")))
    heads = torch.zeros(num_heads)
    return Variants(softcap=30.0 if "softcap" in parts else 0.0, window_left=4095 if "window" in parts else -1,
                    sinks=heads if "sinks" in parts else None, alibi_slopes=heads if "alibi" in parts else None,
                    lse=None)  # lse: a tensor of the call's rows, made by the launch helpers


def decode_launches(dtype, cache_dtype, head_size, num_seqs, seq_len, table_width=None,
                    config=None, sms=132, variants: str = "", batch_invariant: bool = False,
                    value_head_size=None, num_kv_heads=NUM_KV_HEADS, group=GROUP,
                    value_in_key=False) -> list[Launch]:
    """Launches of one decode_attention call (default config unless ``config``): the split
    heuristic sees ``sms`` SMs, so small batches record the split kernel and the reduce.
    ``variants``: see _variants; ``batch_invariant``: the row-wise path (decode.run_rows);
    value_head_size, num_kv_heads, group, value_in_key: MLA's shapes (_caches)."""
    # Nothing runs: a few blocks suffice, the table width alone sets the length bound.
    width = table_width or -(-seq_len // BLOCK_SIZE)
    kc, vc = _caches(head_size, cache_dtype, value_head_size, num_kv_heads, value_in_key)
    q = torch.zeros(num_seqs, num_kv_heads * group, head_size, dtype=dtype)
    out = torch.empty(num_seqs, num_kv_heads * group, vc.shape[3], dtype=dtype)
    table = torch.zeros(num_seqs, width, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    k_scale, v_scale = _scales(cache_dtype, num_kv_heads)
    v = _with_lse(_variants(variants, q.shape[1]), variants, q)
    with record_launches(sms) as launches:
        if batch_invariant:
            decode.run_rows(out, q, kc, vc, table, seq_lens,
                            torch.arange(num_seqs + 1, dtype=torch.int32), True, head_size ** -0.5, k_scale, v_scale,
                            v, config)
        else:
            decode.run_decode(out, q, kc, vc, table, seq_lens, head_size ** -0.5, k_scale, v_scale,
                              config or decode.default_config(head_size, dtype, cache_dtype, v, vc.shape[3]),
                              variants=v)
    return launches


def _with_lse(v: Variants, spec: str, q: torch.Tensor) -> Variants:
    if spec == "all" or "lse" in spec.split("+"):
        return dataclasses.replace(v, lse=torch.zeros(q.shape[0], q.shape[1]))
    return v


def prefill_launches(dtype, cache_dtype, head_size, q_lens, seq_lens, table_width=None, config=None,
                     causal=True, variants: str = "", batch_invariant: bool = False, value_head_size=None,
                     num_kv_heads=NUM_KV_HEADS, group=GROUP, value_in_key=False) -> list[Launch]:
    width = table_width or -(-max(seq_lens) // BLOCK_SIZE)
    kc, vc = _caches(head_size, cache_dtype, value_head_size, num_kv_heads, value_in_key)
    q = torch.zeros(sum(q_lens), num_kv_heads * group, head_size, dtype=dtype)
    out = torch.empty(sum(q_lens), num_kv_heads * group, vc.shape[3], dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    k_scale, v_scale = _scales(cache_dtype, num_kv_heads)
    v = _with_lse(_variants(variants, q.shape[1]), variants, q)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    with record_launches() as launches:
        if batch_invariant:
            decode.run_rows(out, q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32), cu,
                            causal, head_size ** -0.5, k_scale, v_scale, v)
        else:
            prefill.run_prefill(out, q, kc, vc, table, cu, torch.tensor(seq_lens, dtype=torch.int32),
                                max(q_lens), head_size ** -0.5, causal, k_scale, v_scale,
                                config or prefill.default_config(head_size, dtype, cache_dtype, v, vc.shape[3]), v)
    return launches


# MLA's shapes (#24 item 1): DeepSeek-V2/V3's absorbed decode (one latent KV head of 512 + 64,
# the value its first 512 columns, 16 or 128 query heads) and non-absorbed prefill (keys 128 + 64,
# values 128, one KV head per query head), as the keyword arguments of decode_launches /
# prefill_launches.
MLA_ABSORBED = {"head_size": 576, "value_head_size": 512, "num_kv_heads": 1, "value_in_key": True}
MLA_PREFILL = {"head_size": 192, "value_head_size": 128, "num_kv_heads": 8, "group": 1}


def mla_matrix_launches(dtypes=(torch.bfloat16, torch.float16, torch.float32),
                        fp8=(torch.float8_e4m3fn,)) -> list[tuple[dict, Launch]]:
    """The MLA shapes' default-config launches: absorbed decode at 16 and 128 heads, split (batch
    1, long context: the reduce too) and unsplit (a full batch), and an absorbed prefill at 16
    heads; DeepSeek's 192 / 128 prefill and its decode rows; each over query dtypes x {same
    cache, fp8} (fp8 with 16-bit queries), plus every variant at once and the batch-invariant
    path on the bf16 shapes. (case, launch) pairs; cases carry value_head_size and heads."""
    rows = []

    def add(dtype, cache_dtype, shape, heads, launches, spec="none", bi=False):
        case = {"dtype": str(dtype), "cache": str(cache_dtype), "head_size": shape["head_size"],
                "value_head_size": shape["value_head_size"], "heads": heads, "variants": spec,
                "batch_invariant": bi}
        rows.extend((case, launch) for launch in launches)

    for dtype in dtypes:
        for cache_dtype in (dtype, *(fp8 if dtype != torch.float32 else ())):
            for heads in (16, 128):
                shape = dict(MLA_ABSORBED, group=heads)
                add(dtype, cache_dtype, MLA_ABSORBED, heads,
                    decode_launches(dtype, cache_dtype, num_seqs=1, seq_len=1 << 15, **shape)
                    + decode_launches(dtype, cache_dtype, num_seqs=256, seq_len=64, **shape))
            add(dtype, cache_dtype, MLA_ABSORBED, 16,
                prefill_launches(dtype, cache_dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5],
                                 **dict(MLA_ABSORBED, group=16)))
            add(dtype, cache_dtype, MLA_PREFILL, 8,
                prefill_launches(dtype, cache_dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5], **MLA_PREFILL)
                + decode_launches(dtype, cache_dtype, num_seqs=1, seq_len=1 << 15, **MLA_PREFILL))
    dtype = torch.bfloat16
    shape = dict(MLA_ABSORBED, group=16)
    add(dtype, dtype, MLA_ABSORBED, 16,
        decode_launches(dtype, dtype, num_seqs=1, seq_len=1 << 15, variants="all", **shape)
        + prefill_launches(dtype, dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5], variants="all", **shape), "all")
    add(dtype, dtype, MLA_ABSORBED, 16,
        decode_launches(dtype, dtype, num_seqs=3, seq_len=300, variants="all", batch_invariant=True, **shape),
        "all", True)
    add(dtype, dtype, MLA_PREFILL, 8,
        prefill_launches(dtype, dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5], variants="all", **MLA_PREFILL)
        + prefill_launches(dtype, dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5], variants="all",
                           batch_invariant=True, **MLA_PREFILL), "all")
    return rows


def cache_launches(dtype, cache_dtype, head_size, num_tokens=3) -> list[Launch]:
    """reshape_and_cache (and, for fp8 caches, quantize/dequantize) launches."""
    kc, vc = _cache(4, head_size, cache_dtype), _cache(4, head_size, cache_dtype)
    k = torch.zeros(num_tokens, NUM_KV_HEADS, head_size, dtype=dtype)
    k_scale, v_scale = _scales(cache_dtype)
    with record_launches() as launches:
        cache.reshape_and_cache(k, k.clone(), kc, vc, torch.arange(num_tokens), k_scale, v_scale)
        cache.copy_blocks([kc], [vc], torch.tensor([[0, 1]]))
        if k_scale is not None:
            fp8.quantize_fp8(torch.empty_like(k, dtype=cache_dtype), k, v_scale)
            fp8.dequantize_fp8(k, torch.empty_like(k, dtype=cache_dtype), v_scale)
    return launches


def matrix_launches(dtypes=(torch.float32, torch.float16, torch.bfloat16),
                    cache_kinds=("same", torch.float8_e4m3fn, torch.float8_e5m2),
                    head_sizes=(64, 72, 128, 256)) -> list[tuple[dict, Launch]]:
    """The compile matrix: every kernel's default-config launches over query dtype x cache dtype
    x head size, with the decode split path at the largest split count the heuristic chooses
    (batch 1, long context) and the unsplit path (a full batch). (case, launch) pairs."""
    rows = []
    for dtype in dtypes:
        for kind in cache_kinds:
            cache_dtype = dtype if kind == "same" else kind
            for head_size in head_sizes:
                case = {"dtype": str(dtype), "cache": str(cache_dtype), "head_size": head_size}
                launches = (decode_launches(dtype, cache_dtype, head_size, num_seqs=1, seq_len=1 << 17)
                            + decode_launches(dtype, cache_dtype, head_size, num_seqs=256, seq_len=64)
                            + prefill_launches(dtype, cache_dtype, head_size, [1, 70, 5], [40, 300, 5])
                            + cache_launches(dtype, cache_dtype, head_size))
                rows += [(case, launch) for launch in launches]
    return rows


def variant_matrix_launches() -> list[tuple[dict, Launch]]:
    """A covering subset of the attention variants (constexpr flags) for the compile matrix:
    every variant at once (the most registers) over query dtype x {same, e4m3fn} cache x head
    {64, 128, 256}, plus head 72 (unaligned rows); each variant alone at fp16 / head 128; and
    the batch-invariant row-wise path (decode kernel over prefill rows, always split + reduce)
    with every variant, for fp16/bf16/fp32 at heads 64, 128, 256."""
    rows = []

    def add(dtype, cache_dtype, head_size, spec, bi_only=False):
        case = {"dtype": str(dtype), "cache": str(cache_dtype), "head_size": head_size,
                "variants": spec or "none", "batch_invariant": bi_only}
        if bi_only:
            launches = prefill_launches(dtype, cache_dtype, head_size, [1, 70, 5], [40, 300, 5], variants=spec,
                                        batch_invariant=True)
        else:
            launches = (decode_launches(dtype, cache_dtype, head_size, num_seqs=1, seq_len=1 << 17, variants=spec)
                        + decode_launches(dtype, cache_dtype, head_size, num_seqs=256, seq_len=64, variants=spec)
                        + prefill_launches(dtype, cache_dtype, head_size, [1, 70, 5], [40, 300, 5], variants=spec))
        rows.extend((case, launch) for launch in launches)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            for head_size in (64, 128, 256):
                add(dtype, cache_dtype, head_size, "all")
        for head_size in (64, 128, 256):
            add(dtype, dtype, head_size, "all", bi_only=True)
    add(torch.float16, torch.float16, 72, "all")
    for spec in ("softcap", "window", "sinks", "alibi", "lse"):
        add(torch.float16, torch.float16, 128, spec)
    return rows


def distinct_specializations(rows, arch: int) -> dict:
    """{JIT key: (case, launch)}: each distinct specialization once (many cases share one)."""
    out = {}
    for case, launch in rows:
        out.setdefault(specialize(launch, arch)[0], (case, launch))
    return out


_ITEMS: list = []  # compile_matrix's work list, inherited by forked workers (launches do not pickle)


def _compile_row(index: int) -> dict:
    arch, case, launch = _ITEMS[index]
    try:
        usage = compile_launch(launch, arch)
    except Exception as e:  # reported, and the caller's check fails on it
        usage = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    return {"arch": arch, "kernel": launch.name, **case, **usage}


def compile_matrix(archs=(80, 90), workers: int | None = None, variants: bool = False, mla: bool = False,
                   **matrix) -> list[dict]:
    """Compile every distinct specialization of the matrix (``variants``: variant_matrix_launches
    instead; ``mla``: mla_matrix_launches) for every arch, in parallel processes."""
    rows = (variant_matrix_launches() if variants else mla_matrix_launches(**matrix) if mla
            else matrix_launches(**matrix))
    items = [(arch, case, launch) for arch in archs
             for case, launch in distinct_specializations(rows, arch).values()]
    _ITEMS[:] = items
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [_compile_row(i) for i in range(len(items))]
    import concurrent.futures
    import multiprocessing
    # fork: the children inherit the work list and the imported kernels.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile_row, range(len(items)), chunksize=1))


def default_config_reports(arch: int, quick: bool = False) -> list[dict]:
    """Resources of the default config of both attention kernels (decode's split kernel and
    prefill) over dtypes and head sizes, fp8 e4m3 caches included."""
    heads = (128,) if quick else (64, 72, 128, 256)
    dtypes = (torch.float16, torch.float32) if quick else (torch.float16, torch.bfloat16, torch.float32)
    rows = []
    for head_size in heads:
        for dtype in dtypes:
            caches = [dtype] + ([torch.float8_e4m3fn] if dtype != torch.float32 or not quick else [])
            for cache_dtype in caches:
                decode_split = decode_launches(dtype, cache_dtype, head_size, num_seqs=1, seq_len=4096)[0]
                prefill_run = prefill_launches(dtype, cache_dtype, head_size, [1, 70, 5], [40, 300, 5])[0]
                for op, launch in (("decode", decode_split), ("prefill", prefill_run)):
                    rows.append({"op": op, "dtype": str(dtype), "cache": str(cache_dtype),
                                 "head_size": head_size, **compile_launch(launch, arch)})
    if not quick:  # MLA: absorbed decode 576 / 512 (one latent KV head, 16 heads), prefill 192 / 128
        for dtype in dtypes:
            decode_split = decode_launches(dtype, dtype, num_seqs=1, seq_len=4096, **dict(MLA_ABSORBED, group=16))[0]
            prefill_run = prefill_launches(dtype, dtype, q_lens=[1, 70, 5], seq_lens=[40, 300, 5], **MLA_PREFILL)[0]
            for op, launch, shape in (("decode", decode_split, MLA_ABSORBED), ("prefill", prefill_run, MLA_PREFILL)):
                rows.append({"op": op, "dtype": str(dtype), "cache": str(dtype), "head_size": shape["head_size"],
                             "value_head_size": shape["value_head_size"], **compile_launch(launch, arch)})
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
            head = f"{r['head_size']:3d}" + (f"/{r['value_head_size']}" if "value_head_size" in r else "")
            print(f"sm_{args.arch} {r['op']:8s} {r['dtype']:15s} cache {r['cache']:20s} head {head:7s}: "
                  f"smem {r['shared']:6d} B, {r['registers']:3d} regs, spills {r['spills']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())

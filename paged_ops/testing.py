"""Test utilities for paged ops (as ``torch.testing`` is for torch): random paged batches, NaN
poisoning, the error budget and its assertions.

Every correctness check of the project — the test suite, ``python -m paged_ops.demo``, the
benchmarks' input sets (bench/kernels.py, bench/triton_bench.py, bench/decode_table.py) — builds its
batches here, so "a random paged batch" and "close enough" mean one
thing everywhere:

- ``make_case`` builds a batch of sequences whose first ``seq_lens[s]`` tokens are cached
  (stored as the reference ``reshape_and_cache`` stores them, so fp8 caches hold exactly the
  bits the contract says). Blocks are handed out in random order; the spare blocks no table reaches and
  the slots past each sequence's length hold NaN, and block-table entries past a sequence's
  length hold garbage ids (other sequences' blocks, negative ids, ids past the cache, 2^30): a
  kernel that reads any of them fails the budget (NaN or someone else's tokens) or faults.
- ``TOLERANCE`` is the budget: relative L2 error against ``paged_ops.reference`` run in
  float64 on the same stored inputs; ``rel_err`` measures it (NaN anywhere gives NaN) and
  ``assert_close`` checks it. A log-sum-exp (``lse``) has its own measure, ``assert_lse_close``.
- ``make_variants`` builds the attention variants' keyword arguments (soft-cap, sliding window,
  sinks, ALiBi slopes, an NaN-poisoned ``lse`` buffer); ``PagedCase.reference_*`` take the same
  keywords.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from . import reference

__all__ = ["TOLERANCE", "FP8_DTYPES", "GARBAGE_BLOCK_ID", "SCALE_KINDS", "rel_err", "assert_close", "assert_lse_close",
           "assert_bits_equal", "bits", "poison", "nan_like", "empty_cache", "random_tensor", "fp8_scales",
           "sequence_scale",
           "ragged_lens", "alibi_slopes", "make_variants", "PagedCase", "make_case", "cuda_targets"]

# Relative L2 error of an output against the float64 reference, by the query dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Block-table filler past a sequence's length: far outside any cache, so a kernel that
# dereferences it reads out of bounds (a fault on a GPU, a sanitizer report, NaN at best).
GARBAGE_BLOCK_ID = 1 << 30


# --------------------------------------------------------------------------- error measure

def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 on the CPU; NaN anywhere in either gives NaN, so a
    leaked poisoned value fails every budget."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, ref {tuple(ref.shape)}")
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, msg: str = "") -> float:
    """Assert ``rel_err(out, ref) <= TOLERANCE[dtype]`` (dtype defaults to out's); returns the error."""
    dtype = dtype or out.dtype
    err = rel_err(out, ref)
    where = f" ({msg})" if msg else ""
    assert not math.isnan(err), f"output holds NaN: a poisoned slot or output row leaked{where}"
    assert err <= TOLERANCE[dtype], f"relative L2 error {err:.3g} > {TOLERANCE[dtype]:g} for {dtype}{where}"
    return err


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = "") -> float:
    """Assert a log-sum-exp close to the reference's: ``-inf`` exactly where the reference is
    (rows with nothing to attend to), elsewhere ``|lse - ref| <= TOLERANCE[dtype] * max(1, |ref|)``.

    Why this budget: an lse error ``d`` scales that part's weight in a merge by ``e^d ~ 1 + d``,
    so an absolute error within the output budget of the query dtype keeps a merged output
    within that budget too; past ``|ref| = 1`` the bound turns relative, because the float32 lse
    itself (and the float32 scores it is the log-sum of) cannot be closer than a few ulps of its
    magnitude. Returns the largest scaled error."""
    lse, ref = lse.detach().double().cpu(), ref.detach().double().cpu()
    where = f" ({msg})" if msg else ""
    assert lse.shape == ref.shape, f"lse has shape {tuple(lse.shape)}, ref {tuple(ref.shape)}{where}"
    empty = ref == -math.inf
    assert torch.equal(lse == -math.inf, empty), f"lse is -inf exactly where the reference is{where}"
    finite = ~empty
    assert not lse[finite].isnan().any(), f"lse holds NaN: a row was not written{where}"
    if not finite.any():
        return 0.0
    err = ((lse[finite] - ref[finite]).abs() / ref[finite].abs().clamp(min=1.0)).max().item()
    assert err <= TOLERANCE[dtype], f"lse error {err:.3g} > {TOLERANCE[dtype]:g} for {dtype}{where}"
    return err


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as integers of its width, on the CPU: for bit-identity checks,
    which NaN != NaN would defeat."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(width).cpu()


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Bit-identical tensors (NaN payloads included), with the first differing elements on failure."""
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"shapes {tuple(g.shape)} vs {tuple(w.shape)} {msg}"
    bad = (g != w).flatten().nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {g.numel()} elements differ {msg}: at {bad[:4].tolist()} "
                              f"got bits {g.flatten()[bad[:4]].tolist()}, want {w.flatten()[bad[:4]].tolist()}")


# --------------------------------------------------------------------------- poisoning

def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN in place (fp8: the 0x7F byte, a NaN in both e4m3fn and e5m2); returns t."""
    if t.dtype in FP8_DTYPES:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A NaN-filled tensor like t: an output buffer whose unwritten rows cannot pass."""
    return poison(torch.empty_like(t))


def empty_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout="NHD", device="cpu") -> torch.Tensor:
    """A NaN-filled cache in the contract's ``[num_blocks, block_size, num_kv_heads, head_size]`` view.

    layout "HND" allocates ``[num_blocks, num_kv_heads, block_size, head_size]`` and permutes it.
    """
    if layout == "NHD":
        c = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    elif layout == "HND":
        c = torch.empty(num_blocks, num_kv_heads, block_size, head_size, dtype=dtype, device=device).transpose(1, 2)
    else:
        raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    return poison(c)


# --------------------------------------------------------------------------- random inputs

def random_tensor(shape, dtype: torch.dtype, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """Standard normal values in dtype (fp8: the saturating cast of them), drawn with generator
    on its device and moved to device."""
    x = torch.randn(shape, generator=generator, device=generator.device)
    if dtype in FP8_DTYPES:
        m = reference.fp8_max(dtype)
        x = x.clamp(-m, m)
    return x.to(device=device, dtype=dtype)


SCALE_KINDS = ("tensor", "head", "seq", "head/tensor", "tensor/seq")


def fp8_scales(cache_dtype: torch.dtype, num_kv_heads: int, scale_kind: str = "tensor",
               generator: torch.Generator | None = None, device="cpu", num_seqs: int = 1):
    """(k_scale, v_scale): float32 in [0.01, 0.06), so that standard-normal K/V use the fp8 range
    (outliers saturate); (None, None) for a cache that is not fp8. scale_kind: "tensor" (1
    element), "head" ([num_kv_heads]), "seq" ([num_seqs, num_kv_heads], the attention ops only),
    or "K/V" with two of those (e.g. "head/tensor": per-head K, per-tensor V)."""
    if cache_dtype not in FP8_DTYPES:
        return None, None
    if scale_kind not in SCALE_KINDS:
        raise ValueError(f"scale_kind must be one of {SCALE_KINDS}, got {scale_kind!r}")
    kinds = scale_kind.split("/") if "/" in scale_kind else [scale_kind] * 2
    shapes = {"tensor": (1,), "head": (num_kv_heads,), "seq": (num_seqs, num_kv_heads)}
    g = generator or torch.Generator().manual_seed(0)
    return tuple((torch.rand(shapes[k], generator=g) * 0.05 + 0.01).float().to(device) for k in kinds)


def sequence_scale(scale: torch.Tensor | None, s: int) -> torch.Tensor | None:
    """Sequence s's scale (what reshape_and_cache takes for its tokens): row s of a
    ``[num_seqs, num_kv_heads]`` scale, else the scale itself."""
    return scale[s] if scale is not None and scale.dim() == 2 else scale


def ragged_lens(block_size: int) -> list[int]:
    """Sequence lengths around block boundaries: 1 token, exactly one block, one past two
    blocks, one short of three, and a length unrelated to the block size."""
    return [1, block_size, 2 * block_size + 1, 3 * block_size - 1, 37]


def alibi_slopes(num_heads: int, device="cpu") -> torch.Tensor:
    """ALiBi's slopes (Press et al.; BLOOM's, for any head count): the geometric sequence
    ``2^(-8 (h + 1) / n)`` for the largest power of two ``n <= num_heads``, then every other term of
    the sequence for ``2n`` heads. float32 ``[num_heads]``."""
    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(n) + powers(2 * n)[0::2][:num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def make_variants(num_heads: int, *, softcap: float = 0.0, window_left: int = -1, sinks: bool = False,
                  alibi: bool = False, lse_rows: int | None = None, seed: int = 0, device="cpu") -> dict:
    """The keyword arguments of decode_attention/prefill_attention for a set of variants.

    sinks: random float32 ``[num_heads]`` logits in [-1, 5) (around ln of the test lengths, so
    the sink takes a visible share of each row); alibi: ``alibi_slopes(num_heads)``;
    lse_rows: an NaN-filled float32 ``[lse_rows, num_heads]`` lse buffer (None: no lse).
    Tensors are on device; the reference helpers move them to the CPU themselves."""
    g = torch.Generator().manual_seed(seed + 1000)
    kw: dict = {}
    if softcap:
        kw["softcap"] = float(softcap)
    if window_left >= 0:
        kw["window_left"] = int(window_left)
    if sinks:
        kw["sinks"] = (torch.rand(num_heads, generator=g) * 6 - 1).to(device)
    if alibi:
        kw["alibi_slopes"] = alibi_slopes(num_heads, device)
    if lse_rows is not None:
        kw["lse"] = poison(torch.empty(lse_rows, num_heads, dtype=torch.float32, device=device))
    return kw


def named_variants(num_heads: int, name: str, seed: int = 0) -> dict:
    """One named set of decode/prefill keyword arguments ("plain", "softcap", "window", "sinks",
    "alibi", "all"), as the cpu fast-path tests sweep them: the windows (45, 70 keys) end mid-tile,
    the sinks (randn * 2) and slopes (rand * 0.1) are large enough to move every row."""
    g = torch.Generator().manual_seed(seed)
    return {
        "plain": {},
        "softcap": dict(softcap=3.0),
        "window": dict(window_left=45),
        "sinks": dict(sinks=torch.randn(num_heads, generator=g) * 2),
        "alibi": dict(alibi_slopes=torch.rand(num_heads, generator=g) * 0.1),
        "all": dict(softcap=2.0, window_left=70, sinks=torch.randn(num_heads, generator=g),
                    alibi_slopes=torch.rand(num_heads, generator=g) * 0.1),
    }[name]


def _reference_variants(variants: dict) -> dict:
    # The reference's keywords: tensors on the CPU; lse is the caller's output, not an input.
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in variants.items()
            if k not in ("lse", "batch_invariant")}


@dataclass
class PagedCase:
    """A batch of sequences whose first ``seq_lens[s]`` tokens are cached.

    query: [total_q, num_heads, head_size] (decode: one row per sequence); key_cache:
    [num_blocks, block_size, num_kv_heads, head_size] and value_cache [..., value_head_size]
    views (MLA: value_cache may be key_cache[..., :value_head_size]); block_tables int32
    [num_seqs, max_blocks]; seq_lens int32 [num_seqs]; cu_seqlens_q int32 [num_seqs + 1].
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def value_head_size(self) -> int:
        return self.value_cache.shape[3]

    @property
    def out_shape(self) -> tuple[int, int, int]:
        """out's shape: the query's rows and heads, value_cache's head size."""
        return (*self.query.shape[:2], self.value_head_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def q_lens(self) -> list[int]:
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).tolist()

    @property
    def max_seqlen_q(self) -> int:
        # not max(..., default=0): torch 2.11's dynamo cannot trace the keyword (a compiled test reads this)
        return max([0, *self.q_lens])

    def to(self, device) -> "PagedCase":
        """The same batch on another device (a new case; this one is unchanged)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, query=move(self.query), key_cache=move(self.key_cache),
                       value_cache=move(self.value_cache), block_tables=move(self.block_tables),
                       seq_lens=move(self.seq_lens), cu_seqlens_q=move(self.cu_seqlens_q),
                       k_scale=move(self.k_scale), v_scale=move(self.v_scale))

    def prefill_args(self, out, causal=True) -> tuple:
        """prefill_attention's arguments, writing out."""
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables, self.cu_seqlens_q,
                self.seq_lens, self.max_seqlen_q, self.scale, causal, self.k_scale, self.v_scale)

    def decode_args(self, out) -> tuple:
        """decode_attention's arguments, writing out (query: the whole query, one row per sequence)."""
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.scale, self.k_scale, self.v_scale)

    def hidden_tokens(self, causal=True, window_left=-1, window_right=-1) -> list[torch.Tensor]:
        """Per sequence, int64 positions of the cached tokens none of its query rows sees."""
        hidden = []
        for s, (q_len, n) in enumerate(zip(self.q_lens, self.seq_lens.tolist())):
            seen = reference.visible_keys(q_len, n, causal, window_left, window_right).any(0)
            hidden.append((~seen).nonzero().flatten())
        return hidden

    def poison_hidden(self, causal=True, window_left=-1, window_right=-1, value=math.inf, **_) -> int:
        """Store ``value`` (inf; NaN in e4m3fn, which has no inf) in K and V of every cached token
        no query row of its sequence sees (outside a window, after all causal rows): a kernel that
        multiplies such a value by a probability of 0 instead of leaving it out turns rows NaN.
        Extra keywords (the other variants) are ignored. Returns the number of tokens poisoned."""
        count = 0
        block_size = self.key_cache.shape[1]
        for s, positions in enumerate(self.hidden_tokens(causal, window_left, window_right)):
            if positions.numel() == 0:
                continue
            blocks = self.block_tables[s].cpu().long()[positions // block_size].to(self.device)
            offsets = (positions % block_size).to(self.device)
            for cache in (self.key_cache, self.value_cache):  # a value view of key_cache: stored twice
                if cache.dtype == torch.float8_e4m3fn:
                    cache.view(torch.uint8)[blocks, offsets] = 0x7F
                else:
                    cache[blocks, offsets] = value
            count += positions.numel()
        return count

    def new_out(self) -> torch.Tensor:
        """A NaN-filled output: the query's rows and heads, the value head size, its dtype."""
        return torch.full(self.out_shape, math.nan, dtype=self.query.dtype, device=self.device)

    @staticmethod
    def _on_cpu_in_float64(args: tuple) -> list:
        # args[0]: the float64 output, args[1]: the query (widened); every other tensor on the CPU
        args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        args[1] = args[1].double()
        return args

    def reference_prefill(self, causal=True, **variants) -> torch.Tensor:
        """prefill_attention by the float64 reference, on the CPU: [total_q, num_heads, head_size].
        variants: the op's keyword-only arguments (make_variants; a given lse is ignored)."""
        return self.reference_prefill_lse(causal, **variants)[0]

    def reference_prefill_lse(self, causal=True, **variants) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of prefill_attention by the float64 reference, on the CPU:
        [total_q, num_heads, head_size] and [total_q, num_heads]."""
        ref = torch.empty(self.out_shape, dtype=torch.float64)
        lse = torch.empty(self.query.shape[:2], dtype=torch.float64)
        args = self._on_cpu_in_float64(self.prefill_args(ref, causal))
        reference.prefill_attention(*args, lse=lse, **_reference_variants(variants))
        return ref, lse

    def reference_decode(self, **variants) -> torch.Tensor:
        """decode_attention by the float64 reference, on the CPU: [num_seqs, num_heads, head_size]."""
        return self.reference_decode_lse(**variants)[0]

    def reference_decode_lse(self, **variants) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of decode_attention by the float64 reference, on the CPU."""
        ref = torch.empty(self.out_shape, dtype=torch.float64)
        lse = torch.empty(self.query.shape[:2], dtype=torch.float64)
        args = self._on_cpu_in_float64(self.decode_args(ref))
        reference.decode_attention(*args, lse=lse, **_reference_variants(variants))
        return ref, lse


def _store(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None) -> None:
    """reference.reshape_and_cache's stores for every token at once (its per-token loop is the
    readable specification; this is the same casts, vectorized)."""
    # x: [num_tokens, num_kv_heads, head_size]; slots: int64 [num_tokens], all >= 0
    if cache.dtype in FP8_DTYPES:
        x = reference.saturating_fp8_cast(x, scale.reshape(-1, 1), cache.dtype)
    cache[slots // cache.shape[1], slots % cache.shape[1]] = x.to(cache.dtype)


def make_case(seq_lens: Sequence[int], q_lens: Sequence[int] | None = None, num_heads=4, num_kv_heads=2,
              head_size=64, block_size=16, dtype=torch.float32, cache_dtype=None, layout="NHD",
              scale_kind="tensor", spare_blocks=3, device="cpu", seed=0, poison_unused=True,
              spare_columns=1, value_head_size=None, value_in_key=False) -> PagedCase:
    """A random paged batch (see the module docstring).

    seq_lens: cached tokens per sequence (the new tokens of a prefill included; 0 allowed).
    q_lens: query tokens per sequence, >= 0 (default 1 each: decode); q_len > seq_len makes rows
    that see no key (causal).
    cache_dtype: the query dtype (default) or an fp8 dtype, with scales as ``fp8_scales``'s
    scale_kind says (per tensor, per KV head, per sequence and KV head, K and V apart).
    layout: "NHD" or "HND" (the cache allocated head-major and permuted to the contract's view).
    spare_blocks: blocks no table reaches (an int, or a float: that fraction of the used blocks).
    spare_columns: block-table columns past the longest sequence (garbage ids).
    value_head_size: value_cache's (and out's) head size, <= head_size (default head_size).
    value_in_key: value_cache is ``key_cache[..., :value_head_size]``, a view of the same storage
    (absorbed MLA: one latent per token serves as key and, its first columns, as value).
    poison_unused: True: slots no sequence reaches hold NaN and K/V go through the reference
    reshape_and_cache (tests). False: the whole pool is random and the table rows are exact
    (benchmarks: large pools built fast, on device, no NaN slow paths).
    """
    seq_lens = [int(n) for n in seq_lens]
    q_lens = [1] * len(seq_lens) if q_lens is None else [int(n) for n in q_lens]
    if len(q_lens) != len(seq_lens):
        raise ValueError(f"q_lens has {len(q_lens)} entries, seq_lens {len(seq_lens)}")
    if any(q < 0 or n < 0 for q, n in zip(q_lens, seq_lens)):
        raise ValueError(f"need q_len >= 0 and seq_len >= 0, got q_lens {q_lens}, seq_lens {seq_lens}")
    cache_dtype = cache_dtype or dtype
    device = torch.device(device)
    value_head_size = head_size if value_head_size is None else int(value_head_size)
    # Poisoned cases draw on the CPU (the same numbers on every device); pools drawn on the device
    # keep large benchmark inputs off the host.
    g = torch.Generator(device if not poison_unused else "cpu").manual_seed(seed)
    g_cpu = torch.Generator().manual_seed(seed + 1)

    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    used = sum(blocks_per_seq)
    spare = math.ceil(used * spare_blocks) if isinstance(spare_blocks, float) else spare_blocks
    num_blocks = max(used + spare, 1)
    max_blocks = max(blocks_per_seq + [1]) + spare_columns
    perm = torch.randperm(num_blocks, generator=g_cpu).to(torch.int32)
    # Entries past a sequence's length: real blocks, ids before the cache, past it, and 2^30, mixed.
    block_tables = torch.randint(-5, num_blocks * 3, (len(seq_lens), max_blocks), generator=g_cpu).to(torch.int32)
    block_tables[:, -1] = GARBAGE_BLOCK_ID
    taken = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[taken:taken + n]
        taken += n
    k_scale, v_scale = fp8_scales(cache_dtype, num_kv_heads, scale_kind, g_cpu, num_seqs=len(seq_lens))

    if poison_unused:
        kc = empty_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout)
        vc = empty_cache(num_blocks, block_size, num_kv_heads, value_head_size, cache_dtype, layout)
        slots = [block_tables[s, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                 for s, n in enumerate(seq_lens)]
        starts = [0, *torch.tensor([len(x) for x in slots], dtype=torch.long).cumsum(0).tolist()]
        slots = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)
        k = torch.randn(len(slots), num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(len(slots), num_kv_heads, value_head_size, generator=g).to(dtype)
        for s in range(len(seq_lens)):  # each sequence with its own scale (per-sequence scales)
            mine = slice(starts[s], starts[s + 1])
            _store(k[mine], kc, slots[mine], sequence_scale(k_scale, s))
            if not value_in_key:
                _store(v[mine], vc, slots[mine], sequence_scale(v_scale, s))
        kc, vc = kc.to(device), vc.to(device)
    else:
        shape = ((num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_size))
        kc, vc = (random_tensor(shape, cache_dtype, g, device) for _ in range(2))
        if layout == "HND":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        vc = vc[..., :value_head_size]
    if value_in_key:
        if value_head_size > head_size:
            raise ValueError(f"value_in_key needs value_head_size <= head_size, got {value_head_size} > {head_size}")
        vc = kc[..., :value_head_size]

    cu = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)
    query = random_tensor((int(cu[-1]), num_heads, head_size), dtype, g, device)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PagedCase(query=query, key_cache=kc, value_cache=vc, block_tables=to(block_tables),
                     seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)), cu_seqlens_q=to(cu),
                     k_scale=to(k_scale), v_scale=to(v_scale), scale=head_size ** -0.5, dtype=dtype)


# --------------------------------------------------------------------------- where the CUDA kernels run

def cuda_targets() -> list[str]:
    """Where this process can launch the CUDA kernels (csrc/kernels): "emu", the CPU emulator
    (backend cuda_emu, built where CUDA's headers are), then "cuda:N" for each GPU when the cuda
    backend is built (nvcc and a CUDA torch). Empty when neither is."""
    from . import available_backends
    backends = available_backends()
    emu = ["emu"] if "cuda_emu" in backends else []
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if "cuda" in backends and torch.cuda.is_available() else []
    return emu + gpus

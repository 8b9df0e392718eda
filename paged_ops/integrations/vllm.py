"""An attention backend for vLLM 0.32 whose cache writes and attention are ``torch.ops.paged.*``.

Off unless asked for. vLLM calls the entry point ``paged_ops`` of the ``vllm.general_plugins``
group (:func:`register`) in every process (front end, engine core, each worker) whenever
``VLLM_PLUGINS`` is unset or names it, so installing paged-ops alone would replace vLLM's backend in
every run; :func:`register` therefore replaces ``CPU_ATTN`` (and, for MLA models, ``CPU_MLA`` and
``AMX_MLA`` by :mod:`paged_ops.integrations.vllm_mla`) only when selected:

* ``PAGED_OPS_VLLM=1``: on (vLLM still has to call it: ``VLLM_PLUGINS`` unset, or naming ``paged_ops``);
* ``PAGED_OPS_VLLM=0``: off, even with ``VLLM_PLUGINS=paged_ops`` (the opt-out wins, for a job
  whose launcher sets ``VLLM_PLUGINS``);
* ``PAGED_OPS_VLLM`` unset or empty: on exactly when ``VLLM_PLUGINS`` names ``paged_ops``
  (``VLLM_PLUGINS=paged_ops``, or a comma-separated list with it);

any other ``PAGED_OPS_VLLM`` value is a ValueError naming it. Environment variables reach vLLM's
spawned engine and worker processes, so every process decides the same way. A process whose
attention layers are built with this backend logs one INFO line through vLLM's logger, with the
first layer: ``paged_ops: CPU_ATTN -> paged_ops.integrations.vllm.PagedOpsAttentionBackend
(VLLM_PLUGINS=paged_ops)`` (one per worker: with tensor or pipeline parallelism, one per rank);
a process building MLA layers logs ``paged_ops: CPU_MLA -> ..., AMX_MLA -> ... (...)`` instead.

The KV cache: vLLM hands each layer a logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
view whose last dimension is one token's key followed by its value. Transposing the middle two
dimensions and splitting the last gives two views of the contract's
``[num_blocks, block_size, num_kv_heads, head_size]`` with a unit last stride; the ops address
caches by strides, so no copy is made. The preferred physical layout is LBNHC (token-major, the
contract's own order); any other layout vLLM resolves is read through the same strided views.

Per step: ``do_kv_cache_update`` stores the new K/V with ``reshape_and_cache`` (fp8 caches
quantize with the layer's k/v scales); ``forward`` runs the whole batch in one
``prefill_attention`` call (prefills, chunked prefills over cached context and decode rows mixed,
bottom-right causal), or ``decode_attention`` when every request has exactly one query token.
No step copies metadata to the host, so the same classes can be registered for vLLM's CUDA
backends (:func:`register` with ``gpu=True``); that path has not been run (no GPU here).

The attention variants vLLM hands a layer map onto the ops' keyword arguments: ``sliding_window``
W (a query sees W keys, itself included: FlashAttention's ``window_size=(W - 1, 0)`` in vLLM's own
backends) is ``window_left=W - 1``; ``logits_soft_cap`` is ``softcap`` (None means 0: none);
``alibi_slopes`` (a list) becomes one float32 tensor at init; ``sinks`` (a per-layer parameter in the
model's dtype, loaded after init) is passed as float32 on every call, cast there when it is not.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

import paged_ops  # noqa: F401  (registers torch.ops.paged.*)

# vLLM's kv_cache_dtype names -> the cache dtype the ops take ("fp8" is e4m3 in vLLM).
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class PagedOpsAttentionBackend(AttentionBackend):
    """Registered in place of ``CPU_ATTN``; :class:`PagedOpsGPUAttentionBackend` in place of a GPU one."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_DTYPES]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # the ops take any block size >= 1

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(8, 257, 8))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # LBNHC = per layer [num_blocks, block_size, num_kv_heads, K|V]: the contract's order.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    # The ops take sinks, windows, soft-caps and ALiBi as runtime arguments (see the impl).
    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @staticmethod
    def get_name() -> str:
        # vLLM maps the name back to the enum member it replaces (AttentionBackendEnum[name]).
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[PagedOpsAttentionImpl]:
        return PagedOpsAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PagedOpsMetadataBuilder]:
        return PagedOpsMetadataBuilder


class PagedOpsGPUAttentionBackend(PagedOpsAttentionBackend):
    """The same backend under the name of vLLM's Triton backend, for CUDA tensors (untested here)."""

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"


@dataclass
class PagedOpsMetadata:
    """One step's batch, shared by all layers of a KV cache group."""
    num_actual_tokens: int       # tokens without padding
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]  (the ops' cu_seqlens_q)
    seq_lens: torch.Tensor       # int32 [num_reqs]: KV length including this step's tokens
    block_table: torch.Tensor    # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor   # int64 [num_actual_tokens]
    decode_only: bool            # every request has exactly one query token


class PagedOpsMetadataBuilder(AttentionMetadataBuilder[PagedOpsMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedOpsMetadata:
        m = common_attn_metadata
        # num_reqs == num_actual_tokens with max_query_len 1 rules out padded requests of
        # q_len 0 (decode_attention needs seq_len >= 1), without reading device tensors.
        decode_only = m.max_query_len == 1 and m.num_reqs == m.num_actual_tokens
        return PagedOpsMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            decode_only=decode_only,
        )


def split_kv_cache(kv_cache: torch.Tensor, kv_cache_dtype: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache -> (key_cache, value_cache) views in the contract's layout.

    kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size] (logical; any stride order
    with a unit last stride) -> each [num_blocks, block_size, num_kv_heads, head_size].
    """
    if kv_cache_dtype in FP8_DTYPES and kv_cache.dtype != FP8_DTYPES[kv_cache_dtype]:
        kv_cache = kv_cache.view(FP8_DTYPES[kv_cache_dtype])  # vLLM may allocate fp8 caches as uint8
    tokens_major = kv_cache.transpose(1, 2)
    return tokens_major[..., :head_size], tokens_major[..., head_size:]


class PagedOpsAttentionImpl(AttentionImpl[PagedOpsMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        _announce()
        # What the ops do not compute is refused here rather than silently ignored.
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"paged_ops attention backend does not support attn_type={attn_type}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16", *FP8_DTYPES):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by paged_ops")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8 = kv_cache_dtype in FP8_DTYPES
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # vLLM's window W: keys p - (W - 1) .. p, as its FlashAttention backend's (W - 1, 0).
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.softcap = float(logits_soft_cap or 0.0)
        # alibi_slopes: float32 [num_heads]; moved to the query's device on the first call.
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        # sinks: [num_heads], the model's parameter itself (its values are loaded after init).
        self.sinks = sinks

    def _scales(self, layer: AttentionLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # layer._k_scale: float32, 0-d (per tensor) or [num_kv_heads]; the ops take 1-d.
        if not self.is_fp8:
            return None, None
        return layer._k_scale.reshape(-1), layer._v_scale.reshape(-1)

    def _variants(self, query: torch.Tensor) -> dict:
        """The ops' keyword arguments for this layer's variants; no host sync."""
        if self.alibi_slopes is not None and self.alibi_slopes.device != query.device:
            self.alibi_slopes = self.alibi_slopes.to(query.device)
        sinks = self.sinks
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.device != query.device):
            sinks = sinks.to(device=query.device, dtype=torch.float32)
        return dict(softcap=self.softcap, window_left=self.window_left, sinks=sinks,
                    alibi_slopes=self.alibi_slopes)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value: [num_tokens (maybe padded), num_kv_heads, head_size]; slot_mapping int64."""
        if self.kv_sharing_target_layer_name is not None:
            return  # this layer reads another layer's cache, which that layer writes
        key_cache, value_cache = split_kv_cache(kv_cache, self.kv_cache_dtype, self.head_size)
        n = slot_mapping.shape[0]
        k_scale, v_scale = self._scales(layer)
        torch.ops.paged.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: PagedOpsMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_size] -> output [num_tokens, num_heads, head_size]
        (or its [num_tokens, num_heads * head_size] view); K/V are already in the cache."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("paged_ops attention backend does not fuse output quantization")
        if attn_metadata is None:  # profiling run: no cache yet
            return output
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache, self.kv_cache_dtype, self.head_size)
        k_scale, v_scale = self._scales(layer)
        out = output[:n].view(n, self.num_heads, self.head_size)
        q = query[:n].view(n, self.num_heads, self.head_size)
        variants = self._variants(q)
        if attn_metadata.decode_only:
            torch.ops.paged.decode_attention(out, q, key_cache, value_cache, attn_metadata.block_table,
                                             attn_metadata.seq_lens, self.scale, k_scale, v_scale, **variants)
        else:
            torch.ops.paged.prefill_attention(out, q, key_cache, value_cache, attn_metadata.block_table,
                                              attn_metadata.query_start_loc, attn_metadata.seq_lens,
                                              attn_metadata.max_query_len, self.scale, True, k_scale, v_scale,
                                              **variants)
        return output


ENV = "PAGED_OPS_VLLM"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_announced: set[str] = set()  # the kinds of layer whose log line this process has written (_announce)


def selected(environ=None) -> tuple[bool, str]:
    """(whether :func:`register` replaces vLLM's backend, why) from PAGED_OPS_VLLM and VLLM_PLUGINS."""
    environ = os.environ if environ is None else environ
    flag = environ.get(ENV, "").strip().lower()
    # vLLM's own parsing (vllm.envs): unset is None, else the comma-separated names as written.
    plugins = environ["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in environ else None
    if flag in _ON:
        return True, f"{ENV}={environ[ENV]}"
    if flag in _OFF:
        return False, f"{ENV}={environ[ENV]}"
    if flag:
        raise ValueError(f"{ENV}={environ[ENV]!r}: expected 1 (use paged_ops' attention backend in vLLM), "
                         f"0 (do not), or unset (use it when VLLM_PLUGINS names paged_ops)")
    if plugins is not None and "paged_ops" in plugins:
        return True, f"VLLM_PLUGINS={environ['VLLM_PLUGINS']}"
    return False, "VLLM_PLUGINS unset" if plugins is None else f"VLLM_PLUGINS={environ['VLLM_PLUGINS']}"


def register(gpu: bool = False) -> None:
    """The ``vllm.general_plugins`` entry point: when :func:`selected` (``PAGED_OPS_VLLM=1``, or
    ``VLLM_PLUGINS`` naming ``paged_ops`` without ``PAGED_OPS_VLLM=0``), replace vLLM's CPU
    attention backend (and, with gpu=True, its Triton backend) by this module's backend and its
    two CPU MLA backends by vllm_mla's;
    otherwise leave vLLM's backends alone. Idempotent, as vLLM may load plugins more than once per
    process. The log line comes when the first attention layer is built (:func:`_announce`): vLLM
    loads plugins in its front end before it configures its logging, where a line would be lost."""
    global _why
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    on, why = selected()
    if not on:
        return
    _why = why
    # MLA models (DeepSeek-V2/V3): vLLM's CPU platform picks AMX_MLA where the CPU has AMX tiles,
    # else CPU_MLA; both go to paged_ops.integrations.vllm_mla (imported only when vLLM builds a layer).
    for member, path in [(AttentionBackendEnum.CPU_ATTN, f"{__name__}.PagedOpsAttentionBackend"),
                         (AttentionBackendEnum.CPU_MLA, f"{__package__}.vllm_mla.PagedOpsMLABackend"),
                         (AttentionBackendEnum.AMX_MLA, f"{__package__}.vllm_mla.PagedOpsAMXMLABackend"),
                         *([(AttentionBackendEnum.TRITON_ATTN, f"{__name__}.PagedOpsGPUAttentionBackend")]
                           if gpu else [])]:
        if member.get_path() != path:
            register_backend(member, path)
            _replaced[member.name] = path


_replaced: dict[str, str] = {}  # vLLM backend name -> the class path registered in its place
_why = ""


def _announce(kind: str = "ATTN") -> None:
    """One INFO line per process and kind of layer ("ATTN", or "MLA" from vllm_mla), through
    vLLM's logger, naming the backends of that kind that replaced vLLM's."""
    if kind in _announced:
        return
    _announced.add(kind)
    mine = {name: path for name, path in _replaced.items() if name.endswith("_MLA") == (kind == "MLA")}
    if mine:
        what = ", ".join(f"{name} -> {path}" for name, path in mine.items())
        _logger().info("paged_ops: %s (%s)", what, _why)
    else:  # the classes used without register(), e.g. by a test
        impl = "vllm_mla.PagedOpsMLAImpl" if kind == "MLA" else "vllm.PagedOpsAttentionImpl"
        _logger().info("paged_ops: attention layers built with %s.%s", __package__, impl)


def _logger():
    # A child of vLLM's "vllm" logger, so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
    from vllm.logger import init_logger
    return init_logger("vllm.plugins.paged_ops")

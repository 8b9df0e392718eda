"""vLLM 0.32's CPU MLA backends (DeepSeek-V2/V3's latent attention) on ``torch.ops.paged.*``.

Registered by :func:`paged_ops.integrations.vllm.register` (the same switch as CPU_ATTN:
``PAGED_OPS_VLLM`` / ``VLLM_PLUGINS``) in place of both MLA backends vLLM's CPU platform picks
from (``CpuPlatform.get_attn_backend_cls``): ``AMX_MLA`` where the CPU has AMX tiles and
``CPU_MLA`` elsewhere or when asked for (``attention_config={"backend": "CPU_MLA"}``). The platform's
own settings per choice stay vLLM's: with ``CPU_MLA`` it forces block 16 and turns chunked prefill
and prefix caching off (``CpuPlatform.check_and_update_config``), with ``AMX_MLA`` it keeps them, so
this backend serves both regimes: any block size, prefills over cached context.

vLLM's ``MLAAttention.forward_impl`` structures the step and is used as it is: the cache write
(``do_kv_cache_update``), then prefill rows through ``forward_mha``, decode rows (query length 1)
with the query already multiplied by W_UK (``ql_nope`` of kv_lora_rank numbers next to the RoPE
part) through ``forward_mqa``, whose out vLLM multiplies by W_UV. The cache is vLLM's MLA cache,
``[num_blocks, block_size, kv_lora_rank + rope]`` per layer: the contract's latent cache
``[num_blocks, block_size, 1, kv_lora_rank + rope]`` without its one-head dimension, the same
memory (``unsqueeze(2)`` is a view).

* cache write: ``concat_and_cache_mla(kv_c_normed, k_pe, latent_cache, slot_mapping)`` (negative
  slots, vLLM's padding, are skipped by the op);
* decode (absorbed): ``decode_attention(out [B, H, kv_lora_rank], q [B, H, kv_lora_rank + rope],
  latent_cache, latent_cache[..., :kv_lora_rank], block_table, seq_lens, scale)``;
* prefill (non-absorbed, as vLLM's MLA backends do it): each prefill request's latent rows, its
  cached context and this step's tokens alike (the write came first), are gathered from the cache
  and up-projected through ``kv_b_proj`` into per-head keys ``[k_nope | k_pe]`` (qk_head_dim) and
  values (v_head_dim); one ``prefill_attention`` call over them, viewed as a block-size-1 cache
  whose block table counts the gathered rows, bottom-right causal, gives every prefill row its
  attention over context and new tokens at once (vLLM's backends attend to the context in
  workspace-sized chunks and merge the chunks' log-sum-exps; a single call needs no merge). A step
  without context up-projects this step's rows as vLLM hands them, no gather.

fp8 latent caches are not taken (vLLM's CPU MLA backends take none either).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.v1.attention.backend import AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

import paged_ops  # noqa: F401  (registers torch.ops.paged.*)


class PagedOpsMLABackend(CPUMLABackend):
    """Registered in place of ``CPU_MLA``; :class:`PagedOpsAMXMLABackend` in place of ``AMX_MLA``."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # the latent row, kv_lora_rank + rope; the ops take key rows up to 576 numbers
        return list(range(8, 577, 8))

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size >= 1

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"  # vLLM maps the name back to the enum member it replaces

    @staticmethod
    def get_impl_cls() -> type[PagedOpsMLAImpl]:
        return PagedOpsMLAImpl

    @staticmethod
    def get_builder_cls() -> type[PagedOpsMLAMetadataBuilder]:
        return PagedOpsMLAMetadataBuilder


class PagedOpsAMXMLABackend(PagedOpsMLABackend):
    @staticmethod
    def get_name() -> str:
        return "AMX_MLA"


class PagedOpsMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata, plus what one prefill_attention call over the gathered rows needs:
    per prefill request its KV length (``seq_lens``) and whether any has cached context; and
    the gather's row indices. Built once per step, shared by the layers."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        p = md.prefill
        if p is not None:
            m = common_attn_metadata
            first = md.num_decodes
            # exact for prefill rows (vLLM's builder relies on the same), host-side: no sync
            seq_lens_cpu = m.seq_lens_cpu_upper_bound[first:m.num_reqs].to(torch.int64)
            q_lens_cpu = p.query_lens_cpu.to(torch.int64)
            p.paged_ops_seq_lens = m.seq_lens[first:m.num_reqs]
            p.paged_ops_has_context, p.paged_ops_slots, p.paged_ops_kv_table = prefill_rows(
                p.block_table, seq_lens_cpu, q_lens_cpu, self.page_size)
        return md


def prefill_rows(block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, q_lens_cpu: torch.Tensor, block_size: int):
    """(has_context, slots, kv_table) of a step's prefill requests (block_table [P, max_blocks];
    seq_lens_cpu, q_lens_cpu int64 [P] on the host). With context: slots int64 [sum seq_lens], the
    latent row of every position 0 .. seq_len - 1 of each request in turn, and kv_table int32
    [P, max seq_len], request r's rows in that gather. Without: slots None, kv_table request r's
    rows among this step's rows (its query rows are its keys)."""
    device = block_table.device
    has_context = bool((seq_lens_cpu > q_lens_cpu).any())
    lens = seq_lens_cpu if has_context else q_lens_cpu
    starts = torch.cumsum(lens, 0) - lens
    kv_table = (starts[:, None] + torch.arange(int(lens.max()))[None, :]).to(torch.int32).to(device)
    if not has_context:
        return False, None, kv_table
    pos = torch.cat([torch.arange(int(n)) for n in seq_lens_cpu]).to(device)
    req = torch.repeat_interleave(torch.arange(len(seq_lens_cpu)), seq_lens_cpu).to(device)
    slots = block_table.to(torch.int64)[req, pos // block_size] * block_size + pos % block_size
    return True, slots, kv_table


class PagedOpsMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA impl (its constructor: MLA dimensions, kv_b_proj, no GPU prefill kernel
    lookup) with the cache write, decode and prefill on the ops."""

    def __init__(self, *args, **kwargs) -> None:
        from paged_ops.integrations.vllm import _announce
        _announce("MLA")
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in ("auto", "float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported by paged_ops' MLA backend")

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """kv_c_normed [T (maybe padded), kv_lora_rank], k_pe [T, 1, rope] -> the latent cache."""
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        torch.ops.paged.concat_and_cache_mla(kv_c_normed[:n], k_pe[:n].squeeze(1), kv_cache.unsqueeze(2),
                                             slot_mapping.flatten(), None)

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        """q: [B, H, kv_lora_rank + rope] (or its two parts) -> out [B, H, kv_lora_rank] (vLLM applies W_UV)."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        d = attn_metadata.decode
        cache = kv_c_and_k_pe_cache.unsqueeze(2)  # [num_blocks, block_size, 1, kv_lora_rank + rope]
        out = torch.empty(*q.shape[:2], self.kv_lora_rank, dtype=q.dtype, device=q.device)
        torch.ops.paged.decode_attention(out, q, cache, cache[..., :self.kv_lora_rank], d.block_table,
                                         d.seq_lens, self.scale, None, None)
        return out, None

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata, k_scale: torch.Tensor,
                    output: torch.Tensor, output_scale: torch.Tensor | None = None) -> None:
        """The prefill rows: q [Tp, H, qk_head_dim], this step's kv_c_normed [Tp, kv_lora_rank] and
        k_pe [Tp, 1, rope] -> output [Tp, H * v_head_dim]."""
        if output_scale is not None:
            raise NotImplementedError("paged_ops' MLA backend does not fuse output quantization")
        p = attn_metadata.prefill
        if p.paged_ops_has_context:
            rows = kv_c_and_k_pe_cache.view(-1, kv_c_and_k_pe_cache.shape[-1])[p.paged_ops_slots]
            latent, rope = rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:].unsqueeze(1)
            seq_lens = p.paged_ops_seq_lens
        else:
            latent, rope, seq_lens = kv_c_normed, k_pe, None
        n = latent.shape[0]
        kv_nope = self.kv_b_proj(latent)[0].view(n, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.empty(n, self.num_heads, self.qk_head_dim, dtype=q.dtype, device=q.device)
        k[..., :self.qk_nope_head_dim] = k_nope
        k[..., self.qk_nope_head_dim:] = rope
        if seq_lens is None:  # no context: each request's keys are its query rows
            seq_lens = (p.query_start_loc[1:] - p.query_start_loc[:-1]).to(torch.int32)
        out = output.view(-1, self.num_heads, self.v_head_dim)
        # the rows as a cache of block size 1: [n, 1, H, D] views, block table = row indices
        torch.ops.paged.prefill_attention(out, q, k.unsqueeze(1), v.unsqueeze(1), p.paged_ops_kv_table,
                                          p.query_start_loc, seq_lens, p.max_query_len, self.scale, True,
                                          None, None)

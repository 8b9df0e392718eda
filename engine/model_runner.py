"""Runs a Hugging Face decoder on one flattened varlen batch per step, attention through
``torch.ops.paged.*``.

Two ways to run the decoder (``model_impl``, see engine/README.md). Llama, Mistral and Qwen2 run
natively (``engine/models/llama.py``: fused projections, ``paged_attention`` called with the
step's metadata). Any other decoder keeps transformers' modeling code with our attention plugged
in through its ``AttentionInterface`` (``attn_implementation="paged_ops"``): the model sees a
batch of one "sequence" of all scheduled tokens (``[1, num_tokens]``, real positions in
position_ids), and our attention function reads the per-step metadata (slots, block tables,
cu_seqlens) from a module-level context that the runner sets around each forward.
"""
from __future__ import annotations

import functools
import glob
import os
import re
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from engine.models import llama
from engine.models.packed_linear import can_pack, pack_linears
from engine.scheduler import SchedulerOutput

ATTN_IMPLEMENTATION = "paged_ops"  # not "paged": transformers reserves "paged|..." for its own cache
# "native": engine/models (Llama, Mistral, Qwen2; fused projections); "transformers": any decoder
# through transformers' attention interface; "auto": native where it exists.
MODEL_IMPLS = ("auto", "native", "transformers")
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@functools.cache
def _ops():
    # imported on first use, so the scheduler and block manager work without the built ops
    import paged_ops  # noqa: F401  (registers torch.ops.paged.*)
    return torch.ops.paged


class _Unchecked:
    """The kernels torch.ops.paged.* routes to for `device` right now, without its input checks."""

    def __init__(self, device: torch.device):
        import paged_ops
        backend = paged_ops.backend(paged_ops.selected_backend(device.type))
        self.reshape_and_cache = backend.unchecked("reshape_and_cache")
        self.decode_attention = backend.unchecked("decode_attention")
        self.prefill_attention = backend.unchecked("prefill_attention")


@dataclass
class KVCache:
    """Per-layer paged caches ``[num_blocks, block_size, num_kv_heads, head_size]`` and fp8 scales."""
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor | None]   # float32 [1] or [num_kv_heads] per layer, fp8 only
    v_scales: list[torch.Tensor | None]

    @property
    def is_fp8(self) -> bool:
        return self.key_caches[0].dtype in KV_CACHE_DTYPES.values()


@dataclass
class AttentionMetadata:
    """Batch layout of one step, shared by all layers."""
    slot_mapping: torch.Tensor   # int64 [num_tokens]: block * block_size + offset
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    seq_lens: torch.Tensor       # int32 [num_seqs]: KV length after this step
    max_seqlen_q: int
    decode_only: bool            # every sequence has q_len 1: use decode_attention
    kv: KVCache
    unchecked: _Unchecked        # the kernels of the backend that layer 0's checked call used


_CONTEXT: AttentionMetadata | None = None


def _fp8_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size] -> float32 [num_kv_heads]: each head's amax maps
    # to the fp8 max (per head, as heads' ranges differ a lot; later outliers saturate)
    amax = x.abs().amax(dim=(0, 2)).float().clamp(min=1e-6)
    return amax / torch.finfo(dtype).max


def paged_attention(ctx: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Store the step's K/V in layer's cache, attend over the cache. q: [T, num_heads, D];
    k, v: [T, num_kv_heads, D] (after RoPE) -> [T, num_heads, D]."""
    # Layer 0 goes through torch.ops.paged.*: it checks the step's metadata and caches and picks
    # the backend. Later layers pass the same metadata and same-shaped caches, so they call that
    # backend's kernels directly (the checks cost ~100 us a call, a third of a decode kernel here).
    ops, kv = _ops() if layer == 0 else ctx.unchecked, ctx.kv
    kc, vc = kv.key_caches[layer], kv.value_caches[layer]
    if kv.is_fp8 and kv.k_scales[layer] is None:  # no checkpoint scales: calibrate on the first prefill
        kv.k_scales[layer], kv.v_scales[layer] = _fp8_scale(k, kc.dtype), _fp8_scale(v, vc.dtype)
    ks, vs = kv.k_scales[layer], kv.v_scales[layer]
    ops.reshape_and_cache(k, v, kc, vc, ctx.slot_mapping, ks, vs)
    out = torch.empty_like(q)
    if ctx.decode_only:
        ops.decode_attention(out, q, kc, vc, ctx.block_tables, ctx.seq_lens, scale, ks, vs)
    else:
        ops.prefill_attention(out, q, kc, vc, ctx.block_tables, ctx.cu_seqlens_q, ctx.seq_lens,
                              ctx.max_seqlen_q, scale, True, ks, vs)
    return out


def paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention interface: query [1, num_heads, T, D], key/value
    [1, num_kv_heads, T, D] (after RoPE) -> ([1, T, num_heads, D], None)."""
    assert _CONTEXT is not None, "paged_ops attention called outside ModelRunner.run"
    to_tokens = lambda x: x[0].transpose(0, 1).contiguous()  # noqa: E731  [T, heads, D]
    out = paged_attention(_CONTEXT, module.layer_idx, to_tokens(query), to_tokens(key), to_tokens(value), scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def load_kv_scales(model_dir: str, num_layers: int) -> tuple[list, list] | None:
    """fp8 KV scales stored in the checkpoint (``layers.N.self_attn.{k,v}_scale``, or
    ``{k,v}_proj.output_scale`` as llm-compressor writes them); None when absent."""
    from safetensors import safe_open
    pattern = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
    scales = {"k": [None] * num_layers, "v": [None] * num_layers}
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if m := pattern.search(name):
                    scales[m.group(2) or m.group(3)][int(m.group(1))] = f.get_tensor(name).float().reshape(-1)
    if any(s is None for s in scales["k"] + scales["v"]):
        return None
    return scales["k"], scales["v"]


class ModelRunner:
    """Owns the model and the KV caches; turns a SchedulerOutput into logits."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device, block_size: int,
                 kv_cache_dtype: str = "auto", num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_cpu_blocks: int | None = None, swap_space_bytes: int = 0,
                 max_num_batched_tokens: int = 2048, model_impl: str = "auto"):
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}")
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        self.device, self.block_size = device, block_size
        self.config = AutoConfig.from_pretrained(model_dir)
        hf_model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION).to(device).eval()
        self.generation_config = hf_model.generation_config
        native = type(hf_model).__name__ in llama.ARCHITECTURES
        if model_impl == "native" and not native:
            raise ValueError(f"model_impl='native' supports {llama.ARCHITECTURES}, not {type(hf_model).__name__}")
        self.model_impl = "native" if native and model_impl != "transformers" else "transformers"
        self.model = llama.LlamaForCausalLM(hf_model).eval() if self.model_impl == "native" else hf_model
        del hf_model  # the native model fused q/k/v and gate/up: the originals are freed here
        self.packed_linears = pack_linears(self.model) if can_pack(dtype, device) else 0
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache_dtype = KV_CACHE_DTYPES.get(kv_cache_dtype, dtype)
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        self.bytes_per_block = 2 * self.num_layers * block_size * self.num_kv_heads * self.head_size * elem

        if num_kv_blocks is None:
            num_kv_blocks = self._profile_num_blocks(kv_cache_memory_bytes, gpu_memory_utilization,
                                                     max_num_batched_tokens)
        if num_kv_blocks < 1:
            raise ValueError("no memory left for the KV cache")
        self.num_kv_blocks = num_kv_blocks
        self.kv = self._allocate(num_kv_blocks, device)
        scales = load_kv_scales(model_dir, self.num_layers) if self.kv.is_fp8 else None
        if scales:
            self.kv.k_scales = [s.to(device) for s in scales[0]]
            self.kv.v_scales = [s.to(device) for s in scales[1]]
        if num_cpu_blocks is None:
            num_cpu_blocks = swap_space_bytes // self.bytes_per_block
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_kv = self._allocate(num_cpu_blocks, torch.device("cpu")) if num_cpu_blocks else None

    def _allocate(self, num_blocks: int, device: torch.device) -> KVCache:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        new = lambda: [torch.zeros(shape, dtype=self.cache_dtype, device=device) for _ in range(self.num_layers)]
        return KVCache(new(), new(), [None] * self.num_layers, [None] * self.num_layers)

    def _profile_num_blocks(self, kv_cache_memory_bytes, gpu_memory_utilization, max_num_batched_tokens) -> int:
        """CPU: kv_cache_memory_bytes (default 1 GiB). CUDA: what gpu_memory_utilization of the
        device leaves after the weights and the activations of a max-size step."""
        if kv_cache_memory_bytes is not None or self.device.type != "cuda":
            return (kv_cache_memory_bytes or 1 << 30) // self.bytes_per_block
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = max_num_batched_tokens
        self.kv = self._allocate(-(n // -self.block_size), self.device)
        from engine.sequence import Sequence
        seq = Sequence([0] * n, block_size=self.block_size)
        seq.block_table = list(range(len(self.kv.key_caches[0])))
        self.run(SchedulerOutput(seqs=[seq], num_new_tokens=[n]))
        peak = torch.cuda.max_memory_allocated(self.device) - sum(
            c.numel() * c.element_size() for c in self.kv.key_caches + self.kv.value_caches)
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)  # CUDA context, other processes
        return int(total * gpu_memory_utilization - peak - outside_torch) // self.bytes_per_block

    # ---- block moves -----------------------------------------------------------------
    def _move_blocks(self, out: SchedulerOutput) -> None:
        ops = _ops()
        mapping = lambda pairs, dev: torch.tensor(pairs, dtype=torch.int64, device=dev).reshape(-1, 2)
        for pairs, src, dst in ((out.blocks_to_swap_out, self.kv, self.cpu_kv),
                                (out.blocks_to_swap_in, self.cpu_kv, self.kv)):
            if pairs:
                m = mapping(pairs, "cpu")
                for layer in range(self.num_layers):
                    ops.swap_blocks(src.key_caches[layer], dst.key_caches[layer], m)
                    ops.swap_blocks(src.value_caches[layer], dst.value_caches[layer], m)
        if out.blocks_to_copy:
            ops.copy_blocks(self.kv.key_caches, self.kv.value_caches, mapping(out.blocks_to_copy, self.device))

    # ---- one step --------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks: input ids, positions, attention metadata, and the rows
        whose logits are needed (the last row of every sequence that catches up this step)."""
        bs = self.block_size
        input_ids, positions, slots, cu, seq_lens, sample_rows = [], [], [], [0], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
        max_blocks = max(len(seq.block_table) for seq in out.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in out.seqs]
        t = lambda x, dtype: torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64), block_tables=t(tables, torch.int32),
            cu_seqlens_q=t(cu, torch.int32), seq_lens=t(seq_lens, torch.int32),
            max_seqlen_q=max(out.num_new_tokens), decode_only=max(out.num_new_tokens) == 1, kv=self.kv,
            unchecked=_Unchecked(self.device))
        return t(input_ids, torch.int64), t(positions, torch.int64), meta, sample_rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Do the step's block moves, run the model; returns float32 logits [len(sample_rows), vocab]."""
        global _CONTEXT
        self._move_blocks(out)
        input_ids, positions, meta, sample_rows = self.prepare(out)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        if self.model_impl == "native":
            hidden = self.model(input_ids, positions, functools.partial(paged_attention, meta))  # [T, hidden]
            return self.model.logits(hidden[rows]).float()  # [num_sample, vocab]
        _CONTEXT = meta
        try:
            decoder = getattr(self.model, self.model.base_model_prefix)  # the model without lm_head
            hidden = decoder(input_ids=input_ids[None], position_ids=positions[None],
                             use_cache=False).last_hidden_state[0]  # [T, hidden]
        finally:
            _CONTEXT = None
        return self.model.get_output_embeddings()(hidden[rows]).float()  # [num_sample, vocab]

"""Runs a Hugging Face decoder on one flattened varlen batch per step, attention through
``torch.ops.paged.*`` (engine/attention.py).

Two ways to run the decoder (``model_impl``, see engine/README.md). Llama, Mistral, Qwen2, Gemma 2,
gpt-oss and DeepSeek-V2/V3 run natively (``engine/models/``: fused projections, ``paged_attention``
called with the step's metadata and each layer's attention variants; DeepSeek's ``mla_attention``
over a latent cache). Any other decoder keeps transformers'
modeling code with our attention plugged in through its ``AttentionInterface``
(``attn_implementation="paged_ops"``): the model sees a batch of one "sequence" of all scheduled
tokens (``[1, num_tokens]``, real positions in position_ids), and our attention function reads the
step's metadata set around each forward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .attention import (ATTN_IMPLEMENTATION, AttentionMetadata, KVCache, cache_layout, check_layer_types, is_mla,
                        load_kv_scales, ops, paged_attention, step_metadata)
from .config import KV_CACHE_DTYPES, EngineConfig
from .models import deepseek, gemma2, gpt_oss, llama
from .models.packed_linear import can_pack, pack_linears
from .scheduler import SchedulerOutput


# architecture name -> native model class (engine/models/)
NATIVE = {**{a: llama.LlamaForCausalLM for a in llama.ARCHITECTURES},
          **{a: gemma2.Gemma2ForCausalLM for a in gemma2.ARCHITECTURES},
          **{a: gpt_oss.GptOssForCausalLM for a in gpt_oss.ARCHITECTURES},
          **{a: deepseek.DeepseekForCausalLM for a in deepseek.ARCHITECTURES}}


@dataclass
class StepLogits:
    """float32 logits of one step: one row per sequence whose next token is due (in the order of
    ``Scheduler.postprocess``), and for sequences that asked for prompt logprobs, the rows of the
    prompt positions computed this step: ``prompt[seq_id] = (first_position, [k, vocab])``, row j
    being the distribution of the token at first_position + j + 1."""
    sample: torch.Tensor
    prompt: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and the KV caches; turns a SchedulerOutput into logits."""

    def __init__(self, config: EngineConfig):
        self.device, self.block_size = config.torch_device, config.block_size
        # trust_remote_code: the checkpoint directory's own modeling code; never the hub
        load = dict(trust_remote_code=config.trust_remote_code, local_files_only=True)
        self.config = AutoConfig.from_pretrained(config.model, **load)
        self.dtype = config.resolve_dtype(self.config)
        check_layer_types(self.config)
        hf_model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION, **load).to(self.device).eval()
        self.generation_config = hf_model.generation_config
        native = NATIVE.get(type(hf_model).__name__)
        if config.model_impl == "native" and native is None:
            raise ValueError(f"model_impl='native' supports {tuple(NATIVE)}, not {type(hf_model).__name__}")
        self.model_impl = "native" if native is not None and config.model_impl != "transformers" else "transformers"
        self.model = native(hf_model).eval() if self.model_impl == "native" else hf_model
        if any(getattr(m, "is_causal", True) is False for m in self.model.modules() if hasattr(m, "layer_idx")):
            raise ValueError(f"{type(hf_model).__name__} has non-causal attention layers (e.g. Gemma's "
                             f"use_bidirectional_attention): the engine runs causal decoders only")
        del hf_model  # the native model fused q/k/v and gate/up: the originals are freed here
        # transformers' ForCausalLM applies it after lm_head (Gemma 2); the runner calls lm_head itself
        self.final_logit_softcapping = getattr(self.config, "final_logit_softcapping", None)
        self.packed_linears = pack_linears(self.model) if can_pack(self.dtype, self.device) else 0
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        # the native DeepSeek model caches MLA's latent; through transformers it gets per-head K/V
        self.cache_layout = cache_layout(cfg, latent=self.model_impl == "native" and is_mla(cfg))
        self.cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.bytes_per_block = self.num_layers * self.block_size * self.cache_layout.bytes_per_token(self.cache_dtype)

        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            num_kv_blocks = self._profile_num_blocks(config)
        if num_kv_blocks < 1:
            raise ValueError("no memory left for the KV cache (kv_cache_memory_bytes / gpu_memory_utilization)")
        self.num_kv_blocks = num_kv_blocks
        self.kv = self._allocate(num_kv_blocks, self.device)
        scales = load_kv_scales(config.model, self.num_layers) if self.kv.is_fp8 else None
        if scales:
            self.kv.k_scales = [s.to(self.device) for s in scales[0]]
            # a latent cache has one scale per layer: the k_scale (vLLM's MLA passes layer._k_scale)
            self.kv.v_scales = self.kv.k_scales if self.kv.value_in_key else [s.to(self.device) for s in scales[1]]
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = config.num_cpu_blocks
            if num_cpu_blocks is None:
                num_cpu_blocks = config.swap_space_bytes // self.bytes_per_block
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_kv = self._allocate(num_cpu_blocks, torch.device("cpu")) if num_cpu_blocks else None

    def _allocate(self, num_blocks: int, device: torch.device) -> KVCache:
        return KVCache.allocate(self.cache_layout, self.num_layers, num_blocks, self.block_size, self.cache_dtype,
                                device)

    def _profile_num_blocks(self, config: EngineConfig) -> int:
        """CPU: kv_cache_memory_bytes (default 1 GiB). CUDA: what gpu_memory_utilization of the
        device leaves after the weights and the activations of a max-size step."""
        if config.kv_cache_memory_bytes is not None or self.device.type != "cuda":
            return (config.kv_cache_memory_bytes or 1 << 30) // self.bytes_per_block
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = config.max_num_batched_tokens
        self.kv = self._allocate(-(n // -self.block_size), self.device)
        from .sequence import Sequence
        seq = Sequence([0] * n, block_size=self.block_size)
        seq.block_table = list(range(len(self.kv.key_caches[0])))
        self.run(SchedulerOutput(seqs=[seq], num_new_tokens=[n]))
        peak = torch.cuda.max_memory_allocated(self.device) - sum(
            c.numel() * c.element_size() for c in self.kv.storage())
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)  # CUDA context, other processes
        return int(total * config.gpu_memory_utilization - peak - outside_torch) // self.bytes_per_block

    # ---- block moves -----------------------------------------------------------------
    def _move_blocks(self, out: SchedulerOutput) -> None:
        paged = ops()
        mapping = lambda pairs, dev: torch.tensor(pairs, dtype=torch.int64, device=dev).reshape(-1, 2)
        for pairs, src, dst in ((out.blocks_to_swap_out, self.kv, self.cpu_kv),
                                (out.blocks_to_swap_in, self.cpu_kv, self.kv)):
            if pairs:
                m = mapping(pairs, "cpu")
                for s, d in zip(src.storage(), dst.storage()):  # a latent cache once, not again as its value view
                    paged.swap_blocks(s, d, m)
        if out.blocks_to_copy:
            paged.copy_blocks(*self.kv.disjoint_pairs(), mapping(out.blocks_to_copy, self.device))

    # ---- one step --------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput):
        """Flatten the scheduled chunks: input ids, positions, attention metadata, the rows whose
        logits are sampled (the last row of every sequence that catches up this step) and the
        prompt rows of sequences that asked for prompt logprobs ({seq_id: (first position, rows)})."""
        bs = self.block_size
        input_ids, positions, slots, cu, seq_lens, sample_rows, prompt_rows = [], [], [], [0], [], [], {}
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
            # position p's logits give token p + 1's distribution: prompt positions 0 .. P-2
            last = min(end, seq.num_prompt_tokens - 1)
            if seq.sampling_params.prompt_logprobs is not None and start < last:
                prompt_rows[seq.seq_id] = (start, range(cu[-2], cu[-2] + last - start))
        max_blocks = max(len(seq.block_table) for seq in out.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in out.seqs]
        t = lambda x, dtype: torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64), block_tables=t(tables, torch.int32),
            cu_seqlens_q=t(cu, torch.int32), seq_lens=t(seq_lens, torch.int32),
            max_seqlen_q=max(out.num_new_tokens), decode_only=max(out.num_new_tokens) == 1, kv=self.kv)
        return t(input_ids, torch.int64), t(positions, torch.int64), meta, sample_rows, prompt_rows

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepLogits:
        """Do the step's block moves, run the model, compute the logits that are needed."""
        self._move_blocks(out)
        input_ids, positions, meta, sample_rows, prompt_rows = self.prepare(out)
        rows = sample_rows + [r for _, rs in prompt_rows.values() for r in rs]
        rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        if self.model_impl == "native":
            attention = getattr(self.model, "attention_op", paged_attention)  # DeepSeek: mla_attention
            hidden = self.model(input_ids, positions, functools.partial(attention, meta))  # [T, hidden]
            logits = self.model.logits(hidden[rows]).float()  # [num_rows, vocab]
        else:
            with step_metadata(meta):
                decoder = getattr(self.model, self.model.base_model_prefix)  # the model without lm_head
                hidden = decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                 paged_metadata=meta).last_hidden_state[0]  # [T, hidden]
            logits = self.model.get_output_embeddings()(hidden[rows])  # [num_rows, vocab]
            if self.final_logit_softcapping:  # transformers' order: divide, tanh, multiply
                logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
            logits = logits.float()
        step = StepLogits(logits[:len(sample_rows)])
        offset = len(sample_rows)
        for seq_id, (first, rs) in prompt_rows.items():
            step.prompt[seq_id] = (first, logits[offset:offset + len(rs)])
            offset += len(rs)
        return step

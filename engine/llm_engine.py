"""Offline API mirroring vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampler import greedy, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None   # "stop" (EOS / stop token), "length" (max_tokens / max length)


@dataclass
class RequestOutput:
    """One prompt's result. A rejected request has ``error`` (a ValueError) and no outputs."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: ValueError | None = None


@dataclass
class RunStats:
    """Counters of one generate() call."""
    num_requests: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    prefix_cache_queries: int = 0   # prompt tokens looked up on admission
    prefix_cache_hits: int = 0      # of which found in the cache
    preemptions: dict = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    peak_kv_blocks: int = 0
    kv_tokens_stored: int = 0       # summed over steps
    kv_slots_allocated: int = 0     # summed over steps

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_utilization(self) -> float:
        """Tokens stored / slots allocated, averaged over steps (1.0 = no block slack)."""
        return self.kv_tokens_stored / self.kv_slots_allocated if self.kv_slots_allocated else 0.0

    def __str__(self):
        return (f"{self.num_requests} requests, {self.output_tokens} output tokens in {self.elapsed_s:.2f}s "
                f"({self.output_tokens_per_s:.1f} tok/s, {self.num_steps} steps) | prefix-cache hit rate "
                f"{self.prefix_cache_hit_rate:.1%} | preemptions {self.preemptions} | peak KV blocks "
                f"{self.peak_kv_blocks} | KV utilization {self.kv_utilization:.1%}")


@dataclass
class _Request:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: ValueError | None = None


class LLM:
    """A model plus a paged KV cache, scheduler and block manager. Arguments as in vLLM;
    the KV pool is num_kv_blocks blocks if given, else sized from kv_cache_memory_bytes (CPU,
    default 1 GiB) or gpu_memory_utilization (CUDA). model_impl: "native" (engine/models: Llama,
    Mistral, Qwen2), "transformers" (any decoder, through transformers' attention interface) or
    "auto" (native where it exists), as vLLM's option of that name."""

    def __init__(self, model: str, dtype: str = "float32", device: str | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, kv_cache_dtype: str = "auto",
                 preemption_mode: str = "recompute", swap_space_bytes: int = 1 << 30,
                 num_cpu_blocks: int | None = None, seed: int = 0, model_impl: str = "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.runner = ModelRunner(
            model, DTYPES[dtype], self.device, block_size, kv_cache_dtype, num_kv_blocks,
            kv_cache_memory_bytes, gpu_memory_utilization,
            num_cpu_blocks if preemption_mode == "swap" else 0,
            swap_space_bytes if preemption_mode == "swap" else 0, max_num_batched_tokens, model_impl)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size, self.runner.num_cpu_blocks,
                                          enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   enable_chunked_prefill, preemption_mode)
        self.tokenizer = self._load_tokenizer(model)
        cfg = self.runner.config
        self.eos_token_ids = self._eos_ids(cfg) | self._eos_ids(self.runner.generation_config)
        # no sliding-window attention in the ops: stay within the window, where it is exact
        limits = [getattr(cfg, "max_position_embeddings", None), getattr(cfg, "sliding_window", None)]
        self.max_model_len = min(x for x in limits if x) if any(limits) else 1 << 30
        self.max_pool_len = self.runner.num_kv_blocks * block_size
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.last_stats: RunStats | None = None

    @staticmethod
    def _load_tokenizer(model: str):
        if not any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model)

    @staticmethod
    def _eos_ids(cfg) -> set[int]:
        eos = getattr(cfg, "eos_token_id", None)
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # ---- requests --------------------------------------------------------------------
    def _make_request(self, i: int, prompt, params: SamplingParams) -> _Request:
        text, ids = None, []
        if isinstance(prompt, str):
            text = prompt
            if self.tokenizer is not None:
                ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, dict):
            ids = list(prompt["prompt_token_ids"])
        else:
            ids = list(prompt)
        req = _Request(i, text, ids, params)
        vocab = self.runner.config.vocab_size
        if text is not None and self.tokenizer is None:
            req.error = ValueError("string prompts need a tokenizer in the checkpoint; pass token ids")
        elif not ids:
            req.error = ValueError("empty prompt")
        elif not all(0 <= t < vocab for t in ids):
            req.error = ValueError(f"prompt token ids must be in [0, {vocab})")
        elif len(ids) > self.max_model_len:
            req.error = ValueError(f"prompt of {len(ids)} tokens is longer than the model's maximum "
                                   f"length {self.max_model_len}")
        elif len(ids) > self.max_pool_len:
            req.error = ValueError(f"prompt of {len(ids)} tokens does not fit in the whole KV pool "
                                   f"({self.max_pool_len} slots)")
        return req

    def _new_seq(self, req: _Request, ids: list[int], index: int, parent: Sequence | None = None) -> Sequence:
        seq = parent.fork(index) if parent else Sequence(ids, req.params, self.block_manager.block_size,
                                                          req.request_id)
        if req.params.temperature > 0:
            if req.params.seed is not None:
                seq.generator = torch.Generator(self.device).manual_seed(req.params.seed + index)
            else:
                seq.generator = self.generator
        req.seqs.append(seq)
        return seq

    def _finish_reason(self, seq: Sequence) -> str | None:
        p, token = seq.sampling_params, seq.last_token
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= min(self.max_model_len, self.max_pool_len):
            return "length"
        return None

    # ---- engine loop -----------------------------------------------------------------
    def step(self, requests: dict[int, _Request], stats: RunStats) -> list[Sequence]:
        """Schedule, run the model, sample; returns the sequences finished by this step."""
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler made no progress (KV pool too small for any request?)")
        stats.num_steps += 1
        bm = self.block_manager
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, bm.num_used_blocks)
        stats.kv_tokens_stored += bm.num_tokens_in_use
        stats.kv_slots_allocated += bm.num_used_blocks * bm.block_size
        logits = self.runner.run(out)
        greedy_ids = greedy(logits).tolist()  # one device sync for all greedy rows
        finished = []
        for row, seq in enumerate(self.scheduler.postprocess(out)):
            req = requests[seq.request_id]
            samples = [seq]
            while len(req.seqs) < req.params.n:  # parallel sampling: fork after the prompt
                child = self._new_seq(req, seq.token_ids, len(req.seqs), parent=seq)
                self.scheduler.fork(seq, child)
                samples.append(child)
            for s in samples:
                p = s.sampling_params
                s.append_token(greedy_ids[row] if p.temperature == 0 else sample(logits[row], p, s.generator))
                if reason := self._finish_reason(s):
                    self.scheduler.finish(s, reason)
                    finished.append(s)
        return finished

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (string, token-id list or {"prompt_token_ids": [...]});
        results come back in input order. Stats of the run are in ``self.last_stats``."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        bm, sched = self.block_manager, self.scheduler
        stats = RunStats(num_requests=len(prompts))
        q0, h0, p0 = bm.prefix_queries, bm.prefix_hits, dict(sched.num_preemptions)
        start = time.perf_counter()

        requests = {i: self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
        for req in requests.values():
            if req.error is None:
                sched.add(self._new_seq(req, req.prompt_token_ids, 0))
                stats.prompt_tokens += len(req.prompt_token_ids)
        pending = sum(r.params.n for r in requests.values() if r.error is None)
        bar = tqdm(total=len(prompts), desc="generate", disable=not (use_tqdm if use_tqdm is not None
                                                                        else len(prompts) >= 16))
        bar.update(len(prompts) - sum(r.error is None for r in requests.values()))
        try:
            while pending:
                for seq in self.step(requests, stats):
                    pending -= 1
                    stats.output_tokens += seq.num_completion_tokens
                    req = requests[seq.request_id]
                    if all(s.is_finished for s in req.seqs) and len(req.seqs) == req.params.n:
                        bar.update(1)
        except BaseException:
            sched.abort_all()  # leave the engine usable, with every block free
            bar.close()
            raise
        assert sched.is_finished()

        stats.elapsed_s = time.perf_counter() - start
        stats.prefix_cache_queries, stats.prefix_cache_hits = bm.prefix_queries - q0, bm.prefix_hits - h0
        stats.preemptions = {k: v - p0[k] for k, v in sched.num_preemptions.items()}
        bar.set_postfix_str(f"{stats.output_tokens_per_s:.1f} tok/s")
        bar.close()
        self.last_stats = stats
        logger.info("%s", stats)
        return [self._output(requests[i]) for i in range(len(prompts))]

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(s.sample_index, self._decode(s.completion_token_ids), s.completion_token_ids,
                                 s.finish_reason) for s in sorted(req.seqs, key=lambda s: s.sample_index)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, req.error)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

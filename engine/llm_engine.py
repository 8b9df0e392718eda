"""LLMEngine: vLLM's step API. ``add_request`` / ``step`` / ``has_unfinished_requests`` /
``abort_request``; ``LLM.generate`` (engine/llm.py) is a loop over ``step``."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from numbers import Integral

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop_string
from .model_runner import ModelRunner
from .outputs import CompletionOutput, Logprob, RequestOutput, RunStats
from .sampler import TokenConstraints, apply_penalties, greedy, sample, top_logprobs
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: ValueError | None = None   # set when the request failed inside a step
    constraints: TokenConstraints | None = None  # logit_bias, allowed_token_ids, bad_words

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer saved in path, or None when there is none (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)


class LLMEngine:
    """A model, its paged KV cache, the scheduler and the requests in flight."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, self.runner.num_cpu_blocks,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.preemption_mode)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        cfg = self.runner.config
        self.eos_token_ids = self._eos_ids(cfg) | self._eos_ids(self.runner.generation_config)
        # a sliding window is no limit: the ops take it as window_left (attention.window_left)
        model_limit = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len {config.max_model_len} is larger than the model's limit {model_limit} "
                             f"(max_position_embeddings)")
        self.max_model_len = config.max_model_len or model_limit
        self.max_pool_len = self.runner.num_kv_blocks * config.block_size
        self.device = self.runner.device
        self.generator = torch.Generator(self.device)
        if config.seed is None:  # vLLM's seed=None: a different run each time
            self.generator.seed()
        else:
            self.generator.manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.stats = RunStats()   # running totals; LLM.generate reports differences

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @staticmethod
    def _eos_ids(cfg) -> set[int]:
        eos = getattr(cfg, "eos_token_id", None)
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # ---- requests --------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, token ids, or {"prompt": ...} /
        {"prompt_token_ids": [...]}; ValueError when it cannot run."""
        text = None
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if "prompt" not in prompt and "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            text = prompt.get("prompt")
            prompt = prompt.get("prompt_token_ids", text)
        elif isinstance(prompt, str):
            text = prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer (in the checkpoint, or LLM(tokenizer=...)); "
                                 "pass token ids")
            ids = self.tokenizer(text)["input_ids"]
        else:
            ids = list(prompt)
        vocab = self.runner.config.vocab_size
        if not ids:
            raise ValueError("empty prompt")
        if not all(isinstance(t, Integral) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than the maximum length {self.max_model_len} "
                             f"(max_model_len)")
        if len(ids) == self.max_model_len:  # vLLM's rule: room for at least one output token
            raise ValueError(f"prompt of {len(ids)} tokens plus at least one output token is longer than the "
                             f"maximum length {self.max_model_len} (max_model_len)")
        if len(ids) > self.max_pool_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit in the whole KV pool "
                             f"({self.max_pool_len} slots)")
        return text, [int(t) for t in ids]

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError for a bad prompt, bad parameters or a duplicate id,
        and then leaves nothing behind (nor on any other exception)."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = dataclasses.replace(params or SamplingParams())  # validated again, and our own copy
        self._check_params(params)
        constraints = TokenConstraints.build(params, self.runner.config.vocab_size, self.tokenizer, self.device)
        text, ids = self._prompt_ids(prompt)
        req = Request(request_id, text, ids, params, prompt_logprobs=[None] if params.prompt_logprobs is not None
                      else None, constraints=constraints)
        seq = self._new_seq(req, ids, 0)
        self.requests[request_id] = req  # nothing above touched the engine's state
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: n against max_num_seqs (the n samples run at
        once, forked after the prompt, so a larger n could never be scheduled) and its token ids
        against the model's vocabulary (stop_token_ids out of it failed mid-generation once
        min_tokens banned them; logit_bias, allowed_token_ids and bad_words in TokenConstraints.build)."""
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} samples can never run at once with max_num_seqs="
                             f"{self.scheduler.max_num_seqs}: n must be <= max_num_seqs")
        vocab = self.runner.config.vocab_size
        if outside := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {outside}")

    def _new_seq(self, req: Request, ids: list[int], index: int, parent: Sequence | None = None) -> Sequence:
        p = req.params
        seq = parent.fork(index) if parent else Sequence(ids, p, self.config.block_size, req.request_id)
        seq.token_constraints = req.constraints
        if not p.greedy:
            seq.generator = (torch.Generator(self.device).manual_seed(p.seed + index) if p.seed is not None
                             else self.generator)
        if self.tokenizer is not None and parent is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens)
        if p.logprobs is not None:
            seq.logprobs = []
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now; their blocks are free when this returns. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self.requests.pop(rid, None)
            for seq in req.seqs if req else []:
                if not seq.is_finished:
                    self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the output so far of every request that got a
        token (cumulative, as vLLM's default), ``finished`` set on the last. An exception inside
        the model aborts every request (all blocks free, the prefix cache cleared: its newest
        blocks were registered but never written) and propagates; one while recording a
        request's prompt logprobs or choosing its tokens ends that request only, its output
        carrying the error."""
        if not self.requests:
            return []
        try:
            out = self.scheduler.schedule()
            if out.is_empty:
                raise RuntimeError("scheduler made no progress (KV pool too small for any request?)")
            self._count(out)
            logits = self.runner.run(out)
        except BaseException:
            self.scheduler.abort_all()
            self.requests.clear()
            raise
        touched: dict[str, Request] = {}  # the requests with an output this step
        for seq_id, (first, rows) in logits.prompt.items():
            seq = next(s for s in out.seqs if s.seq_id == seq_id)
            req = self.requests[seq.request_id]
            try:
                self._add_prompt_logprobs(req, seq, first, rows)
            except Exception as e:  # one request's failure ends that request only
                self._fail(req, e)
                touched[req.request_id] = req
        due = self.scheduler.postprocess(out)
        plain = [row for row, s in enumerate(due) if s.sampling_params.greedy and not self._needs_processing(s)]
        greedy_ids = dict(zip(plain, greedy(logits.sample[plain]).tolist()))  # one device sync
        for row, seq in enumerate(due):
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:  # its request failed earlier in this loop
                continue
            touched[req.request_id] = req
            try:
                samples = [seq]
                while len(req.seqs) < req.params.n:  # parallel sampling: fork after the prompt
                    child = self._new_seq(req, seq.token_ids, len(req.seqs), parent=seq)
                    self.scheduler.fork(seq, child)
                    samples.append(child)
                for s in samples:
                    self._append(s, logits.sample[row], greedy_ids.get(row))
            except Exception as e:  # one request's failure ends that request only
                self._fail(req, e)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _fail(self, req: Request, error: Exception) -> None:
        """End req alone after error inside a step: its sequences stop (their blocks are free)
        and its output carries the error."""
        self.abort_request(req.request_id)
        req.error = ValueError(f"request {req.request_id!r} failed: {error!r}")

    def _count(self, out) -> None:
        bm, stats = self.block_manager, self.stats
        stats.num_steps += 1
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, bm.num_used_blocks)
        stats.kv_tokens_stored += bm.num_tokens_in_use
        stats.kv_slots_allocated += bm.num_used_blocks * bm.block_size

    def _needs_processing(self, seq: Sequence) -> bool:
        p = seq.sampling_params
        return p.has_penalties or seq.num_completion_tokens < p.min_tokens or seq.token_constraints is not None

    def _append(self, seq: Sequence, raw: torch.Tensor, greedy_id: int | None) -> None:
        """Choose seq's next token from its raw logits row [vocab], record logprobs, detokenize,
        check the stop rules."""
        p, c = seq.sampling_params, seq.token_constraints
        token = greedy_id
        if token is None:
            # vLLM's order; the bans (-inf) commute with the rest, so they all come after the penalties
            logits = raw if c is None else c.add_bias(raw)
            if p.has_penalties:
                logits = apply_penalties(logits, seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids, p)
            banned = set(c.banned_words(seq.completion_token_ids)) if c is not None and c.bad_words else set()
            if seq.num_completion_tokens < p.min_tokens:  # no stop token may end it yet
                banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if c is not None and c.disallowed is not None:
                logits = logits.masked_fill(c.disallowed, float("-inf"))
            if banned:
                logits = logits.index_fill(0, torch.tensor(sorted(banned), device=logits.device), float("-inf"))
            token = sample(logits, p, seq.generator)
        if seq.logprobs is not None:
            entries = top_logprobs(torch.log_softmax(raw, -1), token, p.logprobs)
            seq.cumulative_logprob += entries[token][0]
            seq.logprobs.append(self._logprob_dict(entries))
        seq.append_token(token)
        reason = self._stop_token(seq)
        # vLLM leaves a stop token's text (EOS included) out unless include_stop_str_in_output
        new_chars = 0
        if seq.detokenizer and (reason is None or p.include_stop_str_in_output):
            new_chars = len(seq.detokenizer.add(token))
            seq.text = seq.detokenizer.text
        reason = reason or self._stop_string_or_length(seq, new_chars)
        if reason:
            self.scheduler.finish(seq, reason)
            self.stats.output_tokens += seq.num_completion_tokens

    def _stop_token(self, seq: Sequence) -> str | None:
        p, token = seq.sampling_params, seq.last_token
        if seq.num_completion_tokens < p.min_tokens:
            return None
        if token in self.eos_token_ids and not p.ignore_eos:
            return "stop"
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        return None

    def _stop_string_or_length(self, seq: Sequence, new_chars: int) -> str | None:
        p = seq.sampling_params
        if p.stop and new_chars and seq.num_completion_tokens >= p.min_tokens and (
                hit := find_stop_string(seq.text, new_chars, p.stop, p.include_stop_str_in_output)):
            seq.stop_reason, seq.text = hit
            return "stop"
        if (p.max_tokens is not None and seq.num_completion_tokens >= p.max_tokens) or \
                seq.num_tokens >= min(self.max_model_len, self.max_pool_len):
            return "length"
        return None

    def _add_prompt_logprobs(self, req: Request, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        # rows[j]: the distribution of prompt token first + j + 1. After a recompute preemption
        # the prompt runs again: keep what was recorded the first time
        k = req.params.prompt_logprobs
        logprobs = torch.log_softmax(rows, -1)
        for j in range(max(0, len(req.prompt_logprobs) - 1 - first), rows.shape[0]):
            token = seq.token_ids[first + j + 1]
            req.prompt_logprobs.append(self._logprob_dict(top_logprobs(logprobs[j], token, k)))

    def _logprob_dict(self, entries: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entries.items()}

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for s in sorted(req.seqs, key=lambda s: s.sample_index):
            text = s.text
            if not s.is_finished and s.sampling_params.stop and not s.sampling_params.include_stop_str_in_output:
                # hold back what could be the start of a stop string, as vLLM does when streaming
                text = text[:max(0, len(text) - max(map(len, s.sampling_params.stop)) + 1)]
            outs.append(CompletionOutput(s.sample_index, text, s.completion_token_ids,
                                         s.cumulative_logprob if s.logprobs is not None else None,
                                         s.logprobs, s.finish_reason, s.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outs,
                             req.finished or req.error is not None, req.error)

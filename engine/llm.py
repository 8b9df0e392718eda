"""Offline API mirroring vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
import time
from itertools import count

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput, RunStats
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# what get_default_sampling_params takes from the checkpoint's generation_config (vLLM's list)
GENERATION_CONFIG_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class LLM:
    """A model plus a paged KV cache, scheduler and block manager. Arguments: EngineConfig's
    (vLLM's names; see engine/README.md); a vLLM argument this engine does not have is a
    ValueError naming it. ``self.llm_engine`` is the step API underneath."""

    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self._request_ids = count()
        self.last_stats: RunStats | None = None

    # the parts the tests and benchmarks look at
    runner = property(lambda self: self.llm_engine.runner)
    block_manager = property(lambda self: self.llm_engine.block_manager)
    scheduler = property(lambda self: self.llm_engine.scheduler)
    tokenizer = property(lambda self: self.llm_engine.tokenizer)
    max_model_len = property(lambda self: self.llm_engine.max_model_len)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate uses without sampling_params (vLLM's rule): SamplingParams() with the
        values the checkpoint's generation_config sets among temperature, top_k, top_p, min_p,
        repetition_penalty and max_new_tokens (as max_tokens). A new object on every call."""
        gen = self.runner.generation_config
        diff = gen.to_diff_dict() if gen is not None else {}
        return SamplingParams(**{ours: diff[theirs] for theirs, ours in GENERATION_CONFIG_DEFAULTS.items()
                                 if diff.get(theirs) is not None})

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (string, token-id list, {"prompt": ...} or
        {"prompt_token_ids": [...]}); results come back in input order. A prompt the engine cannot
        run gets a RequestOutput with ``error`` (a ValueError) and the others go on. Stats of the
        call are in ``self.last_stats``. Without sampling_params: get_default_sampling_params()."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(prompts, (str, dict)) or (prompts and not isinstance(prompts[0], (str, dict, list, tuple))):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        engine, bm, sched = self.llm_engine, self.block_manager, self.scheduler
        engine.stats = RunStats(num_requests=len(prompts))
        q0, h0, p0 = bm.prefix_queries, bm.prefix_hits, dict(sched.num_preemptions)
        start = time.perf_counter()
        ids = [str(next(self._request_ids)) for _ in prompts]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate",
                   disable=not (use_tqdm if use_tqdm is not None else len(prompts) >= 16))
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                try:
                    engine.add_request(rid, prompt, p)
                except ValueError as e:
                    results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                                 [] if isinstance(prompt, str) else list(prompt), error=e)
                    bar.update(1)
            pending = set(ids) - set(results)
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
            for rid in pending:  # aborted from outside this call
                results[rid] = RequestOutput(rid, None, [], error=ValueError(f"request {rid!r} was aborted"))
        except BaseException:
            engine.abort_request(ids)  # leave the engine usable, with every block of this call free
            bar.close()
            raise
        stats = engine.stats
        stats.elapsed_s = time.perf_counter() - start
        stats.prefix_cache_queries, stats.prefix_cache_hits = bm.prefix_queries - q0, bm.prefix_hits - h0
        stats.preemptions = {k: v - p0[k] for k, v in sched.num_preemptions.items()}
        bar.set_postfix_str(f"{stats.output_tokens_per_s:.1f} tok/s")
        bar.close()
        self.last_stats = stats
        logger.info("%s", stats)
        return [results[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        them, rendered with the tokenizer's chat template (or ``chat_template``)."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer (in the checkpoint, or LLM(tokenizer=...))")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: pass chat_template=...")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
            # the template already holds the special tokens it wants (as vLLM: add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm)

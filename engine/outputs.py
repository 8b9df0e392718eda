"""What the engine returns, named as vLLM's outputs, plus per-call statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, its rank (1 = most
    likely) and its decoded text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None       # sum of the sampled tokens' logprobs (when logprobs asked)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None   # "stop" (EOS, stop token or string), "length", "abort"; None = running
    stop_reason: int | str | None = None   # the stop token id or stop string; None for EOS / length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result so far (``finished``: all its samples are done). A request that
    LLM.generate rejected has ``error`` (a ValueError) and no outputs."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # first position None, as vLLM
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

"""Per-request sampling settings, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    n: parallel samples per prompt; they share the prompt's KV blocks (copy-on-write).
    temperature: 0 means greedy (argmax); top_k (0 or -1 = off) and top_p (1 = off) filter
    the distribution before sampling. seed makes sampling reproducible per request:
    sample ``i`` of the request uses ``seed + i``.
    Generation stops after max_tokens tokens, at the model's EOS token (unless ignore_eos)
    or at any of stop_token_ids; the stop token is part of the output, as in vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

"""Per-request sampling settings, named and validated as in vLLM's ``SamplingParams``."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from numbers import Integral, Real

from .config import check_kwargs

logger = logging.getLogger(__name__)
_MIN_TEMPERATURE = 1e-2  # vLLM raises smaller positive temperatures to this: logits / 1e-45 overflow


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM's names, defaults and rules).

    n: parallel samples of the prompt; they share its KV blocks (copy-on-write). The engine also
    checks, on admission, what needs the model or the scheduler: n <= max_num_seqs and
    stop_token_ids inside the vocabulary.
    temperature: 0 is greedy. top_k (0 or -1 = off), top_p (1 = off) and min_p (0 = off) filter
    the distribution after the temperature. presence/frequency penalties (in [-2, 2]) subtract
    from the logits of tokens already generated; repetition_penalty (> 0, 1 = off) divides
    positive and multiplies negative logits of tokens in the prompt or the output.
    seed: sample i of the request draws from its own generator seeded ``seed + i``.
    Stops: max_tokens (None: until the model's or the KV pool's length limit), the model's EOS
    (unless ignore_eos), stop_token_ids (the token stays in the output) and stop strings
    (cut from the text unless include_stop_str_in_output); none of them before min_tokens.
    logprobs / prompt_logprobs: k most likely tokens per position plus the chosen one, from the
    model's raw distribution (before penalties and temperature), as vLLM's default.
    best_of: None or n (the same thing: all n samples are returned); vLLM V1 removed best_of > n,
    and so does this engine (a ValueError).
    logit_bias ({token id: bias} added to the logits), allowed_token_ids (every other token is
    -inf) and bad_words (strings, tokenized at admission as vLLM does, with and without a leading
    space: a word's last token is banned when the output ends with the tokens before it) apply to
    greedy requests too, in vLLM's order: allowed_token_ids, bad_words, min_tokens and logit_bias,
    then the penalties. Their token ids must be in the model's vocabulary (checked on admission).
    Any other keyword is a ValueError naming it, not a TypeError.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __new__(cls, *args, **kwargs):
        # before the dataclass' __init__, which would raise a TypeError for an unknown keyword
        check_kwargs("SamplingParams", kwargs, {f.name for f in dataclasses.fields(cls)})
        return super().__new__(cls)

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Check every field (vLLM's rules); also run on admission, as the object is mutable."""
        self.stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be None or an int >= n ({self.n}), got {self.best_of!r}")
            if self.best_of > self.n:
                raise ValueError(f"best_of={self.best_of} > n={self.n} is not supported by paged_ops' engine "
                                 f"(vLLM V1 removed it): ask for n={self.best_of} with logprobs=0 and keep the "
                                 f"outputs with the highest cumulative_logprob")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_is_real(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (_is_real(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s: using %s", self.temperature, _MIN_TEMPERATURE,
                           _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and -2 ** 63 <= self.seed
                                          and self.seed + self.n - 1 < 2 ** 64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64 - n), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < -1):
                raise ValueError(f"{name} must be None, -1 (whole vocabulary) or an int >= 0, got {k!r}")
        self._verify_token_constraints()

    def _verify_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
            # token ids as ints, or as decimal strings (JSON keys, OpenAI's API), as vLLM converts them
            key = lambda t: int(t) if isinstance(t, str) and t.isdecimal() else t
            bias = {key(t): b for t, b in self.logit_bias.items()}
            if not all(_is_int(t) and t >= 0 and _is_real(b) for t, b in bias.items()):
                raise ValueError(f"logit_bias must map token ids (ints >= 0) to finite numbers, got {self.logit_bias!r}")
            self.logit_bias = {int(t): float(b) for t, b in bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list of token ids, got []")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be ints >= 0, got {self.allowed_token_ids!r}")
        words = [] if self.bad_words is None else [self.bad_words] if isinstance(self.bad_words, str) \
            else list(self.bad_words)
        if not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        self.bad_words = list(dict.fromkeys(words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_token_constraints(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words set: the token is chosen one row at a time."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

"""Token choice for one row of logits: logit_bias, penalties, then the bans (allowed_token_ids,
bad_words, min_tokens), then greedy or temperature, min-p, top-k and top-p sampling (vLLM's
order); plus the logprobs of the raw distribution."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

_FLOAT64_MAX = torch.finfo(torch.float64).max


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on logits [vocab]: repetition_penalty on every token seen in the prompt or
    the output (positive logits divided, negative ones multiplied), then frequency_penalty x the
    token's count in the output and presence_penalty once per token present in the output.

    Computed in float64 and saturated at its largest finite values, as any repetition_penalty > 0
    is valid: 1e-300 is 0 in float32 and made every seen positive logit inf (then softmax nan),
    while in float64 they keep their order (the limit: the strongest seen token wins)."""
    logits = logits.double()
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab)[:vocab].to(logits)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt_ids, dtype=torch.int64)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen.to(logits.device), penalized, logits)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits)
    return logits.clamp(-_FLOAT64_MAX, _FLOAT64_MAX)


@dataclass
class TokenConstraints:
    """A request's logit_bias, allowed_token_ids and bad_words as the sampler uses them, built once
    on admission (``build``): bias ids and values, the mask of the tokens outside
    allowed_token_ids, and the bad words' token ids."""
    bias_ids: torch.Tensor | None = None       # [k] int64
    bias_values: torch.Tensor | None = None    # [k] float32
    disallowed: torch.Tensor | None = None     # [vocab] bool: True outside allowed_token_ids
    bad_words: list[list[int]] = field(default_factory=list)

    @classmethod
    def build(cls, params: SamplingParams, vocab_size: int, tokenizer, device) -> TokenConstraints | None:
        """None when params set none of them; ValueError (naming the argument) for a token id
        outside [0, vocab_size) or bad_words without a tokenizer."""
        if not params.has_token_constraints:
            return None
        c = cls()
        check = lambda name, ids: _check_vocab(name, ids, vocab_size)
        if params.logit_bias:
            check("logit_bias", params.logit_bias)
            c.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
            c.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        if params.allowed_token_ids is not None:
            check("allowed_token_ids", params.allowed_token_ids)
            c.disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            c.disallowed[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=device)] = False
        if params.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words needs a tokenizer (in the checkpoint, or LLM(tokenizer=...))")
            c.bad_words = bad_words_token_ids(params.bad_words, tokenizer)
            check("bad_words", [t for ids in c.bad_words for t in ids])
        return c

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.bias_ids is None else logits.index_add(0, self.bias_ids, self.bias_values.to(logits))

    def banned_words(self, output_ids: list[int]) -> list[int]:
        """The last token of every bad word whose other tokens end output_ids (vLLM: the output only,
        not the prompt)."""
        return [ids[-1] for ids in self.bad_words
                if len(ids) - 1 <= len(output_ids) and (len(ids) == 1 or output_ids[1 - len(ids):] == ids[:-1])]


def _check_vocab(name: str, ids, vocab_size: int) -> None:
    if outside := sorted({t for t in ids if t >= vocab_size}):
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {outside}")


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word without its leading spaces, and with one
    leading space when that is another token sequence of the same length (tokenizers that mark
    word starts, as SentencePiece's "▁", give a word inside a text other ids than at its start)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask to -inf every logit outside the top_k largest and outside the smallest set whose
    probability reaches top_p; the most likely token always stays (vLLM's rule), so a top_p too
    small to reach (1e-300 is 0 against float32 probabilities) keeps just it. logits: [vocab]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep tokens until the mass before them reaches top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def greedy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``logits.argmax(-1)`` (first maximum on ties) for logits [rows, vocab], in two steps: the
    first chunk holding the row's maximum (vectorized ``amax``), then the argmax inside it. On
    CPU torch's argmax over a long row runs scalar, ~10x slower than this for a 32000-wide row."""
    rows, vocab = logits.shape
    if rows == 0:  # a step of only partial prefill chunks samples nothing
        return logits.argmax(-1)
    pad = -vocab % chunk
    x = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    x = x.view(rows, -1, chunk)
    best = x.amax(-1).argmax(-1)  # [rows]: argmax returns the first chunk with the maximum
    return best * chunk + x[torch.arange(rows, device=x.device), best].argmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of (already penalized) logits [vocab] (float32, or float64 after
    apply_penalties). The row is shifted to a maximum of 0 first (softmax does not change), so
    dividing by the temperature can only push logits towards -inf, never to inf or nan."""
    if params.greedy:
        return int(logits.argmax())
    logits = apply_min_p((logits - logits.max()) / params.temperature, params.min_p)
    logits = apply_top_k_top_p(logits, params.top_k, params.top_p)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, tuple[float, int]]:
    """{token id: (logprob, rank)} for the k most likely tokens (all for k = -1) and ``token``,
    from logprobs [vocab]; rank 1 is the most likely (vLLM's Logprob.rank)."""
    k = logprobs.shape[-1] if k == -1 else min(k, logprobs.shape[-1])
    chosen = float(logprobs[token])
    out = {token: (chosen, int((logprobs > logprobs[token]).sum()) + 1)}
    if k:
        values, ids = logprobs.topk(k)
        for rank, (lp, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(t, (lp, rank))
    return out

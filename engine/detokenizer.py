"""Incremental detokenization and stop strings.

Decoding one token at a time can split a character (byte-level BPE) or drop a leading space
(SentencePiece), so each new token is decoded together with a few tokens before it, and text is
only emitted once it no longer ends in an incomplete character (the replacement character)."""
from __future__ import annotations

import copy

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens, for their spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[str] = self._to_tokens(prompt_ids[-_CONTEXT_TOKENS - 1:])
        self.prefix_offset = max(len(self.tokens) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.tokens)
        self.text = ""

    def fork(self) -> IncrementalDetokenizer:
        child = copy.copy(self)
        child.tokens = list(self.tokens)
        return child

    def _to_tokens(self, ids: list[int]) -> list[str]:
        return [t for t in self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=self.skip_special_tokens)
                if t is not None]

    def add(self, token_id: int) -> str:
        """Append a token; returns the text it completes (possibly empty)."""
        self.tokens += self._to_tokens([token_id])
        to_string = self.tokenizer.convert_tokens_to_string
        before = to_string(self.tokens[self.prefix_offset:self.read_offset])
        after = to_string(self.tokens[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        delta = after[len(before):]
        self.text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: list[str], include: bool) -> tuple[str, str] | None:
    """(stop string, text cut after it or before it) for the first stop string that the last
    num_new_chars characters complete, or None. Only the tail is searched: earlier text was
    checked when it arrived."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return stop, text[:i + len(stop)] if include else text[:i]

"""One generated sequence: its tokens, how many of them are in the KV cache, and its blocks."""
from __future__ import annotations

from enum import Enum, auto
from itertools import count

import torch

from .sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()   # not admitted, or preempted by recompute (holds no blocks)
    RUNNING = auto()   # holds GPU blocks for its first num_computed_tokens tokens
    SWAPPED = auto()   # preempted by swap: its blocks live in the CPU pool
    FINISHED = auto()


class Sequence:
    """Tokens of one sample plus its KV-cache bookkeeping (nano-vllm's names).

    The single scheduling rule: ``num_computed_tokens`` (tokens whose K/V are in the cache)
    catches up with ``num_tokens``. A fresh prompt is all uncomputed (prefill), possibly
    over several steps (chunked prefill); after sampling there is one uncomputed token
    (decode); after a recompute preemption everything is uncomputed again.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 16, request_id: str = "0", sample_index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.sample_index = sample_index          # i of the request's n samples
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []          # GPU block ids, block i holds tokens [i*bs, (i+1)*bs)
        self.cpu_block_table: list[int] = []      # while SWAPPED
        self.num_cached_blocks = 0                # leading full blocks registered in the prefix cache
        self.block_hashes: list[int] = []         # hash chain over full blocks of token_ids
        self.finish_reason: str | None = None     # "stop", "length" or "abort", as vLLM
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.generator: torch.Generator | None = None
        self.token_constraints = None             # the request's sampler.TokenConstraints, if any
        self.detokenizer = None                   # IncrementalDetokenizer when there is a tokenizer
        self.text = ""                            # output text, stop string cut off
        self.logprobs: list[dict] | None = None   # per output token, when asked for
        self.cumulative_logprob = 0.0

    def __len__(self):
        return len(self.token_ids)

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold all current tokens."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_seats(self) -> int:
        """Places this sequence takes among the scheduler's max_num_seqs (vLLM's
        get_max_num_running_seqs): all n samples of its request until they fork from it, when its
        first token is sampled; one after."""
        if self.sample_index == 0 and self.num_completion_tokens == 0:
            return self.sampling_params.n
        return 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        """Token ids stored in block i (the last block may be partly filled)."""
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, sample_index: int) -> Sequence:
        """A sibling with the same tokens and computed state; the caller shares the blocks."""
        child = Sequence(self.token_ids, self.sampling_params, self.block_size, self.request_id, sample_index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = list(self.block_table)
        child.num_cached_blocks = self.num_cached_blocks
        child.block_hashes = list(self.block_hashes)
        child.detokenizer = self.detokenizer.fork() if self.detokenizer else None
        return child

"""Iteration-level scheduler: one rule for prefill, chunked prefill and decode."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What one step runs: ``num_new_tokens[i]`` tokens of ``seqs[i]`` starting at its
    num_computed_tokens, plus the block moves to do first (swap out, swap in, copy)."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Each step, every running sequence's num_computed_tokens catches up with its tokens as
    far as the token budget allows (oldest first), then waiting requests are admitted while
    max_num_batched_tokens and max_num_seqs allow. A sequence counts against max_num_seqs with
    its seats: the n samples it will fork into after its prompt, so forks never overshoot. When
    blocks run out the most recently admitted sequence is preempted, by recompute (drop its
    blocks, re-prefill later) or by swap (move its blocks to the CPU pool)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute"):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last is preempted first
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not (self.waiting or self.running or self.swapped)

    def _chunk(self, seq: Sequence, budget: int, num_computed: int | None = None) -> int:
        """Tokens of seq to compute now: all uncomputed ones, cut to the budget. Without
        chunked prefill a prompt runs whole or waits (0), unless it could never fit."""
        remaining = seq.num_tokens - (seq.num_computed_tokens if num_computed is None else num_computed)
        if (not self.enable_chunked_prefill and remaining > budget
                and remaining <= self.max_num_batched_tokens):
            return 0
        return min(remaining, budget)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks; the block bookkeeping is done, the data moves are in the output."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running sequences, oldest first; preempt from the back when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                break
            while not bm.can_append(seq, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq preempted itself: everything after it is gone too
            out.blocks_to_copy += bm.append_slots(seq, n)
            self._add_to_batch(out, seq, n)
            budget -= n
            i += 1

        # 2. swapped sequences first (they arrived earlier), then waiting ones, while their
        # seats fit; nothing new while this step had to preempt
        seats = sum(seq.num_seats for seq in self.running)
        while not out.preempted and self.swapped and seats + self.swapped[0].num_seats <= self.max_num_seqs:
            seq = self.swapped[0]
            n = self._chunk(seq, budget)
            if n == 0 or not bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += bm.swap_in(seq)
            out.blocks_to_copy += bm.append_slots(seq, n)
            self._admit(out, seq, n)
            seats += seq.num_seats
            budget -= n
        while (not out.preempted and not self.swapped and self.waiting
               and seats + self.waiting[0].num_seats <= self.max_num_seqs and budget > 0):
            seq = self.waiting[0]
            cached = bm.get_computed_blocks(seq)
            n = self._chunk(seq, budget, len(cached) * bm.block_size)
            if n == 0 or not bm.can_allocate(seq, cached, n):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached, n)
            self._admit(out, seq, n)
            seats += seq.num_seats
            budget -= n
        return out

    def _add_to_batch(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + n)

    def _admit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add_to_batch(out, seq, n)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        bm = self.block_manager
        if self.preemption_mode == "swap" and bm.can_swap_out(seq):
            out.blocks_to_swap_out += bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)  # victims go newest first, so the oldest ends up in front
            self.num_preemptions["swap"] += 1
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.num_preemptions["recompute"] += 1
        out.preempted.append(seq)

    def postprocess(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed counts after a step; returns the sequences whose next token is due."""
        to_sample = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                to_sample.append(seq)
        return to_sample

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add child, a copy of running parent sharing its blocks (parallel sampling), in one
        of the seats the parent held since its admission."""
        self.block_manager.fork(parent, child)
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished sequences free their blocks at once."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.block_manager.free(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop one sequence wherever it is, freeing its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.free_cpu(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, seq.finish_reason or "abort"

    def abort_all(self) -> None:
        """Drop every request (after an error in a step), freeing all blocks. The prefix cache
        is dropped too: blocks are registered when scheduled, and the failed step never wrote them."""
        for seq in self.running:
            self.block_manager.free(seq)
        for seq in self.swapped:
            self.block_manager.free_cpu(seq)
        self.running, self.waiting, self.swapped = [], deque(), deque()
        self.block_manager.reset_prefix_cache()

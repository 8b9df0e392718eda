"""KV block pool: reference counts, an LRU free queue, prefix caching, copy-on-write and swap.

Every block is either in use (ref_count > 0) or in the free queue. A freed block keeps its
contents and its prefix hash, so a later request with the same prefix can take it back
(a cache hit); it is only evicted, lazily, when the free queue hands it out again.
The queue is LRU: blocks are appended when freed and taken from the front.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence

_ROOT_HASH = -1  # parent hash of a sequence's first block


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class Block:
    """One KV block; ``hash`` is set once it is full and registered in the prefix cache."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.num_tokens = 0  # slots filled (or being filled this step)
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    """Allocates GPU blocks to sequences (``seq.block_table``) and CPU blocks for swapping.

    The manager only does bookkeeping; the data moves it asks for are returned as
    ``[(src, dst), ...]`` block pairs for the model runner (copy_blocks / swap_blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.free_cpu_block_ids: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # pop() -> 0, 1, ...
        self.num_cpu_blocks = num_cpu_blocks
        self.prefix_queries = 0   # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0      # of which found
        self.num_tokens_in_use = 0  # filled slots of in-use blocks, kept up to date for KV utilization

    # ---- pool primitives -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _take_free_block(self) -> int:
        """Pop the least recently freed block, evicting its prefix-cache entry if it has one."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count, block.num_tokens = 1, 0
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:  # a cache hit on a free block takes it out of the queue
            del self.free_block_ids[block_id]
            self.num_tokens_in_use += block.num_tokens
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None  # most recently used: evicted last
            self.num_tokens_in_use -= block.num_tokens

    # ---- prefix caching --------------------------------------------------------------
    def block_hash(self, seq: Sequence, i: int) -> int:
        """Hash of full block i of seq, chained over its parent's hash (cached on the seq)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else _ROOT_HASH
            seq.block_hashes.append(hash((parent, tuple(seq.block(j)))))
        return seq.block_hashes[i]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of seq already in the cache. Stops one token short of the end:
        the last token is always computed, since its logits are needed. A sequence that wants
        prompt logprobs computes its whole prompt (a hit would skip those positions' logits)."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
                break  # a miss (or a hash collision) ends the chain
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register seq's full blocks among its first num_tokens (default: the computed ones) so
        other requests can reuse them. The scheduler registers a step's blocks when it schedules
        them: a request admitted in the same step may hit them, since every layer writes the whole
        batch's K/V before any attention reads it."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        for i in range(seq.num_cached_blocks, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            h = self.block_hash(seq, i)
            if block.hash is None and h not in self.hash_to_block_id:
                block.hash, block.token_ids = h, tuple(seq.block(i))
                self.hash_to_block_id[h] = block.block_id
            seq.num_cached_blocks = i + 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks themselves stay where they are)."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.hash_to_block_id.clear()

    # ---- sequence-level API ----------------------------------------------------------
    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Could seq be admitted with prefix hits ``cached`` and num_new_tokens computed now?"""
        needed = cdiv(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
        hits_on_free = sum(self.blocks[b].ref_count == 0 for b in cached)
        return needed <= self.num_free_blocks - hits_on_free

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Admit seq: take its prefix hits, then blocks for num_new_tokens more tokens."""
        assert not seq.block_table
        for block_id in cached:
            self._acquire(block_id)
        seq.block_table = list(cached)
        seq.num_cached_blocks = len(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens
        self.append_slots(seq, num_new_tokens)

    def _needs_cow(self, seq: Sequence) -> bool:
        # the next token goes into a partly filled last block shared with another sequence
        return (seq.num_computed_tokens % self.block_size != 0
                and self.blocks[seq.block_table[-1]].ref_count > 1)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return needed + self._needs_cow(seq) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for num_new_tokens after seq's computed tokens.

        Returns the copy-on-write pairs (src, dst): a shared, partly filled last block is
        copied to a private one before seq writes into it.
        """
        copies = []
        if self._needs_cow(seq):
            src, dst = seq.block_table[-1], self._take_free_block()
            self._release(src)
            seq.block_table[-1] = dst
            copies.append((src, dst))
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < cdiv(end, self.block_size):
            seq.block_table.append(self._take_free_block())
        self._set_filled(seq, seq.num_computed_tokens // self.block_size, end)
        return copies

    def _set_filled(self, seq: Sequence, first_block: int, num_tokens: int) -> None:
        # seq's blocks from first_block on hold its tokens up to num_tokens
        for i in range(first_block, len(seq.block_table)):
            block = self.blocks[seq.block_table[i]]
            filled = min(self.block_size, max(0, num_tokens - i * self.block_size))
            if filled > block.num_tokens:
                self.num_tokens_in_use += filled - block.num_tokens
                block.num_tokens = filled

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first: a chain's tail is then evicted before its head,
        which more requests are likely to share."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (a copy of parent) shares all of parent's blocks."""
        assert child.block_table == parent.block_table
        for block_id in child.block_table:
            self._acquire(block_id)

    # ---- swapping --------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu_block_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to the CPU pool; returns (gpu block, cpu block) pairs.
        A block shared with another sequence is copied, not moved: the sharer keeps it."""
        mapping = [(b, self.free_cpu_block_ids.pop()) for b in seq.block_table]
        self.free(seq)
        seq.cpu_block_table = [cpu for _, cpu in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = max(len(seq.cpu_block_table), cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return needed <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring seq's blocks back into fresh GPU blocks; returns (cpu block, gpu block) pairs."""
        mapping = [(cpu, self._take_free_block()) for cpu in seq.cpu_block_table]
        self.free_cpu_block_ids.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
        seq.block_table = [gpu for _, gpu in mapping]
        seq.num_cached_blocks = 0  # registered again when scheduled
        self._set_filled(seq, 0, seq.num_computed_tokens)
        return mapping

    def free_cpu(self, seq: Sequence) -> None:
        self.free_cpu_block_ids.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []

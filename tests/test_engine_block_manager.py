"""Block manager unit tests: exact block ids, ref counts, prefix hits, LRU eviction, CoW, swap."""
from engine.block_manager import BlockManager
from engine.sequence import Sequence


def make(tokens, bs=4):
    return Sequence(tokens, block_size=bs)


def compute(bm, seq, n=None):
    """Pretend a step computed n (default: all remaining) tokens of seq."""
    seq.num_computed_tokens += seq.num_tokens - seq.num_computed_tokens if n is None else n
    bm.cache_full_blocks(seq)


def refs(bm):
    return [b.ref_count for b in bm.blocks]


def test_allocate_and_free_lru_order():
    bm = BlockManager(8, 4)
    a = make(list(range(10)))
    assert bm.can_allocate(a, [], 10)
    bm.allocate(a, [], 10)
    assert a.block_table == [0, 1, 2] and a.num_blocks == 3
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0] and bm.num_free_blocks == 5
    assert not bm.can_allocate(make(list(range(30))), [], 30)  # 8 blocks > 5 free
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    # freed last block first, so a chain's head is evicted last
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_prefix_hit_and_last_token_always_computed():
    bm = BlockManager(8, 4)
    a = make(list(range(10)))
    bm.allocate(a, [], 10)
    compute(bm, a)
    assert bm.blocks[0].hash is not None and bm.blocks[1].hash is not None and bm.blocks[2].hash is None
    b = make(list(range(8)) + [99, 98, 97])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    bm.allocate(b, hits, 3)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert refs(bm)[:4] == [2, 2, 1, 1]
    # a prompt that is exactly cached still recomputes its last block's last token
    c = make(list(range(8)))
    assert bm.get_computed_blocks(c) == [0]
    # a different first block breaks the chain even if the second block matches
    d = make([50, 1, 2, 3] + list(range(4, 8)) + [0])
    assert bm.get_computed_blocks(d) == []
    assert bm.prefix_hits == 8 and bm.prefix_queries == 10 + 11


def test_freed_blocks_hit_until_evicted_lru():
    bm = BlockManager(6, 4)
    a = make(list(range(12)) + [7])
    bm.allocate(a, [], 13)
    compute(bm, a)
    bm.free(a)                                   # queue: 4, 5, 3, 2, 1, 0
    assert list(bm.free_block_ids) == [4, 5, 3, 2, 1, 0]
    b = make(list(range(12)) + [8])
    assert bm.get_computed_blocks(b) == [0, 1, 2]  # cache hit on free blocks
    # allocating 4 unrelated blocks evicts 4, 5 (unhashed), then 3 and 2, least recently used first
    e = make([100] * 16)
    bm.allocate(e, [], 16)
    assert e.block_table == [4, 5, 3, 2]
    assert bm.blocks[2].hash is None
    assert bm.get_computed_blocks(b) == [0, 1]
    assert bm.can_allocate(b, [0, 1], 5) is False  # needs 1 new block + takes 2 free hits: 0 left
    bm.free(e)                                   # queue: 1, 0, 2, 3, 5, 4
    assert bm.can_allocate(b, [0, 1], 5)
    bm.allocate(b, [0, 1], 5)
    assert b.block_table == [0, 1, 2, 3] and b.num_computed_tokens == 8 and bm.num_free_blocks == 2


def test_copy_on_write_for_shared_partial_block():
    bm = BlockManager(8, 4)
    parent = make([1, 2, 3, 4, 5, 6])
    bm.allocate(parent, [], 6)
    compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert refs(bm)[:2] == [2, 2]
    child.append_token(7)
    assert bm.can_append(child, 1)
    assert bm.append_slots(child, 1) == [(1, 2)]          # private copy of the shared last block
    assert child.block_table == [0, 2] and refs(bm)[:3] == [2, 1, 1]
    parent.append_token(9)
    assert bm.append_slots(parent, 1) == []               # parent now owns block 1 alone
    assert parent.block_table == [0, 1]
    bm.free(parent), bm.free(child)
    assert bm.num_free_blocks == 8


def test_no_cow_when_the_shared_prefix_is_block_aligned():
    bm = BlockManager(8, 4)
    parent = make([1, 2, 3, 4])
    bm.allocate(parent, [], 4)
    compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    child.append_token(5)
    assert bm.append_slots(child, 1) == [] and child.block_table == [0, 1]


def test_swap_round_trip():
    bm = BlockManager(4, 4, num_cpu_blocks=3)
    a = make(list(range(10)))
    bm.allocate(a, [], 10)
    compute(bm, a)
    assert bm.can_swap_out(a)
    assert bm.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    assert a.block_table == [] and a.cpu_block_table == [0, 1, 2] and bm.num_free_blocks == 4
    other = make([9] * 4)
    bm.allocate(other, [], 4)                                  # takes block 3
    assert bm.can_swap_in(a, 1) is True and not bm.can_swap_in(a, 3)
    assert bm.swap_in(a) == [(0, 2), (1, 1), (2, 0)]           # freed in reverse: 2, 1, 0
    assert a.block_table == [2, 1, 0] and a.num_computed_tokens == 10
    assert sorted(bm.free_cpu_block_ids) == [0, 1, 2] and bm.num_free_blocks == 0

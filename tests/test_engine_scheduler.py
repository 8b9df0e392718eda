"""Scheduler unit tests without a model: steps are simulated by appending a fake token."""
import random

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=16, bs=4, cpu_blocks=0, **kw):
    return Scheduler(BlockManager(num_blocks, bs, cpu_blocks), **kw)


def add(sched, n_tokens, first=0):
    seq = Sequence(list(range(first, first + n_tokens)), block_size=sched.block_manager.block_size)
    sched.add(seq)
    return seq


def step(sched):
    """schedule + postprocess, sampling token 1 for every sequence that caught up."""
    out = sched.schedule()
    for seq in sched.postprocess(out):
        seq.append_token(1)
    return out


def batch(out):
    return [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens)]


def test_prefill_then_decode_in_one_mixed_batch():
    sched = make_scheduler(max_num_batched_tokens=64)
    a = add(sched, 5)
    assert batch(step(sched)) == [(a.seq_id, 5)]
    b = add(sched, 7, first=20)
    out = step(sched)
    assert batch(out) == [(a.seq_id, 1), (b.seq_id, 7)]       # a decodes while b prefills
    assert a.num_computed_tokens == 6 and a.num_tokens == 7 and b.num_tokens == 8


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = add(sched, 10)
    b = add(sched, 3, first=20)
    assert batch(step(sched)) == [(a.seq_id, 4)]
    assert batch(step(sched)) == [(a.seq_id, 4)]
    assert batch(step(sched)) == [(a.seq_id, 2), (b.seq_id, 2)]  # a's last chunk, b's first
    assert a.num_tokens == 11 and b.num_computed_tokens == 2 and b.num_tokens == 3
    assert batch(step(sched)) == [(a.seq_id, 1), (b.seq_id, 1)]


def test_no_chunking_when_disabled():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = add(sched, 6)
    b = add(sched, 4, first=20)
    assert batch(step(sched)) == [(a.seq_id, 6)]                # b (4) does not fit in 2 left: waits
    assert batch(step(sched)) == [(a.seq_id, 1), (b.seq_id, 4)]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, 3, first=10 * i) for i in range(3)]
    assert [s for s, _ in batch(step(sched))] == [seqs[0].seq_id, seqs[1].seq_id]
    assert list(sched.waiting) == [seqs[2]]


def test_full_prefix_hit_still_computes_last_token():
    sched = make_scheduler()
    a = add(sched, 8)
    step(sched)
    sched.finish(a, "stop")
    assert sched.block_manager.num_free_blocks == 16             # finished requests free at once
    b = add(sched, 8)
    out = step(sched)
    assert batch(out) == [(b.seq_id, 4)]                         # block 0 hit, block 1 recomputed
    assert b.block_table[0] == 0 and sched.block_manager.prefix_hits == 4


def test_preempt_most_recent_by_recompute():
    sched = make_scheduler(num_blocks=4, bs=2)
    a, b = add(sched, 3), add(sched, 3, first=10)
    step(sched)                                  # a: blocks [0, 1], b: [2, 3]; both sampled 1 token
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    step(sched)                                  # 4th token fits in each second block
    out = sched.schedule()                       # 5th token needs a new block: none left
    assert out.preempted == [b] and batch(out) == [(a.seq_id, 1)]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b] and sched.num_preemptions == {"recompute": 1, "swap": 0}
    assert a.block_table == [0, 1, 3]            # b's tail block (freed first) reused
    sched.postprocess(out)
    sched.finish(a, "length")
    out = step(sched)                            # b recomputes, its first block from the cache
    assert batch(out) == [(b.seq_id, 3)] and b.num_computed_tokens == 5


def test_preempt_by_swap_and_swap_back_in():
    sched = make_scheduler(num_blocks=4, bs=2, cpu_blocks=4, preemption_mode="swap")
    a, b = add(sched, 3), add(sched, 3, first=10)
    step(sched), step(sched)
    out = sched.schedule()
    assert out.preempted == [b] and out.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert b.status == SequenceStatus.SWAPPED and b.num_computed_tokens == 4 and b.cpu_block_table == [0, 1]
    assert sched.num_preemptions == {"recompute": 0, "swap": 1}
    sched.postprocess(out)
    c = add(sched, 1, first=50)
    sched.finish(a, "length")
    out = sched.schedule()                       # swapped b goes before waiting c; queue 2, 3, 1, 0
    assert out.blocks_to_swap_in == [(0, 2), (1, 3)] and batch(out)[0] == (b.seq_id, 1)
    assert b.block_table == [2, 3, 1] and b.status == SequenceStatus.RUNNING
    assert batch(out)[1] == (c.seq_id, 1)


def test_swap_falls_back_to_recompute_when_cpu_pool_full():
    sched = make_scheduler(num_blocks=4, bs=2, cpu_blocks=1, preemption_mode="swap")
    a, b = add(sched, 3), add(sched, 3, first=10)
    step(sched), step(sched)
    out = sched.schedule()
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING and out.blocks_to_swap_out == []


def test_sole_sequence_preempts_itself_then_resumes():
    sched = make_scheduler(num_blocks=3, bs=2)
    a, b = add(sched, 4), add(sched, 1, first=10)
    step(sched)                                  # a: [0, 1], b: [2]; both sampled
    out = sched.schedule()                       # a needs a 3rd block: b (newest) goes
    assert out.preempted == [b] and batch(out) == [(a.seq_id, 1)]


def test_prefix_hit_within_the_same_step():
    sched = make_scheduler()
    a, b = add(sched, 9), add(sched, 10)        # b shares a's first two blocks
    out = sched.schedule()
    assert batch(out) == [(a.seq_id, 9), (b.seq_id, 2)]
    assert b.block_table[:2] == a.block_table[:2]


def _check_invariants(sched):
    bm = sched.block_manager
    holders = {}
    for seq in sched.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for seq in [*sched.waiting, *sched.swapped]:
        assert seq.block_table == []
    assert [b.ref_count for b in bm.blocks] == [holders.get(i, 0) for i in range(bm.num_blocks)]
    filled = {}
    for seq in sched.running:
        for i, b in enumerate(seq.block_table):
            filled[b] = max(filled.get(b, 0), min(bm.block_size, max(0, seq.num_computed_tokens - i * bm.block_size)))
    assert all(bm.blocks[b].num_tokens == f for b, f in filled.items())
    assert bm.num_tokens_in_use == sum(filled.values())
    assert set(bm.free_block_ids) == {i for i in range(bm.num_blocks) if i not in holders}
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block_id.items())
    cpu_held = [c for s in sched.swapped for c in s.cpu_block_table]
    assert sorted(cpu_held + bm.free_cpu_block_ids) == list(range(bm.num_cpu_blocks))


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_kv_consistent(seed):
    """A fake KV store follows every block move the scheduler asks for; each slot holds the
    token prefix that produced it. Whatever is read through a block table must be the
    sequence's own prefix: this checks prefix hits, CoW, swap and preemption together."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_blocks, num_cpu = rng.randint(12, 40) // bs + 8, rng.choice([0, 4, 64])
    sched = Scheduler(BlockManager(num_blocks, bs, num_cpu, enable_prefix_caching=rng.random() < 0.8),
                      max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(3, 24),
                      enable_chunked_prefill=rng.random() < 0.8,
                      preemption_mode=rng.choice(["recompute", "swap"]))
    gpu = [[None] * bs for _ in range(num_blocks)]
    cpu = [[None] * bs for _ in range(num_cpu)]
    want = {}  # seq -> (max_tokens, n)
    for _ in range(rng.randint(2, 10)):  # prompts share prefixes over a 3-token vocabulary
        seq = Sequence([rng.randrange(3) for _ in range(rng.randint(1, 10))], block_size=bs)
        sched.add(seq)
        want[seq] = (rng.randint(1, 6), rng.choice([1, 1, 3]))
    for _ in range(2000):
        if sched.is_finished():
            break
        out = sched.schedule()
        assert out.seqs, "no progress"
        for g, c in out.blocks_to_swap_out:
            cpu[c] = list(gpu[g])
        for c, g in out.blocks_to_swap_in:
            gpu[g] = list(cpu[c])
        for s, d in out.blocks_to_copy:
            gpu[d] = list(gpu[s])
        for seq, n in zip(out.seqs, out.num_new_tokens):
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                gpu[seq.block_table[p // bs]][p % bs] = tuple(seq.token_ids[:p + 1])
        for seq, n in zip(out.seqs, out.num_new_tokens):  # what attention reads
            for p in range(seq.num_computed_tokens + n):
                assert gpu[seq.block_table[p // bs]][p % bs] == tuple(seq.token_ids[:p + 1])
        for seq in sched.postprocess(out):
            max_tokens, n = want[seq]
            samples = [seq]
            if n > 1 and seq.num_completion_tokens == 0:
                for i in range(1, n):
                    child = seq.fork(i)
                    sched.fork(seq, child)
                    want[child] = (max_tokens, 1)
                    samples.append(child)
                want[seq] = (max_tokens, 1)
            for s in samples:
                s.append_token(rng.randrange(3))
                if s.num_completion_tokens >= max_tokens or s.num_tokens >= num_blocks * bs:
                    sched.finish(s, "length")
        _check_invariants(sched)
    assert sched.is_finished()
    assert sched.block_manager.num_free_blocks == num_blocks

"""64-bit offsets: every op that touches a cache, on caches whose element offsets pass 2^31 and 2^32.

A kernel that multiplies an index by a stride in 32 bits (block x block stride, KV head x head
stride) reads or writes the wrong place, or faults, only once a cache holds more than 2^31 (signed)
or 2^32 (unsigned) elements: several GB, a normal size for one layer on a large GPU. Here such caches
cost almost nothing: they live in a sparse memory-mapped file (`truncate`, then
`torch.from_file(shared=True)`), and only the few blocks a test touches ever get pages.

Every CPU-runnable backend (cpu, cuda_emu, triton under the interpreter) runs every cache op on
- token-major caches (NHD: [num_blocks, block_size, num_kv_heads, head_size]),
- HND caches ([num_blocks, num_kv_heads, block_size, head_size] permuted to the contract view),
- head-major caches ([num_kv_heads, num_blocks, block_size, head_size] permuted to the contract
  view): the head stride, just over 2^30, fits 32 bits, but KV heads 2-4 start past 2^31 and head 4
  past 2^32, so kv_head x head_stride needs 64 bits,
each in a 16-bit dtype and in fp8, with the blocks in use at the start, around 2^31 and at the far
end of the cache. The key and value caches share one file, the value cache right after the key
cache: a wrapped offset that lands in the other cache is caught too. Results are compared with
paged_ops.reference on the touched blocks; guard blocks next to the used ones are poisoned and
must stay so.
"""
from __future__ import annotations

import os

import pytest
import torch

import paged_ops
from paged_ops import reference
from paged_ops.testing import assert_close, poison

BACKENDS = ("cpu", "cuda_emu", "triton")
LAYOUTS = ("NHD", "HND", "head_major")
# (query dtype, cache dtype): a 16-bit cache, and fp8 read with fp16 queries
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "e4m3": (torch.float16, torch.float8_e4m3fn)}

BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE = 16, 5, 10, 64
BLOCK_ELEMS = BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE
# 2^20 + 8 blocks: 5.4e9 elements per cache. Token-major: the middle blocks sit past 2^31, the
# last ones past 2^32 (block stride 5120). Head-major: head stride 2^30 + 8192 (see above).
NUM_BLOCKS = (1 << 20) + 8
FAR = [NUM_BLOCKS - 1, NUM_BLOCKS - 2, NUM_BLOCKS - 3]
MID = [NUM_BLOCKS // 2 - 1, NUM_BLOCKS // 2]
NEAR = [0, 1]
GUARDS = [NUM_BLOCKS - 4, NUM_BLOCKS // 2 + 1, 2]  # next to used blocks, in no table or mapping
# Pages a test may give the file (the touched blocks of both caches), far below its size.
MAX_FILE_BYTES = 64 << 20


class BigCaches:
    """A key and a value cache of NUM_BLOCKS blocks each in one sparse file."""

    def __init__(self, tmp_path, layout: str, cache_dtype: torch.dtype):
        esize = torch.empty(0, dtype=cache_dtype).element_size()
        cache_bytes = NUM_BLOCKS * BLOCK_ELEMS * esize
        self.path = tmp_path / "kv_cache.bin"
        with open(self.path, "wb") as f:
            f.truncate(2 * cache_bytes)
        raw = torch.from_file(str(self.path), shared=True, size=2 * cache_bytes, dtype=torch.uint8)
        caches = []
        for i in range(2):
            flat = raw[i * cache_bytes:(i + 1) * cache_bytes].view(cache_dtype)
            if layout == "NHD":
                c = flat.view(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
            elif layout == "HND":
                c = flat.view(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE).transpose(1, 2)
            else:
                c = flat.view(NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE).permute(1, 2, 0, 3)
            caches.append(c)
        self.key_cache, self.value_cache = caches
        self.dtype = cache_dtype
        assert min(self.max_offset(c) for c in caches) >= 1 << 32
        if layout == "head_major":
            assert caches[0].stride(2) < 1 << 31 <= 2 * caches[0].stride(2) and 4 * caches[0].stride(2) >= 1 << 32

    @staticmethod
    def max_offset(c: torch.Tensor) -> int:
        return sum((n - 1) * s for n, s in zip(c.shape, c.stride()))

    def touch(self, blocks) -> None:
        """Poison these blocks of both caches (the only pages the test gives the file)."""
        ids = torch.tensor(blocks, dtype=torch.int64)
        for c in (self.key_cache, self.value_cache):
            block = poison(torch.empty(len(blocks), *c.shape[1:], dtype=c.dtype))
            c[ids] = block

    def blocks(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of these blocks of both caches, as raw bytes (exact comparison, NaN included)."""
        ids = torch.tensor(ids, dtype=torch.int64)
        return tuple(c[ids].contiguous().view(torch.uint8) for c in (self.key_cache, self.value_cache))

    def check_guards(self) -> None:
        key, value = self.blocks(GUARDS)
        expected = poison(torch.empty(len(GUARDS), *self.key_cache.shape[1:], dtype=self.dtype))
        expected = expected.view(torch.uint8)
        assert torch.equal(key, expected), "a block in no table or mapping of the key cache was written"
        assert torch.equal(value, expected), "a block in no table or mapping of the value cache was written"

    def check_sparse(self) -> None:
        allocated = os.stat(self.path).st_blocks * 512
        assert allocated <= MAX_FILE_BYTES, f"the sparse cache file got {allocated} bytes: something materialized it"


def scales(cache_dtype, g):
    if cache_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None, None
    return ((torch.rand(NUM_KV_HEADS, generator=g) * 0.05 + 0.01).float(),
            (torch.rand(NUM_KV_HEADS, generator=g) * 0.05 + 0.01).float())


@pytest.fixture(params=BACKENDS)
def ops(request):
    # An unavailable backend fails here rather than being skipped: each must run these.
    return paged_ops.backend(request.param)


# Two sequences whose blocks alternate between the ends of the cache and its middle.
TABLES = [[FAR[0], NEAR[0], MID[1], FAR[2]], [MID[0], FAR[1], NEAR[1], 0]]
SEQ_LENS = [3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 9]
Q_LENS = [5, 4]


def filled_caches(tmp_path, layout, cache_dtype, g):
    """Big caches whose sequences' tokens hold random K/V; every other slot of a touched block is NaN."""
    big = BigCaches(tmp_path, layout, cache_dtype)
    big.touch(sorted({b for row in TABLES for b in row}) + GUARDS)
    k_scale, v_scale = scales(cache_dtype, g)
    block_tables = torch.tensor(TABLES, dtype=torch.int32)
    for s, n in enumerate(SEQ_LENS):
        pos = torch.arange(n)
        slots = block_tables[s, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=g)
        reference.reshape_and_cache(k, v, big.key_cache, big.value_cache, slots, k_scale, v_scale)
    return big, block_tables, torch.tensor(SEQ_LENS, dtype=torch.int32), k_scale, v_scale


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_attention(ops, layout, dtypes, tmp_path):
    dtype, cache_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(1)
    big, block_tables, seq_lens, k_scale, v_scale = filled_caches(tmp_path, layout, cache_dtype, g)
    query = torch.randn(len(SEQ_LENS), NUM_HEADS, HEAD_SIZE, generator=g).to(dtype)
    args = (query, big.key_cache, big.value_cache, block_tables, seq_lens, HEAD_SIZE ** -0.5, k_scale, v_scale)
    out = poison(torch.empty_like(query))
    ops.decode_attention(out, *args)
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.decode_attention(ref, query.double(), *args[1:])
    assert_close(out, ref, dtype)
    big.check_guards()
    big.check_sparse()


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_attention(ops, layout, dtypes, tmp_path):
    dtype, cache_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(2)
    big, block_tables, seq_lens, k_scale, v_scale = filled_caches(tmp_path, layout, cache_dtype, g)
    cu_seqlens_q = torch.tensor([0, Q_LENS[0], sum(Q_LENS)], dtype=torch.int32)
    query = torch.randn(sum(Q_LENS), NUM_HEADS, HEAD_SIZE, generator=g).to(dtype)
    args = (query, big.key_cache, big.value_cache, block_tables, cu_seqlens_q, seq_lens, max(Q_LENS),
            HEAD_SIZE ** -0.5, True, k_scale, v_scale)
    out = poison(torch.empty_like(query))
    ops.prefill_attention(out, *args)
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.prefill_attention(ref, query.double(), *args[1:])
    assert_close(out, ref, dtype)
    big.check_guards()
    big.check_sparse()


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache(ops, layout, dtypes, tmp_path):
    dtype, cache_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(3)
    big = BigCaches(tmp_path, layout, cache_dtype)
    used = NEAR + MID + FAR
    big.touch(used + GUARDS)
    k_scale, v_scale = scales(cache_dtype, g)
    # One token per used block, at different offsets, plus a padding token (slot -1).
    slots = [b * BLOCK_SIZE + (3 * i) % BLOCK_SIZE for i, b in enumerate(used)] + [-1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    key = torch.randn(len(slots), NUM_KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    value = torch.randn(len(slots), NUM_KV_HEADS, HEAD_SIZE, generator=g).to(dtype)
    ops.reshape_and_cache(key, value, big.key_cache, big.value_cache, slot_mapping, k_scale, v_scale)

    # The reference on a small cache holding copies of the used blocks (all poisoned before).
    small_k = poison(torch.empty(len(used), *big.key_cache.shape[1:], dtype=cache_dtype))
    small_v = poison(torch.empty_like(small_k))
    small_slots = torch.tensor([i * BLOCK_SIZE + s % BLOCK_SIZE for i, s in enumerate(slots[:-1])] + [-1])
    reference.reshape_and_cache(key, value, small_k, small_v, small_slots, k_scale, v_scale)
    key_blocks, value_blocks = big.blocks(used)
    assert torch.equal(key_blocks, small_k.view(torch.uint8)), "key cache blocks differ from the reference"
    assert torch.equal(value_blocks, small_v.view(torch.uint8)), "value cache blocks differ from the reference"
    big.check_guards()
    big.check_sparse()


def random_blocks(n, cache_dtype, g):
    # [n, block_size, num_kv_heads, head_size]; fp8 as random bytes without NaN
    shape = (n, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.randint(0, 0x70, shape, generator=g, dtype=torch.uint8).view(cache_dtype)
    return torch.randn(shape, generator=g).to(cache_dtype)


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_blocks(ops, layout, dtypes, tmp_path):
    _, cache_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(4)
    big = BigCaches(tmp_path, layout, cache_dtype)
    # far -> near, near -> far, middle -> far, far -> middle
    pairs = [(FAR[0], NEAR[0]), (NEAR[1], FAR[1]), (MID[0], FAR[2]), (FAR[2] - 5, MID[1])]
    used = sorted({b for p in pairs for b in p})
    big.touch(used + GUARDS)
    srcs = [s for s, _ in pairs]
    for c in (big.key_cache, big.value_cache):
        c[torch.tensor(srcs)] = random_blocks(len(srcs), cache_dtype, g)
    before = big.blocks(used)
    mapping = torch.tensor(pairs, dtype=torch.int64)
    ops.copy_blocks([big.key_cache], [big.value_cache], mapping)

    # The reference on small caches holding the used blocks, ids remapped.
    index = {b: i for i, b in enumerate(used)}
    small = [b.view(cache_dtype).view(len(used), BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE).clone() for b in before]
    reference.copy_blocks([small[0]], [small[1]], torch.tensor([(index[s], index[d]) for s, d in pairs]))
    after = big.blocks(used)
    assert torch.equal(after[0], small[0].view(torch.uint8)), "key cache blocks differ from the reference"
    assert torch.equal(after[1], small[1].view(torch.uint8)), "value cache blocks differ from the reference"
    big.check_guards()
    big.check_sparse()


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_blocks(ops, layout, dtypes, tmp_path):
    _, cache_dtype = DTYPES[dtypes]
    g = torch.Generator().manual_seed(5)
    big = BigCaches(tmp_path, layout, cache_dtype)
    out_blocks, in_blocks = [FAR[0], MID[1], NEAR[0]], [FAR[1], MID[0], FAR[2]]
    big.touch(out_blocks + in_blocks + GUARDS)
    big.key_cache[torch.tensor(out_blocks)] = random_blocks(len(out_blocks), cache_dtype, g)
    # Swap out: far blocks of the big cache into a small one (NHD, contiguous).
    small = poison(torch.empty(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=cache_dtype))
    out_map = torch.tensor([(b, i) for i, b in enumerate(out_blocks)], dtype=torch.int64)
    ops.swap_blocks(big.key_cache, small, out_map)
    expected = poison(torch.empty_like(small))
    reference.swap_blocks(big.key_cache, expected, out_map)
    assert torch.equal(small.view(torch.uint8), expected.view(torch.uint8)), "swapped-out blocks differ"

    # Swap in: from a small cache into blocks of the big value cache.
    src = random_blocks(3, cache_dtype, g)
    in_map = torch.tensor([(i, b) for i, b in enumerate(in_blocks)], dtype=torch.int64)
    ops.swap_blocks(src, big.value_cache, in_map)
    got = big.blocks(in_blocks)[1]
    assert torch.equal(got, src.contiguous().view(torch.uint8)), "swapped-in blocks differ"
    # The key cache's copies of those blocks (and the guards) are still poison.
    untouched = poison(torch.empty(len(in_blocks), *big.key_cache.shape[1:], dtype=cache_dtype))
    assert torch.equal(big.blocks(in_blocks)[0], untouched.view(torch.uint8))
    big.check_guards()
    big.check_sparse()

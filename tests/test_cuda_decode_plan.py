"""The bandwidth decode kernel (csrc/kernels/decode.cuh, issue #23 item 2) under the emulator: its
split-KV plan taken from the device's SM count (the emulator's, set by
paged_cuda_emu_test.set_num_sms), the cp.async ring at tile sizes that leave every stage partial,
the group spread over head tiles of <= 4 heads, the general (odd view) loop next to the fast one (any
block size, any head up to its lanes' width), and split rows merged inside thread-block clusters (the emulated sm_90
plans them as an H100 / H200 would; paged_cuda_emu_test.set_max_cluster_size picks the size). Same standards as tests/test_cuda_emu.py: fresh random inputs, NaN in
the output and the unused cache slots, the float64 reference.
"""
from __future__ import annotations

import pytest
import torch

import paged_ops
from bench.sass import PLAN_FIELDS  # backend.cpp decode_plan
from paged_ops.testing import assert_close, assert_lse_close, make_case, nan_like, poison

if "cuda_emu" not in paged_ops.available_backends():  # optional: built only where CUDA's headers are
    pytest.skip("the cuda_emu backend is not built", allow_module_level=True)

selftest = torch.ops.paged_cuda_emu_test
CONFIG_FIELDS = ("threads", "partition_size", "kv_tile", "force_split", "tensor_cores")  # kernels/params.h


def config_list(**kw) -> list[int]:
    return [int(kw.get(k, 0)) for k in CONFIG_FIELDS]


def _restored(setter):
    """A fixture's body: yields set(n), which calls setter(n) (it returns the value it replaces); the
    first value replaced is put back when the test ends."""
    previous = []

    def set_value(n):
        previous.append(setter(n))

    yield set_value
    if previous:
        setter(previous[0])


@pytest.fixture
def num_sms():
    """num_sms(n): the emulated device has n SMs until the test ends."""
    yield from _restored(selftest.set_num_sms)


@pytest.fixture
def max_cluster():
    """max_cluster(n): plans may take thread-block clusters of up to n blocks (0: none; -1: the arch's,
    16 on the emulated sm_90) until the test ends."""
    yield from _restored(selftest.set_max_cluster_size)


def plan(case, softcap=0.0, alibi_slopes=None, **config) -> dict:
    out = nan_like(case.query)
    args = case.decode_args(out)[:6]  # out, query, key_cache, value_cache, block_tables, seq_lens
    return dict(zip(PLAN_FIELDS, selftest.decode_plan(*args, config_list(**config), softcap, alibi_slopes)))


def ctas(pl):
    return pl["grid_x"] * pl["grid_y"] * pl["grid_z"]


def run_decode(case, config=None):
    out = poison(case.query.new_empty(case.out_shape))
    if config is None:
        paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out))
    else:
        selftest.decode_attention_config(*case.decode_args(out), config_list(**config))
    assert_close(out, case.reference_prefill(), case.dtype)
    return out


def batch_one_case(ctx=4096):
    # The batch-1 shape: 32 query heads over 8 KV heads, head 128, bf16, block 16.
    return make_case([ctx], num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                     spare_blocks=1, spare_columns=0, seed=5)


def test_batch_one_plan_fills_132_sms(num_sms, max_cluster):
    # Before: 512-token partitions at least, so 8 KV heads x 4096 tokens launched 64 CTAs on 132 SMs.
    # (A device without thread-block clusters: with them, the plan below.)
    num_sms(132)
    max_cluster(0)
    pl = plan(batch_one_case())
    assert pl["split"] and ctas(pl) >= 132 * 2 and pl["cluster_blocks"] == 0, pl
    assert pl["partition_size"] % 16 == 0 and pl["partition_size"] >= 32, pl  # whole pages, two at least
    assert pl["heads_per_thread"] == 4 and pl["threads"] == 128, pl


def test_batch_one_plan_is_a_cluster_per_kv_head(num_sms):
    # sm_90 (the emulator's default arch): a row's partitions are one cluster of 16 blocks of 8 warps,
    # which merge their partials in distributed shared memory (no workspace, no reduce kernel); tiles
    # of one step of each of the 16 token groups, the fast loop kept.
    num_sms(132)
    pl = plan(batch_one_case())
    assert pl["cluster_blocks"] == 16 and pl["grid_z"] == 16 and ctas(pl) == 8 * 16, pl
    assert pl["split"] and pl["threads"] == 256 and pl["partition_size"] == 256 and pl["tile_tokens"] == 64, pl
    assert pl["fast_path"] and pl["heads_per_thread"] == 4, pl


def test_no_cluster_where_it_would_not_fill_the_device(num_sms):
    num_sms(132)
    # 1 KV head: 16 blocks on 132 SMs; the reduce kernel's plan (hundreds of blocks) instead.
    one_kv = plan(make_case([4096], num_heads=8, num_kv_heads=1, head_size=128, block_size=16,
                            dtype=torch.bfloat16, seed=1))
    assert one_kv["split"] and one_kv["cluster_blocks"] == 0 and ctas(one_kv) >= 128, one_kv  # 32-token partitions
    # A full batch is not split at all; a windowed row may need one partition more than its length.
    assert plan(make_case([40] * 64, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                          dtype=torch.bfloat16, seed=1))["cluster_blocks"] == 0
    # Before sm_90 there are no clusters.
    before = selftest.set_emulated_arch(80)
    try:
        assert plan(batch_one_case())["cluster_blocks"] == 0
    finally:
        selftest.set_emulated_arch(before)


def test_plan_follows_the_sm_count(num_sms):
    case = batch_one_case()
    num_sms(1)
    assert not plan(case)["split"]  # 8 blocks already fill one SM twice over
    num_sms(16)
    sixteen = plan(case)
    num_sms(264)
    more = plan(case)
    assert ctas(sixteen) >= 32 and ctas(more) >= 528 and more["partition_size"] < sixteen["partition_size"]


def test_partitions_go_down_to_two_pages(num_sms):
    num_sms(132)
    pl = plan(make_case([256], num_heads=4, num_kv_heads=1, head_size=64, block_size=16, seed=2))
    assert pl["split"] and pl["partition_size"] == 32 and pl["grid_z"] >= 8, pl  # (the table has a spare column)


def test_a_full_batch_is_not_split(num_sms):
    # 64 sequences x 8 KV heads = 512 blocks: two per SM already, the one-pass kernel.
    num_sms(132)
    case = make_case([40] * 64, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                     seed=1)
    pl = plan(case)
    assert not pl["split"] and ctas(pl) == 512, pl


@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("group,head_size,dtype,cache_dtype", [
    (4, 128, torch.bfloat16, None), (8, 64, torch.float16, torch.float8_e4m3fn), (1, 256, torch.float32, None),
    (3, 96, torch.bfloat16, torch.float8_e5m2)])
def test_one_and_132_sm_plans_match_the_reference(num_sms, sms, group, head_size, dtype, cache_dtype):
    num_sms(sms)
    case = make_case([1, 37, 300, 700], num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, cache_dtype=cache_dtype, scale_kind="head", seed=group + sms)
    pl = plan(case)
    assert pl["split"] == (sms == 132), pl  # 8 blocks: one pass on 1 SM, partitions on 132
    run_decode(case)


@pytest.mark.parametrize("group,config", [
    (8, dict(kv_tile=1, threads=32)),                        # one token a tile: every stage a tail
    (4, dict(kv_tile=5, threads=64, force_split=1, partition_size=24)),  # tiles straddling pages and partitions
    (2, dict(kv_tile=48, threads=256)),                      # several steps per tile and token group
    (8, dict(threads=96)),                                   # token groups not a multiple of the head tiles
    (6, dict()),                                             # a partial last head tile
    (16, dict(threads=64, kv_tile=3)),                       # two head chunks of one tile each
])
def test_ring_shapes(group, config):
    case = make_case([1, 15, 16, 17, 95, 130], num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.bfloat16, seed=group)
    run_decode(case, config)


def odd_views(case):
    """The case with its caches moved one element into wider rows: odd element offset and head stride."""
    for name in ("key_cache", "value_cache"):
        c = getattr(case, name)
        wide = torch.full(c.shape[:-1] + (c.shape[-1] + 1,), float("nan"), dtype=c.dtype)[..., 1:]
        wide.copy_(c)
        setattr(case, name, wide)
    return case


@pytest.mark.parametrize("block_size", [6, 16, 80])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("odd", [False, True])
def test_odd_views_and_block_sizes(block_size, group, odd):
    # An odd element offset and head stride: the ring falls back to 2-byte copies, the general loop.
    # A block size that is no power of two (6, 80: pages that tiles of 8 / 16 / 32 tokens straddle) takes
    # the fast loop as a power of two does: locate_tile's FastDivmod finds every token's page. Before,
    # such a block size sent the call to the general loop (a shift was the fast loop's page lookup).
    case = make_case([1, 17, 70, 121], num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=block_size,
                     dtype=torch.bfloat16, seed=block_size + group)
    if odd:
        odd_views(case)
    assert plan(case)["fast_path"] == (not odd)
    run_decode(case)
    run_decode(case, dict(force_split=1, partition_size=32))  # partitions that start inside a page


@pytest.mark.parametrize("head_size,cache_dtype", [(80, None), (96, None), (112, torch.float8_e4m3fn), (40, None),
                                                   (192, torch.float8_e5m2)])
@pytest.mark.parametrize("group", [1, 4])
def test_heads_narrower_than_their_lanes(head_size, cache_dtype, group):
    # A head narrower than its token group's 8 x TPT lanes (80 / 96 / 112 on 16, 40 on 8, 192 on 32)
    # takes the fast loop: rows staged at the lanes' width, the head's 16-byte units copied, each staged
    # row's tail zeroed once (decode.cuh zero_row_tails: the emulator's shared memory starts as NaN, so
    # a tail left as it was would be a NaN output through the idle lanes' q of 0). Before, these heads
    # took the general loop (plan.h decode_fast_path wanted head == 8 x TPT). One pass, split, and the
    # soft-cap / ALiBi instance over a 16-bit cache.
    num_heads = 2 * group
    case = make_case([1, 17, 70, 121], num_heads=num_heads, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=torch.bfloat16, cache_dtype=cache_dtype, seed=head_size + group,
                     **(dict(scale_kind="head") if cache_dtype else {}))
    assert plan(case)["fast_path"]
    run_decode(case)
    run_decode(case, dict(force_split=1, partition_size=32))
    if cache_dtype is None:
        g = torch.Generator().manual_seed(head_size)
        kw = dict(softcap=20.0, alibi_slopes=torch.rand(num_heads, generator=g) * 0.1)
        pl = plan(case, **kw)
        assert pl["fast_path"] and pl["score_mods"]
        out = nan_like(case.query)
        selftest.decode_attention_config(*case.decode_args(out), config_list(), **kw)
        assert_close(out, case.reference_decode_lse(**kw)[0], case.dtype)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("group", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_the_owners_softmax_follows_a_rising_max(head_size, group, dtype, split):
    # The fast loop's softmax is computed by each score's owner (decode.cuh OwnedSoftmax): a head's max
    # over a step's rows by shuffles among its owners, the running max and sum per owned score, the sums
    # of a head's owners added at the end. Keys scaled up along the sequence (1 + t / 8) move the max of
    # every head whose q . k is positive into the latest steps (by up to a hundred in the exponent, so
    # the earlier steps' rescales underflow) and keep it in the first ones for the others; the out and
    # lse against the float64 reference, a partial head tile (group 3), rows past the tile, split.
    # Lanes per token 8, 16, 32 (heads 64, 128, 256): two scores a lane, one, one held by two lanes.
    case = make_case([3, 70, 301], num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, seed=head_size + group)
    bs = case.key_cache.shape[1]
    for s, n in enumerate(case.seq_lens.tolist()):
        t = torch.arange(n)
        blocks, offsets = case.block_tables[s].long()[t // bs], t % bs
        rising = (1 + t.double() / 8).view(-1, 1, 1)
        case.key_cache[blocks, offsets] = (case.key_cache[blocks, offsets].double() * rising).to(dtype)
    config = dict(force_split=1, partition_size=64) if split else dict(partition_size=-1)
    pl = plan(case, **config)
    assert pl["fast_path"] and pl["split"] == split and pl["heads_per_thread"] == min(group + group % 2, 4)
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"))
    selftest.decode_attention_config(*case.decode_args(out), config_list(**config), lse=lse)
    want, want_lse = case.reference_decode_lse()
    assert_close(out, want, dtype)
    assert_lse_close(lse, want_lse, dtype)


def test_the_fast_path_is_the_plain_loop():
    # plan.h decode_fast_path: decode_kernel<..., true, *> is compiled with 16-byte copies, so a call
    # needing other copies must not take it; a soft-cap / ALiBi takes its instances with them
    # (<..., true, true>: the plan's score_mods) over any cache (fp8 ones took the general loop before).
    case = make_case([5, 40], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.bfloat16, seed=4)
    assert plan(case)["fast_path"] and not plan(case)["score_mods"]
    assert plan(case, partition_size=32, force_split=1)["fast_path"]  # split-KV: outside the loop
    for mods in (dict(softcap=30.0), dict(alibi_slopes=torch.rand(8)), dict(softcap=30.0, alibi_slopes=torch.rand(8))):
        assert plan(case, **mods)["fast_path"] and plan(case, **mods)["score_mods"]
        fp8 = make_case([5, 40], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.bfloat16,
                        cache_dtype=torch.float8_e4m3fn, scale_kind="head", seed=5)
        assert plan(fp8)["fast_path"] and not plan(fp8)["score_mods"]
        assert plan(fp8, **mods)["fast_path"] and plan(fp8, **mods)["score_mods"]
    assert not plan(odd_views(case))["fast_path"]
    for block_size in (1, 12, 64):  # any block size: the page by FastDivmod, outside the loop's copies
        assert plan(make_case([9], num_heads=4, num_kv_heads=1, head_size=64, block_size=block_size,
                              seed=block_size))["fast_path"]
    latent = make_case([9], num_heads=16, num_kv_heads=1, head_size=576, value_head_size=512, value_in_key=True,
                       block_size=16, dtype=torch.bfloat16, seed=2)
    assert not plan(latent)["fast_path"]  # decode_wide_kernel has one loop
    narrow_values = make_case([9], num_heads=4, num_kv_heads=1, head_size=128, value_head_size=64, block_size=16,
                              seed=6)
    assert not plan(narrow_values)["fast_path"]  # its copies and rows are one head size for K and V
    run_decode(narrow_values)
    # An 8-byte row (head 8, fp8) has no whole 16-byte copy: the choice must not divide by its 0 copies
    # (it did: SIGFPE in the binding, found by test_ops' random shapes).
    tiny = make_case([9], num_heads=2, num_kv_heads=1, head_size=8, block_size=16, cache_dtype=torch.float8_e4m3fn,
                     scale_kind="head", seed=3)
    assert not plan(tiny)["fast_path"]
    run_decode(tiny)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("variant", ["none", "window_sinks_lse", "softcap", "alibi"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("loop", ["fast", "general"])
def test_both_loops_against_the_reference(variant, cache_dtype, split, loop):
    # The same shape and modifiers through the fast loop (no modifier, or only those acting outside the
    # loop; the soft-cap and ALiBi in its score-mods instance) and the general one (the caches viewed
    # one element into wider rows: odd_views), one pass and split.
    num_heads = 8
    case = make_case([1, 30, 200], num_heads=num_heads, num_kv_heads=2, head_size=128, block_size=16,
                     dtype=torch.bfloat16, cache_dtype=cache_dtype, seed=len(variant) + split,
                     **(dict(scale_kind="head") if cache_dtype else {}))
    if loop == "general":
        case = odd_views(case)
    g = torch.Generator().manual_seed(7)
    kw = {"none": {}, "softcap": dict(softcap=15.0), "alibi": dict(alibi_slopes=torch.rand(num_heads, generator=g)),
          "window_sinks_lse": dict(window_left=50, sinks=torch.randn(num_heads, generator=g))}[variant]
    config = dict(force_split=1, partition_size=32) if split else dict(partition_size=-1)
    on_plan = {k: v for k, v in kw.items() if k in ("softcap", "alibi_slopes")}
    mods = variant in ("softcap", "alibi")
    pl = plan(case, **on_plan, **config)
    assert (pl["fast_path"], pl["score_mods"]) == (loop == "fast", loop == "fast" and mods)
    want, want_lse = case.reference_decode_lse(**kw)
    out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"))
    selftest.decode_attention_config(*case.decode_args(out), config_list(**config), **kw, lse=lse)
    assert_close(out, want, case.dtype)
    assert_close(lse, want_lse, torch.float32)


def test_variants_through_the_ring(num_sms):
    # window + softcap + ALiBi + sinks + lse together, split and one pass, group 4.
    num_sms(132)
    case = make_case([3, 64, 333], num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float16,
                     seed=9)
    g = torch.Generator().manual_seed(3)
    kw = dict(softcap=20.0, window_left=100, sinks=torch.randn(8, generator=g) * 2,
              alibi_slopes=torch.rand(8, generator=g) * 0.1)
    want, want_lse = case.reference_decode_lse(**kw)
    for config in (None, dict(partition_size=-1)):
        out = nan_like(case.query)
        lse = torch.full(case.query.shape[:2], float("nan"))
        if config is None:
            paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out), **kw, lse=lse)
        else:
            selftest.decode_attention_config(*case.decode_args(out), config_list(**config), **kw, lse=lse)
        assert_close(out, want, case.dtype)
        assert_close(lse, want_lse, torch.float32)


@pytest.mark.parametrize("cluster", [2, 4, 16])
@pytest.mark.parametrize("group,head_size,dtype,cache_dtype,mods", [
    (4, 128, torch.bfloat16, None, ""),                    # the fast loop
    (8, 64, torch.float16, torch.float8_e4m3fn, ""),        # fp8, two head tiles a block
    (1, 256, torch.float32, None, ""),
    (3, 96, torch.bfloat16, torch.float8_e5m2, ""),         # the general loop (96 wide), a partial head tile
    (4, 128, torch.float16, None, "softcap+alibi"),         # the fast loop's score-mods instance
    (2, 128, torch.bfloat16, torch.float8_e4m3fn, "alibi"),  # the general loop's
])
def test_cluster_merge_matches_the_reference(num_sms, max_cluster, cluster, group, head_size, dtype, cache_dtype,
                                             mods):
    # Rows of 0, 1 .. all partitions: a row's blocks past its keys are empty and still merge their
    # share; sinks and lse through the merge (finish_softmax). 16 SMs make the rows' 10 blocks split.
    num_sms(16)
    max_cluster(cluster)
    num_heads = 2 * group
    case = make_case([0, 1, 37, 300, 700], num_heads=num_heads, num_kv_heads=2, head_size=head_size, block_size=16,
                     dtype=dtype, cache_dtype=cache_dtype, scale_kind="head", seed=cluster + group)
    g = torch.Generator().manual_seed(cluster)
    kw = dict(sinks=torch.randn(num_heads, generator=g))
    if "softcap" in mods:
        kw["softcap"] = 20.0
    if "alibi" in mods:
        kw["alibi_slopes"] = torch.rand(num_heads, generator=g) * 0.1
    pl = plan(case, softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"))
    assert pl["cluster_blocks"] == cluster and pl["grid_z"] == cluster and pl["split"], pl
    want, want_lse = case.reference_decode_lse(**kw)
    out, lse = nan_like(case.query), torch.full(case.query.shape[:2], float("nan"))
    paged_ops.backend("cuda_emu").decode_attention(*case.decode_args(out), **kw, lse=lse)
    assert_close(out, want, case.dtype)
    assert_close(lse, want_lse, torch.float32)

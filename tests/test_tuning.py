"""The one tuner (paged_ops.tuning) for the triton and cuda backends, on CPU.

The GPU measurement itself (time_gpu_ms: CUDA events around a batch of launches) is GPU-only; here
the candidates run on the Triton interpreter / the CUDA emulator and a fake timer orders them, so
the choice, the persistence, the keys and the handling of bad cache files are all tested.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import paged_ops
from paged_ops import tuning
from paged_ops.testing import assert_close, make_case, nan_like

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_warned", set())
    monkeypatch.setattr(tuning, "_TUNERS", {})
    return tmp_path


def small_decode_case(**kw):
    return make_case([37, 70], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=3, **kw)


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


@pytest.mark.parametrize("config", [{"threads": 48, "partition": 0, "kv_tile": 0, "tc": 0},
                                    {"threads": 128, "partition": 100, "kv_tile": 0, "tc": 0},
                                    {"threads": 128, "partition": 0, "kv_tile": 3, "tc": 0},
                                    {"threads": 128, "partition": 0, "kv_tile": 0, "tc": 2},
                                    {"threads": 128}])
def test_invalid_cuda_configs_are_named(config):
    assert tuning.config_problem("cuda", "decode_attention", config)


def test_every_candidate_is_valid():
    from paged_ops.triton import decode, prefill
    for c in tuning.CUDA_DECODE_CANDIDATES + tuning.CUDA_PREFILL_CANDIDATES + [tuning.CUDA_DEFAULT]:
        assert tuning.config_problem("cuda", "decode_attention", c) is None, c
    for hs in (64, 128, 256):
        for dt in (torch.float32, torch.float16):
            for c in decode._candidates(hs, dt) + [decode.default_config(hs, dt)]:
                assert tuning.config_problem("triton", "decode_attention", c) is None, c
            for c in prefill._candidates(hs, dt) + [prefill.default_config(hs, dt)]:
                assert tuning.config_problem("triton", "prefill_attention", c) is None, c


# ---- bad cache files (#12.12): ignored with a warning, never break import or a call ----------

BAD_FILES = {
    "list": [1, 2],
    "wrong-object": {"k": "x"},
    "old-format": {"version": 1, "entries": {}},
    "entries-not-object": {"format": tuning.FORMAT, "entries": [1]},
}


def test_bad_cache_file_does_not_break_import(tmp_path):
    # The case: valid JSON of the wrong shape under every name a tuner ever used.
    for name in (tuning.FILE_NAME, "cuda_tuning.json", "triton_autotune.json"):
        (tmp_path / name).write_text("[1, 2]")
    code = ("import warnings, paged_ops, paged_ops.tuning as t, paged_ops.cuda_tuning\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    t.load(); print(len(t._read_entries(t.cache_path())), len(w))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PAGED_OPS_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries, warned = map(int, proc.stdout.split())
    assert entries == 0 and warned >= 1


@pytest.mark.parametrize("content", list(BAD_FILES.values()) + ["{not json"], ids=list(BAD_FILES) + ["not-json"])
def test_bad_cache_file_is_ignored_with_a_warning(cache_dir, content):
    text = content if isinstance(content, str) else json.dumps(content)
    (cache_dir / tuning.FILE_NAME).write_text(text)
    with pytest.warns(RuntimeWarning, match="ignored"):
        assert tuning._read_entries(tuning.cache_path()) == {}
    tuning.load()  # no registry entries, no exception
    bench, calls = fake_bench({16: 2.0, 32: 1.0, 64: 3.0})
    assert tuning.tuner("triton", "decode_attention").choose("gpu-x", ("k",), DEFAULT, CANDIDATES, bench,
                                                             force=True) == CANDIDATES[1]
    # the file is rewritten valid, with the re-tuned entry
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"].values()
    assert entry["config"] == CANDIDATES[1]


def _triton_decode_entry_key(case, out):
    from paged_ops.triton import autotune, decode
    from paged_ops.triton._common import device_name
    key = decode.tuning_key(case.query, case.key_cache, case.block_tables)
    return autotune.TUNERS["decode_attention"].entry_key(device_name(case.query.device), key)


@pytest.mark.parametrize("bad", [{}, {"BLOCK_N": 0, "num_warps": 4, "num_stages": 2, "split_scale": 1.0},
                                 {"BLOCK_N": 3, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}],
                         ids=["empty", "block0", "block3"])
def test_bad_triton_entry_is_ignored_and_the_call_works(cache_dir, bad):
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available (no triton, or the interpreter is off)")
    from paged_ops.triton import autotune
    case = small_decode_case()
    out = nan_like(case.query)
    key = _triton_decode_entry_key(case, out)
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": {
        key: {"backend": "triton", "op": "decode_attention", "device": "cpu", "key": [], "config": bad}}}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        paged_ops.backend("triton").decode_attention(*case.decode_args(out))
    assert any("ignored" in str(x.message) for x in w), [str(x.message) for x in w]
    assert autotune.last_config("decode_attention")["source"] == "default"
    assert_close(out, case.reference_decode(), torch.float32)


def test_a_valid_stored_entry_is_used(cache_dir):
    if "triton" not in paged_ops.available_backends():
        pytest.skip("triton backend not available")
    from paged_ops.triton import autotune
    case = small_decode_case()
    out = nan_like(case.query)
    good = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "split_scale": 1.0}
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": {
        _triton_decode_entry_key(case, out): {"backend": "triton", "op": "decode_attention", "device": "cpu",
                                              "key": [], "config": good}}}))
    paged_ops.backend("triton").decode_attention(*case.decode_args(out))
    info = autotune.last_config("decode_attention")
    assert info["source"] == "cache" and info["config"] == good
    assert_close(out, case.reference_decode(), torch.float32)


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


def test_shape_key_holds_layout_and_head_counts():
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend (its tuning_key op)")
    nhd = make_case([20], num_heads=8, num_kv_heads=2, layout="NHD")
    hnd = make_case([20], num_heads=8, num_kv_heads=2, layout="HND")
    other_heads = make_case([20], num_heads=16, num_kv_heads=4)
    keys = [tuning.cuda_shape_key(c.query, c.key_cache, c.block_tables, None) for c in (nhd, hnd, other_heads)]
    assert len(set(keys)) == 3
    assert keys[0][-1] == "NHD" and keys[1][-1] == "HND"


def test_tuning_is_off_under_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not tuning.tuning_enabled()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PAGED_OPS_AUTOTUNE", "0")
    assert not tuning.tuning_enabled()


# ---- the cuda side, run on the emulator ------------------------------------------------------

def _need_emu():
    if "cuda_emu" not in paged_ops.available_backends() or not hasattr(torch.ops, "paged_cuda_emu_test"):
        pytest.skip("cuda_emu backend not built (no CUDA headers)")
    try:
        torch.ops.paged_cuda_emu_test.decode_attention_config  # noqa: B018
    except (AttributeError, RuntimeError):
        pytest.skip("cuda_emu built without its explicit-config test ops")
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend (its tuning_key op)")


def test_cuda_decode_tuning_on_the_emulator(cache_dir):
    _need_emu()
    case = small_decode_case()
    out = nan_like(case.query)
    timed = []

    def timer(fn):  # runs the candidate (on the emulator), then a fake time that prefers 128 x 512
        fn()
        cfg = tuning.CUDA_DECODE_CANDIDATES[len(timed)]
        timed.append(cfg)
        assert_close(out, case.reference_decode(), torch.float32, msg=str(cfg))
        out.fill_(float("nan"))
        return 1.0 if (cfg["threads"], cfg["partition"]) == (128, 512) else 2.0

    cfg = tuning.tune_cuda_decode(*case.decode_args(out), backend="cuda_emu", timer=timer)
    assert cfg == dict(threads=128, partition=512, kv_tile=0, tc=0)
    assert len(timed) == len(tuning.CUDA_DECODE_CANDIDATES)
    (entry,) = json.loads((cache_dir / tuning.FILE_NAME).read_text())["entries"].values()
    assert entry["backend"] == "cuda_emu" and entry["config"] == cfg
    # stored: not timed again
    assert tuning.tune_cuda_decode(*case.decode_args(out), backend="cuda_emu",
                                   timer=lambda fn: pytest.fail("re-timed a stored shape")) == cfg


def test_cuda_prefill_tuning_on_the_emulator(cache_dir):
    _need_emu()
    case = make_case([37, 70], [5, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.float16, seed=4)
    out = nan_like(case.query)
    order = iter(range(100))
    cfg = tuning.tune_cuda_prefill(*case.prefill_args(out), backend="cuda_emu",
                                   timer=lambda fn: (fn(), 10.0 - next(order))[1])
    assert cfg == tuning.CUDA_PREFILL_CANDIDATES[-1]  # the last candidate was "fastest"
    assert_close(out, case.reference_prefill(), torch.float16)


def test_cuda_registry_gets_only_this_builds_valid_entries(cache_dir):
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend")
    case = small_decode_case()
    reg_key = tuning.cuda_registry_key(case.query, case.key_cache, case.block_tables, None)
    version = tuning.code_version("cuda")
    good = dict(threads=256, partition=1024, kv_tile=0, tc=0)
    entries = {
        f"cuda|decode_attention|cpu|{version}|{reg_key}|a": dict(backend="cuda", op="decode_attention",
                                                              key=[reg_key], config=good),
        f"cuda|decode_attention|cpu|0.0.0+stale|{reg_key}|b": dict(backend="cuda", op="decode_attention",
                                                                key=[reg_key + "stale"], config=good),
        f"cuda|decode_attention|cpu|{version}|x|c": dict(backend="cuda", op="decode_attention",
                                                      key=["bad-entry"], config=dict(good, threads=33)),
    }
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": entries}))
    with pytest.warns(RuntimeWarning, match="threads=33"):
        assert tuning.load() == 1
    assert tuning.cuda_tuned_config(case.query, case.key_cache, case.block_tables) == good
    tsv = (cache_dir / tuning.TSV_NAME).read_text().splitlines()
    assert tsv == [f"{reg_key} 256 1024 0 0"]


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
    "nested-object": b'{"format": 2, "entries": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
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
    import threading
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


def test_many_bad_entries_warn_once_per_file(cache_dir):
    bad = {"threads": 33, "partition": 0, "kv_tile": 0, "tc": 0}
    entries = {f"cuda|decode_attention|cpu|v|k{i}": dict(backend="cuda", op="decode_attention", key=[f"k{i}"],
                                                          config=bad) for i in range(5)}
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": entries}))
    message = _ignored_with_one_warning(tuning.cache_path())
    assert "threads=33" in message and "4 more" in message
    with warnings.catch_warnings(record=True) as w:  # the same file again: no second warning
        warnings.simplefilter("always")
        tuning._read_entries(tuning.cache_path())
    assert not w


MALFORMED_CUDA_KEYS = {"dict": {"a": 1}, "int": 5, "none": None, "empty": [], "list-of-int": [7],
                       "newline": ["decode|sm1\ntrailing 1 2 3 4"], "space": ["decode|sm1 x"],
                       "empty-string": [""], "string": "decode|sm1", "huge": ["k" * 100_000]}


@pytest.mark.parametrize("shape_key", list(MALFORMED_CUDA_KEYS.values()), ids=list(MALFORMED_CUDA_KEYS))
def test_cuda_entry_with_a_malformed_key_is_ignored_by_load(cache_dir, shape_key):
    """load() promises never to raise on a bad file: a malformed shape key used to raise
    TypeError / KeyError, and a key holding a newline wrote two lines into cuda_tuning.tsv."""
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend")
    version = tuning.code_version("cuda")
    good = dict(threads=256, partition=1024, kv_tile=0, tc=0)
    entries = {f"cuda|decode_attention|cpu|{version}|good": dict(backend="cuda", op="decode_attention",
                                                                 key=["decode|good-key"], config=good),
               f"cuda|decode_attention|cpu|{version}|bad": dict(backend="cuda", op="decode_attention",
                                                                key=shape_key, config=good)}
    (cache_dir / tuning.FILE_NAME).write_text(json.dumps({"format": tuning.FORMAT, "entries": entries}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tuning.load() == 1
    messages = [str(x.message) for x in w]
    assert len(messages) == 1 and "'cuda|decode_attention|cpu|" in messages[0] and "ignored" in messages[0], messages
    assert len(messages[0]) < 1000  # a huge key is not echoed whole
    assert (cache_dir / tuning.TSV_NAME).read_text().splitlines() == ["decode|good-key 256 1024 0 0"]


def test_registry_refuses_a_bad_config_or_key():
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend")
    ops = torch.ops.paged_cuda
    for args, field in [(("k-ok", 33, 0, 0, 0), "threads"), (("k-ok", 0, 100, 0, 0), "partition_size"),
                        (("k-ok", 0, 0, 3, 0), "kv_tile"), (("k-ok", 0, 0, 0, 2), "tensor_cores"),
                        (("two words", 0, 0, 0, 0), "key"), (("line\nbreak", 0, 0, 0, 0), "key")]:
        with pytest.raises(ValueError, match=field):
            ops.set_tuned_config(*args)
    assert ops.tuned_config("k-ok")[-1] == 0 and ops.tuned_config("two words")[-1] == 0


def _registry_in_a_new_process(cache_dir, keys, timeout=120):
    """tuned_config of each key in a fresh process (the extension reads the .tsv at its first lookup)."""
    code = ("import sys, json, torch, paged_ops\n"
            "print(json.dumps([list(torch.ops.paged_cuda.tuned_config(k)) for k in json.loads(sys.argv[1])]))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PAGED_OPS_CACHE_DIR=str(cache_dir)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_extension_reads_only_valid_tsv_lines(cache_dir):
    """csrc/cuda/tuning.h: a line is one key and four integers that are a valid config; any other
    line (bad numbers, extra or missing fields, out of range, binary junk) is skipped."""
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend")
    lines = [b"good-a 128 512 0 0", b"good-b 0 -1 32 1", b"  good-c\t64 256 0 -1  ",
             b"bad-threads 33 0 0 0", b"bad-partition 128 100 0 0", b"bad-tile 128 0 3 0", b"bad-tc 0 0 0 2",
             b"bad-extra 128 512 0 0 9", b"bad-short 128 512 0", b"bad-text 128 x 0 0",
             b"bad-huge 99999999999999999999 0 0 0", b"bad-plus 128 512 0 0x1", b"bad-float 128.0 512 0 0",
             b"bad-\xff\xfe 128 512 0 0", b"", b"\x00\x01\x02", b"k" * 100_000 + b" 128 512 0 0"]
    (cache_dir / tuning.TSV_NAME).write_bytes(b"\n".join(lines) + b"\n")
    keys = ["good-a", "good-b", "good-c", "bad-threads", "bad-partition", "bad-tile", "bad-tc", "bad-extra",
            "bad-short", "bad-text", "bad-huge", "bad-plus", "bad-float"]
    got = dict(zip(keys, _registry_in_a_new_process(cache_dir, keys)))
    assert got.pop("good-a") == [128, 512, 0, 0, 1]
    assert got.pop("good-b") == [0, -1, 32, 1, 1]
    assert got.pop("good-c") == [64, 256, 0, -1, 1]
    assert all(v == [0, 0, 0, 0, 0] for v in got.values()), {k: v for k, v in got.items() if v[-1]}


def test_extension_does_not_block_on_a_fifo_tsv(cache_dir):
    if not tuning.cuda_available():
        pytest.skip("extension built without the CUDA backend")
    os.mkfifo(cache_dir / tuning.TSV_NAME)
    try:
        assert _registry_in_a_new_process(cache_dir, ["any"], timeout=60) == [[0, 0, 0, 0, 0]]
    except subprocess.TimeoutExpired:
        pytest.fail("the extension's registry blocked reading a FIFO cuda_tuning.tsv")

"""vLLM's offline API around the engine (#15 items 3-5): the step API (LLMEngine.add_request /
step / has_unfinished_requests / abort_request), LLM's arguments (dtype="auto", max_model_len,
tokenizer, seed, swap_space, string request ids), get_tokenizer / chat, and the CLI."""
import json
import shutil

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams

PROMPTS = [[5, 9], [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 37))]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
LLM_TOKENIZER = True  # the llm fixture's checkpoint (tests/conftest.py)


def assert_all_free(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert llm.scheduler.is_finished() and not llm.llm_engine.has_unfinished_requests()


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- step API ------------------------------------------------------------------------
def test_step_api_streams_and_matches_generate(llm):
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    engine: LLMEngine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"req-{i}", p, GREEDY)
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 3
    seen = {f"req-{i}": [] for i in range(3)}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished
            ids = out.outputs[0].token_ids
            seen[out.request_id].append(list(ids))
            if out.finished:
                finished[out.request_id] = ids
                assert out.outputs[0].finish_reason == "length"
            else:
                assert out.outputs[0].finish_reason is None
    for i, exp in enumerate(expected):
        steps = seen[f"req-{i}"]
        assert [len(s) for s in steps] == list(range(1, 6))  # one new token per step, cumulative
        assert steps[-1] == exp == finished[f"req-{i}"]
    assert_all_free(llm)


def test_abort_request_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPTS[2], long)
    engine.add_request("b", PROMPTS[1], long)
    for _ in range(3):
        engine.step()
    seq_a = engine.requests["a"].seqs[0]
    held_by_b = len(engine.requests["b"].seqs[0].block_table)
    assert seq_a.block_table
    engine.abort_request("a")
    assert llm.block_manager.num_used_blocks == held_by_b and seq_a.finish_reason == "abort"
    assert engine.get_num_unfinished_requests() == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"b"} and outs[-1].finished
    engine.abort_request(["b", "never-added"])  # finished or unknown ids: nothing to do
    assert_all_free(llm)


def test_add_request_errors_leave_nothing_behind(llm):
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[0], GREEDY)
    for rid, prompt, params, match in [("x", PROMPTS[0], GREEDY, "already in use"), (7, PROMPTS[0], GREEDY, "str"),
                                       ("y", [1, 2, 999], GREEDY, "prompt token ids"),
                                       ("z", {"foo": 1}, GREEDY, "prompt"), ("w", [], GREEDY, "empty")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(rid, prompt, params)
    assert list(engine.requests) == ["x"] and len(llm.scheduler.waiting) == 1
    engine.abort_request("x")
    assert_all_free(llm)


def test_string_request_ids(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(isinstance(o.request_id, str) for o in outs) and len({o.request_id for o in outs}) == 3


# ---- LLM arguments -------------------------------------------------------------------
@pytest.mark.parametrize("saved, expected", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16)])
def test_dtype_auto_follows_vllm(tmp_path, saved, expected):
    # vLLM: the checkpoint's dtype, with float32 checkpoints run in the platform's preferred
    # dtype (bfloat16 on x86/aarch64 CPUs and bf16-capable GPUs)
    from transformers import AutoModelForCausalLM
    from engine.demo import CONFIGS
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=saved).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="auto", num_kv_blocks=8)
    assert llm.runner.dtype == expected and llm.runner.kv.key_caches[0].dtype == expected
    assert LLM(str(tmp_path), dtype="float32", num_kv_blocks=8).runner.dtype == torch.float32


def test_max_model_len(ckpt):
    llm = LLM(ckpt("llama", tokenizer=True), num_kv_blocks=16, max_model_len=12)
    outs = llm.generate([PROMPTS[1], list(range(13))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 12 - 8 and outs[0].outputs[0].finish_reason == "length"
    assert "maximum length 12" in str(outs[1].error)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(ckpt("llama", tokenizer=True), num_kv_blocks=16, max_model_len=513)  # max_position_embeddings is 512


def test_tokenizer_from_another_directory(ckpt):
    qwen = ckpt("qwen2")
    assert LLM(qwen, num_kv_blocks=16).get_tokenizer() is None
    llm = LLM(qwen, num_kv_blocks=16, tokenizer=ckpt("llama", tokenizer=True))
    o = llm.generate("hello", GREEDY)[0]
    assert o.prompt_token_ids == llm.get_tokenizer()("hello")["input_ids"]
    assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(qwen, num_kv_blocks=16, tokenizer="/no/such/dir")


def test_seed_makes_unseeded_requests_reproducible(ckpt):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    run = lambda seed: tokens(LLM(ckpt("llama", tokenizer=True), num_kv_blocks=32, seed=seed).generate(PROMPTS, params))  # noqa
    assert run(3) == run(3) != run(4)


def test_swap_space_is_gib(ckpt):
    llm = LLM(ckpt("llama", tokenizer=True), num_kv_blocks=16, preemption_mode="swap", swap_space=0.001)
    assert llm.runner.num_cpu_blocks == int(0.001 * (1 << 30)) // llm.runner.bytes_per_block > 0
    assert LLM(ckpt("llama", tokenizer=True), num_kv_blocks=16, swap_space=0.001).runner.num_cpu_blocks == 0  # recompute mode
    with pytest.raises(ValueError, match="swap_space"):
        LLM(ckpt("llama", tokenizer=True), num_kv_blocks=16, swap_space=-1)


def test_missing_model_directory_says_so(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_chat_uses_the_chat_template(ckpt, tmp_path):
    from transformers import AutoTokenizer
    model = shutil.copytree(ckpt("llama", tokenizer=True), tmp_path / "chat")
    with pytest.raises(ValueError, match="chat template"):
        LLM(str(model), num_kv_blocks=16).chat([{"role": "user", "content": "hi"}], GREEDY)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(model)
    llm = LLM(str(model), num_kv_blocks=16)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(conv, GREEDY)[0]
    assert out.prompt == "system: be brief\nuser: hi\nassistant: "
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False)["input_ids"]
    assert tokens([out]) == tokens(llm.generate([out.prompt_token_ids], GREEDY))
    assert len(llm.chat([conv, conv[1:]], GREEDY)) == 2


# ---- CLI -----------------------------------------------------------------------------
def test_cli_generate_echoes_prompts(ckpt, capsys):
    from engine.__main__ import main
    main(["generate", "--model", ckpt("llama", tokenizer=True), "--prompt", "3,1,4", "--prompt-token-ids", "3,1,4,1,5",
          "--max-tokens", "3", "--num-kv-blocks", "32", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
          "--seed", "1", "--logprobs", "2"])
    out = capsys.readouterr().out
    assert "request 0: prompt '3,1,4'" in out            # text, not token id 3
    assert "request 1: prompt token ids [3, 1, 4, 1, 5]" in out
    assert out.count("completion 0 [length]") == 2 and "cumulative logprob" in out and "tok/s" in out


def test_cli_json(ckpt, capsys):
    from engine.__main__ import main
    main(["generate", "--model", ckpt("llama", tokenizer=True), "--prompt", "hello", "--prompt-token-ids", "5,9",
          "--max-tokens", "4", "--num-kv-blocks", "32", "--logprobs", "1", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    objs = [json.loads(line) for line in lines]
    assert [o["prompt"] for o in objs] == ["hello", None] and objs[1]["prompt_token_ids"] == [5, 9]
    llm = LLM(ckpt("llama", tokenizer=True), num_kv_blocks=32)
    expected = tokens(llm.generate(["hello", [5, 9]], SamplingParams(temperature=0, max_tokens=4)))
    assert [o["outputs"][0]["token_ids"] for o in objs] == expected
    assert all(len(o["outputs"][0]["logprobs"]) == 4 for o in objs)


def test_cli_errors(ckpt, tmp_path, capsys):
    from engine.__main__ import main
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", ckpt("llama", tokenizer=True), "--prompt", "hi", "--top-k", "-5"])
    assert "top_k" in capsys.readouterr().err


def test_engine_imports_under_another_package_name(tmp_path, monkeypatch):
    """The wheel installs engine/ as paged_ops.engine (#10 item 7): every import inside it is
    relative, so a copy under another package name imports without touching the top-level engine."""
    import importlib
    import pathlib
    import sys
    src = pathlib.Path(__file__).parent.parent / "engine"
    pkg = tmp_path / "otherpkg"
    shutil.copytree(src, pkg / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = {name for name in sys.modules if name == "engine" or name.startswith("engine.")}
    mod = importlib.import_module("otherpkg.engine")
    importlib.import_module("otherpkg.engine.__main__")
    assert mod.LLM.__module__ == "otherpkg.engine.llm" and mod.SamplingParams().n == 1
    assert {name for name in sys.modules if name == "engine" or name.startswith("engine.")} == before
    for name in [n for n in sys.modules if n.startswith("otherpkg")]:
        monkeypatch.delitem(sys.modules, name)


def test_readme_example_runs(ckpt, capsys):
    import pathlib
    import re
    readme = (pathlib.Path(__file__).parent.parent / "engine" / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    exec(code.replace("path/to/local/hf/checkpoint", ckpt("llama", tokenizer=True)), {})
    out = capsys.readouterr().out
    assert "tok/s" in out and "r1" in out

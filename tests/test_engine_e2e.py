"""End to end: the engine's greedy outputs equal transformers' generate, token for token,
under every scheduling regime; and every block is free again after each run."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_oracles import hf_greedy, hf_greedy_fake_fp8

MAX_TOKENS = 8
# lengths cross block boundaries for block_size 16; the last two share a 34-token prefix
PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 37)),
           list(range(40, 74)) + [1, 2, 3], list(range(40, 74)) + [7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_all_free(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert len(bm.free_cpu_block_ids) == bm.num_cpu_blocks
    assert llm.scheduler.is_finished()


def run(model_dir, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(model_dir, **{"num_kv_blocks": 64, **kw})
    outs = llm.generate(prompts, params)
    assert_all_free(llm)
    return llm, outs


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("arch, block_size", [("llama", 1), ("llama", 16), ("qwen2", 1), ("qwen2", 16),
                                              ("mistral", 16)])  # mistral is llama-shaped: one size
def test_greedy_matches_transformers(ckpt, ref, arch, block_size, model_impl):
    llm, outs = run(ckpt(arch, tokenizer=arch == "llama"), block_size=block_size, num_kv_blocks=512 // block_size, enable_prefix_caching=False,
                    model_impl=model_impl)
    assert llm.runner.model_impl == model_impl
    assert tokens(outs) == ref(arch)
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    assert llm.last_stats.output_tokens == MAX_TOKENS * len(PROMPTS)


def test_prefix_caching_shared_prefixes(ckpt, ref):
    llm, outs = run(ckpt("llama", tokenizer=True), block_size=4, max_num_seqs=1)  # one at a time: later ones hit
    assert tokens(outs) == ref("llama")
    assert llm.last_stats.prefix_cache_hits >= 32            # the 34-token shared prefix
    again = llm.generate(PROMPTS, GREEDY)                    # everything cached but the last token
    assert tokens(again) == ref("llama") and llm.last_stats.prefix_cache_hit_rate > 0.7
    assert_all_free(llm)
    llm, outs = run(ckpt("llama", tokenizer=True), block_size=4)            # all admitted in one step: hits still
    assert tokens(outs) == ref("llama") and llm.last_stats.prefix_cache_hits == 32


def test_chunked_prefill(ckpt, ref):
    llm, outs = run(ckpt("qwen2"), block_size=4, max_num_batched_tokens=5)
    assert tokens(outs) == ref("qwen2")
    assert llm.last_stats.num_steps > 80 // 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(ckpt, ref, mode):
    # 10 blocks of 4 = 40 slots: the longest request (45 tokens with its output) alone
    # barely fits, so decodes keep evicting each other
    llm, outs = run(ckpt("llama", tokenizer=True), block_size=4, num_kv_blocks=12, preemption_mode=mode, num_cpu_blocks=64)
    assert tokens(outs) == ref("llama")
    assert llm.last_stats.preemptions[mode] > 0


def test_parallel_sampling_greedy_shares_prompt_blocks(ckpt, ref):
    llm, outs = run(ckpt("llama", tokenizer=True), params=SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                    block_size=4)
    for o, expected in zip(outs, ref("llama")):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(c.token_ids == expected for c in o.outputs)


def test_parallel_sampling_seeded_equals_separate_requests(ckpt):
    model = ckpt("llama", tokenizer=True)
    params = lambda n, seed: SamplingParams(n=n, temperature=1.0, top_k=20, top_p=0.9, seed=seed,
                                            max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[2]  # 17 tokens: the forked samples share a partly filled block (CoW)
    _, outs = run(model, [prompt], params(3, 7), block_size=4)
    forked = [c.token_ids for c in outs[0].outputs]
    _, outs = run(model, [prompt] * 3, [params(1, 7), params(1, 8), params(1, 9)], block_size=4,
                  enable_prefix_caching=False)
    assert forked == tokens(outs)
    assert len({tuple(t) for t in forked}) > 1


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(ckpt, ref, kv_cache_dtype):
    llm, outs = run(ckpt("llama", tokenizer=True), block_size=16, kv_cache_dtype=kv_cache_dtype)
    kv = llm.runner.kv
    fp8 = kv.key_caches[0].dtype
    assert fp8 == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert all(s is not None and s.dtype == torch.float32 for s in kv.k_scales + kv.v_scales)
    # exact: transformers on K/V rounded through fp8 with the same (first-prefill) scales
    assert tokens(outs) == hf_greedy_fake_fp8(ckpt("llama", tokenizer=True), PROMPTS, MAX_TOKENS, fp8, kv.k_scales, kv.v_scales)
    # and close to the fp32 cache. A tiny random model's logits are flat, so rounding K/V to 3 (e4m3)
    # or 2 (e5m2) mantissa bits flips some first tokens: count over 64 prompts, against a 1/128 chance
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = lambda **kw: tokens(run(ckpt("llama", tokenizer=True), prompts, one, num_kv_blocks=512, **kw)[1])  # noqa: E731
    agree = sum(a == b for a, b in zip(first(kv_cache_dtype=kv_cache_dtype), first()))
    assert agree >= {"fp8": 2 / 3, "fp8_e5m2": 1 / 2}[kv_cache_dtype] * len(prompts), agree


def test_checkpoint_fp8_scales_are_used(ckpt, tmp_path):
    import shutil
    from safetensors.torch import save_file
    model = shutil.copytree(ckpt("llama", tokenizer=True), tmp_path / "ckpt")
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.02 * (i + 1) * (2 if kv == "v" else 1))
              for i in range(2) for kv in "kv"}
    save_file(scales, model / "kv_scales.safetensors")  # not in the HF index: only the engine reads it
    llm, outs = run(str(model), block_size=16, kv_cache_dtype="fp8")
    kv = llm.runner.kv
    assert [float(s) for s in kv.k_scales + kv.v_scales] == pytest.approx([0.02, 0.04, 0.04, 0.08])
    assert tokens(outs) == hf_greedy_fake_fp8(str(model), PROMPTS, MAX_TOKENS, torch.float8_e4m3fn,
                                              kv.k_scales, kv.v_scales)


def test_error_in_a_step_frees_everything(ckpt, ref, monkeypatch):
    llm = LLM(ckpt("llama", tokenizer=True), num_kv_blocks=64, block_size=4)
    monkeypatch.setattr(llm.runner, "run", lambda out: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        llm.generate(PROMPTS, GREEDY)
    assert_all_free(llm)
    monkeypatch.undo()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == ref("llama")


def test_rejected_requests_do_not_block_others(ckpt, ref):
    too_long = list(range(10)) * 5          # 50 tokens > 12 blocks * 4 slots
    llm, outs = run(ckpt("llama", tokenizer=True), [PROMPTS[1], too_long, []], block_size=4, num_kv_blocks=12)
    assert tokens(outs[:1]) == ref("llama")[1:2]
    assert isinstance(outs[1].error, ValueError) and "KV pool" in str(outs[1].error) and outs[1].outputs == []
    assert isinstance(outs[2].error, ValueError)
    model_limit = list(range(100)) * 6      # 600 > max_position_embeddings 512
    outs = llm.generate([model_limit], GREEDY)
    assert "maximum length" in str(outs[0].error)
    assert_all_free(llm)
    _, outs = run(ckpt("qwen2"), ["no tokenizer here", PROMPTS[1]])
    assert "tokenizer" in str(outs[0].error) and tokens(outs[1:]) == ref("qwen2")[1:2]


def test_stops_and_text(ckpt, ref):
    expected = ref("llama")[1]
    stop = expected[3]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=3), GREEDY]
    llm, outs = run(ckpt("llama", tokenizer=True), [PROMPTS[1], {"prompt_token_ids": PROMPTS[1]}, "hello"], params, block_size=16)
    first = expected.index(stop)
    assert outs[0].outputs[0].token_ids == expected[:first + 1] and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == expected[:3] and outs[1].outputs[0].finish_reason == "length"
    assert outs[2].prompt == "hello" and isinstance(outs[2].outputs[0].text, str)
    assert outs[2].outputs[0].text == llm.tokenizer.decode(outs[2].outputs[0].token_ids, skip_special_tokens=True)


def test_checkpoint_kv_scales_are_loaded(tmp_path):
    from safetensors.torch import save_file
    from engine.attention import load_kv_scales
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
               "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([4.0])}, tmp_path / "model.safetensors")
    k, v = load_kv_scales(str(tmp_path), 2)
    assert [float(x) for x in k] == [0.5, 0.25] and [float(x) for x in v] == [2.0, 4.0]
    assert load_kv_scales(str(tmp_path), 3) is None


def test_cli_demo(capsys):
    from engine.__main__ import main
    main(["demo", "--num-prompts", "3", "--max-tokens", "4"])
    assert "tok/s" in capsys.readouterr().out


def test_bfloat16_runs_close_to_float32(ckpt, ref):
    llm, outs = run(ckpt("llama", tokenizer=True), dtype="bfloat16", block_size=16)
    assert llm.runner.kv.key_caches[0].dtype == torch.bfloat16
    assert sum(t[0] == r[0] for t, r in zip(tokens(outs), ref("llama"))) >= len(PROMPTS) - 1


def test_model_impl_auto_and_errors(ckpt, tmp_path):
    assert LLM(ckpt("qwen2"), num_kv_blocks=8).runner.model_impl == "native"
    with pytest.raises(ValueError, match="model_impl"):
        LLM(ckpt("llama", tokenizer=True), num_kv_blocks=8, model_impl="vllm")
    # an architecture without a native implementation runs through transformers' modeling code
    from transformers import AutoModelForCausalLM, Phi3Config
    from engine.demo import TINY
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Phi3Config(**TINY)).save_pretrained(tmp_path)
    assert LLM(str(tmp_path), num_kv_blocks=8).runner.model_impl == "transformers"
    with pytest.raises(ValueError, match="model_impl='native'"):
        LLM(str(tmp_path), num_kv_blocks=8, model_impl="native")


def test_native_llama_variants_match_transformers(tmp_path):
    # what the native model takes from the transformers model rather than re-implementing:
    # RoPE scaling (llama3), a head_dim that is not hidden / heads, tied embeddings, biases
    from transformers import AutoModelForCausalLM, LlamaConfig
    from engine.demo import TINY, randomize_biases_and_norms
    cfg = LlamaConfig(**TINY | dict(head_dim=32, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    torch.manual_seed(0)
    randomize_biases_and_norms(AutoModelForCausalLM.from_config(cfg)).save_pretrained(tmp_path)
    prompts = PROMPTS[:3] + [list(range(1, 40))]  # positions past original_max_position_embeddings
    llm, outs = run(str(tmp_path), prompts, block_size=8, model_impl="native")
    assert tokens(outs) == hf_greedy(str(tmp_path), prompts, MAX_TOKENS)

"""vLLM's LLM / SamplingParams arguments beyond the basics (issue #25 item 5): each one accepted
has its effect (enforce_eager, trust_remote_code, seed, max_model_len, best_of, logit_bias,
allowed_token_ids, bad_words, get_default_sampling_params), and what the engine does not do is a
ValueError naming the argument, never a dataclass' TypeError."""
import json
import shutil

import pytest

from engine import LLM, LLMEngine, SamplingParams

LLM_TOKENIZER = True  # the llm fixture's checkpoint (tests/conftest.py): bad_words need the tokenizer
PROMPT = "The quick"  # its greedy tokens are all inside the character tokenizer (ids < 95)


def greedy(max_tokens=8, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert llm.scheduler.is_finished() and not llm.llm_engine.has_unfinished_requests()


# ---- LLM(...) --------------------------------------------------------------------------
def test_llm_accepts_vllm_arguments_and_rejects_the_rest_by_name(ckpt, llm):
    path = ckpt("llama", tokenizer=True)
    expected = tokens(llm.generate([PROMPT], greedy()))
    # enforce_eager: no CUDA graphs here, the engine is always eager; vLLM's defaults of what it lacks
    for kwargs in (dict(enforce_eager=True), dict(enforce_eager=False, trust_remote_code=False),
                   dict(tensor_parallel_size=1, quantization=None, revision=None, seed=None)):
        other = LLM(path, block_size=4, num_kv_blocks=64, **kwargs)
        assert tokens(other.generate([PROMPT], greedy())) == expected
    for kwargs, name in [(dict(enforce_eager="yes"), "enforce_eager"), (dict(trust_remote_code=1), "trust_remote_code"),
                         (dict(tensor_parallel_size=2), "tensor_parallel_size"), (dict(speculative_config={}), "speculative_config"),
                         (dict(no_such_argument=3), "no_such_argument")]:
        with pytest.raises(ValueError, match=f"{name}.*(not supported by paged_ops' engine|must be a bool)"):
            LLM(path, **kwargs)
    with pytest.raises(ValueError, match="no_such_argument=3 is not supported by paged_ops' engine; LLM takes: .*max_model_len"):
        LLMEngine.from_engine_args(path, no_such_argument=3)


def test_trust_remote_code_loads_the_checkpoints_own_code(ckpt, tmp_path):
    """A checkpoint whose config and model classes are its own .py files (auto_map): refused
    without trust_remote_code (transformers' ValueError), loaded from the directory with it."""
    path = ckpt("llama")
    remote = tmp_path / "tiny_remote_ckpt"
    shutil.copytree(path, remote)
    (remote / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyRemoteConfig(LlamaConfig):\n    model_type = 'tiny_remote'\n")
    (remote / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyRemoteConfig\n\n\n"
        "class TinyRemoteForCausalLM(LlamaForCausalLM):\n    config_class = TinyRemoteConfig\n")
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(str(remote), num_kv_blocks=16)
    llm = LLM(str(remote), num_kv_blocks=16, trust_remote_code=True)
    assert type(llm.runner.model).__name__ == "TinyRemoteForCausalLM" and llm.runner.model_impl == "transformers"
    prompts = [[5, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    assert tokens(llm.generate(prompts, greedy())) == tokens(LLM(path, num_kv_blocks=16).generate(prompts, greedy()))


def test_seed_and_per_request_seed(ckpt, llm):
    """LLM(seed): unseeded requests repeat run to run. SamplingParams(seed): the request's own
    generator (sample i: seed + i), so its tokens do not depend on the batch around it, its place
    in it, or the engine's seed."""
    path = ckpt("llama", tokenizer=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    run = lambda seed: tokens(LLM(path, num_kv_blocks=32, seed=seed).generate([PROMPT, [5, 9]], unseeded))
    assert run(7) == run(7) != run(8)
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1234, n=2)
    alone = llm.generate([PROMPT], seeded)[0]
    crowd = llm.generate([[5, 9], [40, 41, 42] * 5, PROMPT, "abc"], [unseeded, unseeded, seeded, unseeded])[2]
    other_engine = LLM(path, block_size=8, num_kv_blocks=32, seed=99).generate([PROMPT], seeded)[0]
    samples = [[c.token_ids for c in o.outputs] for o in (alone, crowd, other_engine)]
    assert samples[0] == samples[1] == samples[2] and samples[0][0] != samples[0][1]
    assert_all_free(llm)


def test_max_model_len_rejects_a_long_request_and_the_others_go_on(ckpt):
    llm = LLM(ckpt("llama", tokenizer=True), block_size=4, num_kv_blocks=16, max_model_len=12)
    outs = llm.generate([list(range(13)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(12))], greedy(max_tokens=50))
    # vLLM's rules: a prompt must leave room for one output token; the output stops at max_model_len
    assert isinstance(outs[0].error, ValueError) and "longer than the maximum length 12 (max_model_len)" in str(outs[0].error)
    assert isinstance(outs[2].error, ValueError) and "plus at least one output token" in str(outs[2].error)
    assert outs[0].outputs == outs[2].outputs == []
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 12 - 8
    assert outs[1].outputs[0].finish_reason == "length"
    assert_all_free(llm)
    with pytest.raises(ValueError, match="max_model_len"):  # the step API: raised, nothing left behind
        llm.llm_engine.add_request("long", list(range(12)), greedy())
    assert_all_free(llm)


# ---- SamplingParams(...) ------------------------------------------------------------------
def test_sampling_params_reject_what_the_engine_does_not_do_by_name():
    for kwargs, name in [(dict(use_beam_search=True), "use_beam_search"), (dict(logits_processors=[]), "logits_processors"),
                         (dict(no_such_option=1), "no_such_option")]:
        with pytest.raises(ValueError, match=f"{name}=.* is not supported by paged_ops' engine; SamplingParams takes:"):
            SamplingParams(**kwargs)
    for kwargs, name in [(dict(best_of=3, n=2), "best_of"), (dict(best_of=1, n=2), "best_of"), (dict(best_of=2.0, n=2), "best_of"),
                         (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                         (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
                         (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
                         (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["a", 3]), "bad_words")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    # vLLM's conversions: logit_bias keys as decimal strings (JSON), a lone bad word, duplicates dropped
    p = SamplingParams(logit_bias={"5": 2, 7: -1.5}, bad_words="ab")
    assert p.logit_bias == {5: 2.0, 7: -1.5} and p.bad_words == ["ab"]
    assert SamplingParams(bad_words=["x", "x", "y"]).bad_words == ["x", "y"]


def test_best_of_equal_to_n_is_n(llm):
    """vLLM V1 removed best_of > n (rejected above); best_of = n asks for what n does."""
    kwargs = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5, n=3)
    expected = [c.token_ids for c in llm.generate([PROMPT], SamplingParams(**kwargs))[0].outputs]
    assert [c.token_ids for c in llm.generate([PROMPT], SamplingParams(best_of=3, **kwargs))[0].outputs] == expected
    assert SamplingParams(best_of=1).best_of == 1 and SamplingParams().best_of is None


def test_logit_bias_steers_greedy_and_leaves_logprobs_raw(llm):
    plain = llm.generate([PROMPT], greedy(logprobs=-1))[0].outputs[0]
    target = next(t for t in range(50) if t not in plain.token_ids)
    steered = llm.generate([PROMPT], greedy(logit_bias={target: 100.0}, logprobs=0))[0].outputs[0]
    assert steered.token_ids == [target] * 8
    # logprobs are the model's raw distribution (vLLM's default), before the bias
    assert steered.logprobs[0][target].logprob == pytest.approx(plain.logprobs[0][target].logprob, abs=1e-5)
    # a bias against the greedy token picks the runner-up (the raw logprobs' second)
    first = plain.token_ids[0]
    runner_up = max((lp.logprob, t) for t, lp in plain.logprobs[0].items() if t != first)[1]
    assert llm.generate([PROMPT], greedy(max_tokens=1, logit_bias={first: -100.0}))[0].outputs[0].token_ids == [runner_up]


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens(llm):
    allowed = [3, 17, 40, 41, 90]
    outs = llm.generate([PROMPT] * 4, [greedy(allowed_token_ids=allowed, logprobs=-1)] +
                        [SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=s, allowed_token_ids=allowed)
                         for s in range(3)])
    assert all(t in allowed for out in tokens(outs) for t in out)
    first = outs[0].outputs[0]  # greedy: the most likely allowed token at every step
    assert first.token_ids == [max(allowed, key=lambda t: lps[t].logprob) for lps in first.logprobs]
    assert len({tuple(out) for out in tokens(outs)}) > 1


def test_bad_words_ban_single_tokens_and_the_last_token_of_a_sequence(llm):
    tok = llm.tokenizer
    plain = tokens(llm.generate([PROMPT], greedy()))[0]
    assert all(t < 95 for t in plain[:4])  # inside the character tokenizer: the words are its characters
    one = llm.generate([PROMPT], greedy(bad_words=[tok.decode(plain[:1])]))[0].outputs[0].token_ids
    assert plain[0] not in one and one != plain
    # a two-token word: its second token is banned only right after its first
    word = tok.decode(plain[2:4])
    two = llm.generate([PROMPT], greedy(bad_words=[word]))[0].outputs[0].token_ids
    assert two[:3] == plain[:3] and two[3] != plain[3]
    assert all(two[i:i + 2] != plain[2:4] for i in range(len(two) - 1))


def test_token_ids_outside_the_vocabulary_fail_that_request_only(llm, ckpt):
    vocab = llm.runner.config.vocab_size
    outs = llm.generate([PROMPT] * 3, [greedy(logit_bias={vocab: 1.0}), greedy(), greedy(allowed_token_ids=[1, vocab + 5])])
    for o, name in zip(outs[::2], ["logit_bias", "allowed_token_ids"]):
        assert isinstance(o.error, ValueError) and f"{name} must be token ids in [0, {vocab})" in str(o.error)
        assert o.outputs == []
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
    assert_all_free(llm)
    no_tokenizer = LLM(ckpt("llama"), num_kv_blocks=16)
    out = no_tokenizer.generate([[5, 9]], greedy(bad_words=["x"]))[0]
    assert "bad_words needs a tokenizer" in str(out.error)


def test_get_default_sampling_params_follows_generation_config(ckpt, llm, tmp_path):
    default = llm.get_default_sampling_params()
    assert default == SamplingParams() and default is not llm.get_default_sampling_params()
    assert len(llm.generate([PROMPT], default)[0].outputs[0].token_ids) > 0
    # vLLM: the checkpoint's generation_config sets the defaults, and generate uses them without params
    path = tmp_path / "gen"
    shutil.copytree(ckpt("llama", tokenizer=True), path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 3, "top_k": 7}))
    tuned = LLM(str(path), num_kv_blocks=16)
    p = tuned.get_default_sampling_params()
    assert (p.temperature, p.max_tokens, p.top_k, p.top_p) == (0.0, 3, 7, 1.0)
    assert tokens(tuned.generate([PROMPT])) == tokens(tuned.generate([PROMPT], greedy(max_tokens=3)))

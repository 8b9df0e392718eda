"""Requests that passed admission and failed late (issue #27 item 8). Each one now gets a
ValueError naming the argument at admission, or is sampled safely, or ends only itself: the
other requests go on and the block pool is whole afterwards. Parallel samples (n) fork within
max_num_seqs."""
import pytest
import torch

import engine.llm_engine as llm_engine
from engine import LLM, SamplingParams
from engine.sampler import apply_penalties, apply_top_k_top_p, sample

VOCAB = 128  # save_tiny_checkpoint's
MAX_NUM_SEQS = 4
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], list(range(20, 31))]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LLM_ARGS = {"max_num_seqs": MAX_NUM_SEQS}  # the llm fixture's (tests/conftest.py)


@pytest.fixture(scope="module")
def expected(llm):
    """Greedy tokens of each prompt, run alone."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def assert_all_free(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert llm.scheduler.is_finished() and not llm.llm_engine.requests


def run_with_one_bad(llm, expected, bad: SamplingParams):
    """generate the prompts with bad as the middle request's params: the others must come out as
    when run alone. Returns the bad request's output."""
    outs = llm.generate(PROMPTS, [GREEDY, bad, GREEDY])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [expected[0], expected[2]]
    assert_all_free(llm)
    return outs[1]


# ---- n: parallel samples fork within max_num_seqs -------------------------------------------
@pytest.mark.parametrize("n", [MAX_NUM_SEQS + 1, 20, 10 ** 7])
def test_n_that_can_never_fit_is_rejected_at_admission(llm, expected, n):
    """n=20 with max_num_seqs=4 ran 20 sequences at once; n=10**7 forked until it was OOM-killed."""
    bad = SamplingParams(n=n, temperature=1.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"\bn\b.*max_num_seqs"):
        llm.llm_engine.add_request("big-n", PROMPTS[1], bad)
    assert_all_free(llm)
    out = run_with_one_bad(llm, expected, bad)
    assert "max_num_seqs" in str(out.error) and out.outputs == []


def run_steps(llm, prompts, params):
    """Drive the step API; returns ({request id: token lists by sample index}, the most sequences
    ever running or swapped at once, checked after every schedule and every step)."""
    engine, sched = llm.llm_engine, llm.scheduler
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    real_schedule, peak = sched.schedule, [0]

    def schedule():
        out = real_schedule()
        peak[0] = max(peak[0], len(sched.running))
        return out
    sched.schedule = schedule
    results = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None
                if out.finished:
                    results[out.request_id] = [c.token_ids for c in out.outputs]
            peak[0] = max(peak[0], len(sched.running))
            assert len(sched.running) <= sched.max_num_seqs
    finally:
        del sched.schedule
    return results, peak[0]


@pytest.mark.parametrize("pool", [dict(num_kv_blocks=64), dict(num_kv_blocks=14, preemption_mode="recompute"),
                                  dict(num_kv_blocks=14, preemption_mode="swap", num_cpu_blocks=64)])
def test_n_forks_never_run_more_than_max_num_seqs(ckpt, pool):
    """Requests whose n fits are scheduled as capacity allows: the n samples of a request are
    counted from its admission, so forking after the prompt never overshoots max_num_seqs."""
    prompts = [PROMPTS[i % 3] for i in range(5)]
    params = [SamplingParams(n=n, temperature=1.0, top_k=20, seed=10 * i, max_tokens=6, ignore_eos=True)
              for i, n in enumerate([3, 3, 1, 2, MAX_NUM_SEQS])]
    small = LLM(ckpt(), block_size=4, max_num_seqs=MAX_NUM_SEQS, **pool)
    got, peak = run_steps(small, prompts, params)
    assert peak == MAX_NUM_SEQS  # capacity is used, never exceeded
    assert_all_free(small)
    # every sample draws from its own seeded generator: the same tokens as with room for all at once
    roomy = LLM(ckpt(), block_size=4, num_kv_blocks=256)
    assert got == run_steps(roomy, prompts, params)[0]
    assert [len(got[str(i)]) for i in range(5)] == [p.n for p in params]


# ---- token ids are checked against the model's vocabulary ------------------------------------
@pytest.mark.parametrize("stop_token_ids", [[VOCAB], [3, 2 ** 70], [10 ** 30]])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_token_ids_outside_the_vocabulary_rejected_at_admission(llm, expected, stop_token_ids, temperature):
    """With min_tokens > 0 they were banned from the logits mid-generation: an IndexError for
    [128], an overflow for 2**70."""
    bad = SamplingParams(temperature=temperature, max_tokens=4, min_tokens=2, stop_token_ids=stop_token_ids)
    with pytest.raises(ValueError, match=rf"stop_token_ids.*\[0, {VOCAB}\)"):
        llm.llm_engine.add_request("bad-stop", PROMPTS[1], bad)
    assert_all_free(llm)
    out = run_with_one_bad(llm, expected, bad)
    assert "stop_token_ids" in str(out.error) and out.outputs == []


def test_stop_token_ids_inside_the_vocabulary_still_run(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, min_tokens=2,
                                                    stop_token_ids=[0, VOCAB - 1]))[0]
    assert out.error is None and len(out.outputs[0].token_ids) >= 2
    assert_all_free(llm)


# ---- tiny top_p and repetition_penalty sample without inf / nan -----------------------------
LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-9])
def test_tiny_top_p_keeps_only_the_most_likely_token(top_p):
    """top_p below float32's smallest number compared as 0 against the probability mass before
    each token, which dropped every token: "probability tensor contains inf/nan"."""
    assert torch.isfinite(apply_top_k_top_p(LOGITS, 0, top_p)).nonzero().flatten().tolist() == [1]
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert [sample(LOGITS, params, g) for _ in range(20)] == [1] * 20


def test_tiny_top_p_in_the_engine_is_greedy(llm, expected):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-300, seed=3, max_tokens=4, ignore_eos=True))
    assert [o.error for o in outs] == [None] * 3
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_free(llm)


@pytest.mark.parametrize("penalty", [1e-300, 1e-30])
def test_tiny_repetition_penalty_picks_the_strongest_seen_token(penalty):
    """Positive logits of seen tokens divided by ~0 overflowed float32 to inf (1e-300 is 0 in
    float32): "probability tensor contains inf/nan". Its limit: the seen token of the largest
    positive logit, in sampling as in greedy."""
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5])
    penalized = apply_penalties(logits, [0, 1, 3], [4], SamplingParams(repetition_penalty=penalty))
    assert not penalized.isnan().any() and not penalized.isposinf().any()
    assert int(penalized.argmax()) == 1
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=1.0, repetition_penalty=penalty),
                   SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1, repetition_penalty=penalty),
                   SamplingParams(temperature=0, repetition_penalty=penalty)):
        assert [sample(penalized, params, g) for _ in range(20)] == [1] * 20


def test_huge_penalties_stay_finite():
    """The other end: a huge repetition_penalty times a negative logit, on every token."""
    logits = torch.tensor([-1.0, -2.0, -3.0])
    penalized = apply_penalties(logits, [0, 1, 2], [], SamplingParams(repetition_penalty=1e300))
    assert not penalized.isnan().any()
    g = torch.Generator().manual_seed(0)
    assert [sample(penalized, SamplingParams(temperature=1.0), g) for _ in range(5)] == [0] * 5  # the least negative


def test_tiny_repetition_penalty_in_the_engine(llm, expected):
    def params(temperature):
        return SamplingParams(temperature=temperature, repetition_penalty=1e-300, seed=1, max_tokens=6,
                              ignore_eos=True)
    for temperature in (1.0, 0.0):
        out = run_with_one_bad(llm, expected, params(temperature))
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 6


# ---- a failure while recording prompt logprobs ends only that request ----------------------
def test_failure_in_prompt_logprobs_ends_only_that_request(llm, expected, monkeypatch):
    """It escaped step() and dropped the whole generate call."""
    real = llm_engine.top_logprobs

    def top_logprobs(logprobs, token, k):
        if k == 7:
            raise RuntimeError("injected")
        return real(logprobs, token, k)
    monkeypatch.setattr(llm_engine, "top_logprobs", top_logprobs)
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(PROMPTS, [good, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=7), good])
    assert "injected" in str(outs[1].error) and outs[1].finished
    for i in (0, 2):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == expected[i]
        assert len(outs[i].prompt_logprobs) == len(PROMPTS[i])
    assert_all_free(llm)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected

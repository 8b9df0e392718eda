"""Bad requests and bad engine arguments (issue #12 items 13-15): a clear ValueError naming
the argument, at construction; one bad request never takes the others down, and the block
pool is whole afterwards."""
import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
LLM_ARGS = {"num_kv_blocks": 32}  # the llm fixture's (tests/conftest.py)


def assert_all_free(llm):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert len(bm.free_cpu_block_ids) == bm.num_cpu_blocks
    assert llm.scheduler.is_finished()


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=2.5), "top_k"), (dict(top_k=-5), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(n=1.5), "n"), (dict(n=0), "n"), (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(seed=2 ** 64), "seed"), (dict(seed=1.5), "seed"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-2), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop=["a", 3]), "stop"),
])
def test_sampling_params_rejected_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_vllm_leniencies():
    # vLLM: None means no stop tokens; -1 and 0 both disable top_k; a positive temperature below
    # 1e-2 is raised to 1e-2 (1e-45 would overflow the softmax to inf / nan)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(temperature=1e-45).temperature == pytest.approx(1e-2)
    assert SamplingParams(max_tokens=None).max_tokens is None and SamplingParams(stop="x").stop == ["x"]


def test_admission_error_leaves_no_stale_sequence(llm, monkeypatch):
    """#12.13: an exception while admitting the second request left the first one in
    scheduler.waiting, and every later call failed with "scheduler made no progress"."""
    import engine.llm_engine as llm_engine
    good = llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
    # the trigger: a seed torch cannot take (now also rejected by SamplingParams itself)
    bad_seed = SamplingParams(temperature=1.0, max_tokens=3)
    bad_seed.seed = 2 ** 64
    try:
        llm.generate([[1, 2, 3], [4, 5, 6]], [GREEDY, bad_seed])
    except Exception:
        pass
    assert_all_free(llm)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids == good
    # any exception while the second request's sequence is created
    real, made = llm_engine.Sequence, []

    def failing(*args, **kwargs):
        made.append(1)
        if len(made) == 2:
            raise MemoryError("injected")
        return real(*args, **kwargs)
    monkeypatch.setattr(llm_engine, "Sequence", failing)
    with pytest.raises(MemoryError):
        llm.generate([[1, 2, 3], [4, 5, 6]], [GREEDY, GREEDY])
    monkeypatch.undo()
    assert_all_free(llm)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids == good


def test_bad_requests_do_not_take_others_down(llm):
    """#12.14: float prompt ids were truncated silently; parameters changed after construction
    blew up inside a step and aborted every request of the call."""
    expected = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)]
    mutated = SamplingParams(temperature=1.0, max_tokens=3)
    mutated.temperature = float("nan")     # dataclasses are mutable: checked again on admission
    outs = llm.generate([[1, 2, 3], [1.5, 2.0], [7, 8], [4, 5, 6], [True, 3]],
                        [GREEDY, GREEDY, mutated, GREEDY, GREEDY])
    assert [o.outputs[0].token_ids for o in (outs[0], outs[3])] == expected
    assert "prompt token ids" in str(outs[1].error) and outs[1].outputs == []
    assert "temperature" in str(outs[2].error) and outs[2].outputs == []
    assert "prompt token ids" in str(outs[4].error)
    assert_all_free(llm)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=0), "block_size"), (dict(block_size=-4), "block_size"), (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_num_seqs=2.5), "max_num_seqs"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(dtype="float64"), "dtype"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
])
def test_llm_arguments_rejected_at_construction(ckpt, kwargs, name):
    """#12.15: zero budgets were accepted and generate failed with "KV pool too small"."""
    with pytest.raises(ValueError, match=name):
        LLM(ckpt(), **{"num_kv_blocks": 8, **kwargs})


def test_failure_inside_one_requests_sampling_ends_only_that_request(llm, monkeypatch):
    import engine.llm_engine as llm_engine
    expected = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)]
    real = llm_engine.sample

    def sample(logits, params, generator):
        if params.seed == 13:
            raise RuntimeError("injected")
        return real(logits, params, generator)
    monkeypatch.setattr(llm_engine, "sample", sample)
    outs = llm.generate([[1, 2, 3], [7, 8, 9], [4, 5, 6]],
                        [GREEDY, SamplingParams(temperature=1.0, seed=13, max_tokens=3), GREEDY])
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == expected
    assert "injected" in str(outs[1].error)
    assert_all_free(llm)

"""Sampling options (#15 item 2), each checked against a direct computation on transformers'
logits: penalties, min_tokens, min_p / top_k / top_p, stop strings (incremental detokenization,
include_stop_str_in_output), max_tokens=None, skip_special_tokens."""
import functools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from tests.engine_oracles import hf_model

PROMPTS = [[5, 9], [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 37)), [40, 41, 42, 40, 41, 42, 40]]


# The llm fixture's (tests/conftest.py): stop strings need the tokenizer.
LLM_TOKENIZER = True
LLM_ARGS = {"num_kv_blocks": 128}


@pytest.fixture(scope="module")
def last_logits(ckpt):
    """last_logits(ids): transformers' float64 logits of the token after ids (the oracle)."""
    model = hf_model(ckpt("llama", tokenizer=True))

    @functools.lru_cache(maxsize=None)
    def get(ids: tuple) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].double()
    return get


def oracle_greedy(last_logits, prompt, max_tokens, process=lambda logits, out: logits, stop=lambda out: False):
    """Greedy decoding on transformers' logits, each step's logits passed through process."""
    out = []
    while len(out) < max_tokens and not (out and stop(out)):
        out.append(int(process(last_logits(tuple(prompt + out)).clone(), out).argmax()))
    return out


def penalize(logits, prompt, out, repetition=1.0, frequency=0.0, presence=0.0):
    # written the plain way, token by token (vLLM's definitions)
    for t in set(prompt) | set(out):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in set(out):
        logits[t] -= frequency * out.count(t) + presence
    return logits


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
                                       dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                       dict(frequency_penalty=-0.7, presence_penalty=0.9, repetition_penalty=1.3)])
def test_penalties_greedy(llm, last_logits, penalties):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **penalties)
    rename = dict(repetition_penalty="repetition", frequency_penalty="frequency", presence_penalty="presence")
    kw = {rename[k]: v for k, v in penalties.items()}
    expected = [oracle_greedy(last_logits, p, 10, lambda logits, out, p=p: penalize(logits, p, out, **kw)) for p in PROMPTS]
    assert tokens(llm.generate(PROMPTS, params)) == expected
    plain = [oracle_greedy(last_logits, p, 10) for p in PROMPTS]
    assert expected != plain  # the penalties changed something, so the test can fail


def test_min_tokens_holds_back_stop_tokens(llm, last_logits):
    plain = [oracle_greedy(last_logits, p, 12) for p in PROMPTS]
    for prompt, greedy in zip(PROMPTS, plain):
        stop = greedy[1]
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0]
        assert got.outputs[0].token_ids == greedy[:2] and got.outputs[0].stop_reason == stop
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                                    min_tokens=4))[0].outputs[0]

        def ban(logits, out):
            if len(out) < 4:
                logits[stop] = -torch.inf
            return logits
        expected = oracle_greedy(last_logits, prompt, 12, ban, stop=lambda out: len(out) >= 4 and out[-1] == stop)
        assert got.token_ids == expected
        assert got.finish_reason == ("stop" if expected[-1] == stop and len(expected) >= 4 else "length")


def allowed(logits, temperature, top_k, top_p, min_p):
    """The tokens vLLM's filters leave, in its order: temperature, min_p, top_k, top_p."""
    probs = (logits / temperature).softmax(-1)
    keep = probs >= min_p * probs.max()
    order = probs.argsort(descending=True)
    keep[order[top_k:]] = False if top_k > 0 else keep[order[top_k:]]
    p = torch.where(keep, probs, 0)
    p = p / p.sum()
    sorted_p = p[order]
    before = sorted_p.cumsum(0) - sorted_p
    keep[order[before >= top_p]] = False
    return set(keep.nonzero().flatten().tolist())


@pytest.mark.parametrize("filters", [dict(min_p=0.2), dict(top_k=3), dict(top_p=0.5),
                                     dict(min_p=0.05, top_k=6, top_p=0.8)])
def test_sampled_tokens_stay_in_the_filtered_set(llm, last_logits, filters):
    filters = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **filters}
    params = [SamplingParams(temperature=1.3, max_tokens=8, ignore_eos=True, seed=s, **filters) for s in range(6)]
    outs = llm.generate(PROMPTS * 6, [p for p in params for _ in PROMPTS])
    seen_other_than_greedy = False
    for o in outs:
        out = o.outputs[0].token_ids
        for i, t in enumerate(out):
            logits = last_logits(tuple(o.prompt_token_ids + out[:i]))
            assert t in allowed(logits, 1.3, **filters), (o.prompt_token_ids, out[:i + 1])
            seen_other_than_greedy |= t != int(logits.argmax())
    assert seen_other_than_greedy


def test_filters_that_leave_one_token_are_greedy(llm, last_logits):
    greedy = [oracle_greedy(last_logits, p, 6) for p in PROMPTS]
    for f in (dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)):
        assert tokens(llm.generate(PROMPTS, SamplingParams(temperature=2.0, max_tokens=6, ignore_eos=True, **f))) == greedy


def completion_text(llm, ids):
    return llm.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, last_logits, include):
    prompts = ["hello ", "abcabc", "The quick"]
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    stops = []
    for o in full:
        text = o.outputs[0].text
        assert len(text) >= 6
        stops.append(text[3:5])
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=16, stop=[s, "never-there"],
                                                 include_stop_str_in_output=include) for s in stops])
    for o, f, stop in zip(outs, full, stops):
        ids = f.outputs[0].token_ids
        # the first token whose text completes the stop string ends the request
        k = next(k for k in range(1, len(ids) + 1) if stop in completion_text(llm, ids[:k]))
        text = completion_text(llm, ids[:k])
        c = o.outputs[0]
        assert c.token_ids == ids[:k] and c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == text[:text.find(stop) + (len(stop) if include else 0)]


def test_streamed_text_never_shows_a_partial_stop_string(llm):
    engine = llm.llm_engine
    full = llm.generate(["hello "], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    stop = full[5:8]
    engine.add_request("s", "hello ", SamplingParams(temperature=0, max_tokens=16, stop=stop))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(stop[:1] not in t[full.find(stop):] for t in texts[:-1])
    assert texts[-1] == full[:full.find(stop)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, as vLLM's default


def test_max_tokens_none_runs_to_the_length_limit(ckpt):
    llm = LLM(ckpt("llama", tokenizer=True), block_size=4, num_kv_blocks=64, max_model_len=20)
    o = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(o.outputs[0].token_ids) == 20 - len(PROMPTS[1]) and o.outputs[0].finish_reason == "length"


def test_skip_special_tokens(llm):
    tok = llm.tokenizer
    unk = tok.convert_tokens_to_ids("<unk>")
    ids = tok("ab")["input_ids"] + [unk] + tok("cd")["input_ids"]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, tok("xy")["input_ids"], skip)
        pieces = [d.add(t) for t in ids]
        assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=skip)
    assert "<unk>" not in IncrementalDetokenizer(tok, [], True).text
    # end to end: the text is decode(token ids) with the request's setting, whatever was sampled
    params = [SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True, seed=s, skip_special_tokens=skip)
              for s in range(8) for skip in (True, False)]
    outs = llm.generate(["abc"] * len(params), params)
    for o, p in zip(outs, params):
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=p.skip_special_tokens)
    assert any(unk in o.outputs[0].token_ids for o in outs)  # the special token was really there


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(llm, include):
    # vLLM: the stop token stays in token_ids, its text only with include_stop_str_in_output
    ids = llm.generate(["hello "], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    stop = next(t for t in ids[1:] if completion_text(llm, [t]))
    j = ids.index(stop)
    c = llm.generate(["hello "], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop],
                                                include_stop_str_in_output=include))[0].outputs[0]
    assert c.token_ids == ids[:j + 1] and c.stop_reason == stop and c.finish_reason == "stop"
    assert c.text == completion_text(llm, ids[:j + 1] if include else ids[:j])


def test_incremental_detokenization_of_split_characters():
    """Byte-level BPE splits multi-byte characters across tokens: text is emitted only once a
    character is complete (never a replacement character), and the pieces add up to decode()."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, 日本語のテキスト", "naïve café — ünïcödé 😀 emoji", "plain ascii words here"] * 5
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>")
    held_back = 0
    for text in ["日本語 and 😀 café", "ünïcödé 😀😀 x", "<s>héllo"]:
        ids = tok(text)["input_ids"]
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, tok("naïve ")["input_ids"], skip)
            pieces = [d.add(i) for i in ids]
            assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces)
            held_back += sum(p == "" for p in pieces[:-1])
    assert held_back > 0  # some tokens were partial characters, so the test exercised the hold-back

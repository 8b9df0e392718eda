"""The engine on models with attention variants (issue #13 item 4): Gemma 2 (logit soft-caps,
sliding window on every other layer), gpt-oss (sinks, sliding window on every other layer) and
Mistral with a sliding window shorter than the prompts — greedy token for token equal to
transformers' ``generate`` (eager attention), natively and through transformers' attention interface."""

import pytest
import torch

import paged_ops
from engine import LLM, SamplingParams
from engine.attention import layer_sliding_window, window_left
from engine.demo import save_tiny_checkpoint
from tests.engine_oracles import hf_greedy, hf_logprobs, hf_model

ARCHS = ["mistral_sw", "gemma2", "gpt_oss"]  # engine/demo.py: tiny configs, sliding_window = 8
WINDOW = 8
MAX_TOKENS = 8
# every prompt but the first is longer than the window by the end; the last two share a 34-token prefix
PROMPTS = [[5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 37)),
           list(range(40, 74)) + [1, 2, 3], list(range(40, 74)) + [7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(model_dir, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(model_dir, **{"num_kv_blocks": 64, **kw})
    outs = llm.generate(prompts, params)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.free_cpu_block_ids) == bm.num_cpu_blocks
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return llm, [o.outputs[0].token_ids for o in outs]


def test_window_left_is_transformers_mask():
    """With window_left(W), the specification (paged_ops.reference.attention) lets each query see
    exactly the keys transformers' sliding-window causal mask (masking_utils) lets it see."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from paged_ops.reference import attention
    n = 12
    # q = 0: every visible key gets the same weight; v_j = e_j: out[p, 0, j] > 0 iff key j is visible
    q, k, v = torch.zeros(n, 1, 4), torch.randn(n, 1, 4), torch.eye(n).view(n, 1, n)
    for w in (1, 2, 3, 8):
        visible = attention(q, k, v, 1.0, True, window_left=window_left(w))[:, 0] > 0  # [n queries, n keys]
        mask = sliding_window_causal_mask_function(w)
        expected = torch.tensor([[bool(mask(torch.tensor(0), torch.tensor(0), torch.tensor(p), torch.tensor(j)))
                                  for j in range(n)] for p in range(n)])
        assert torch.equal(visible, expected), w
        assert visible.sum(1).max() == w  # a query sees W keys, itself included
    assert window_left(None) == -1
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            window_left(bad)


@pytest.mark.parametrize("arch, windows", [("mistral_sw", [WINDOW, WINDOW]), ("gemma2", [WINDOW, None]),
                                           ("gpt_oss", [WINDOW, None]), ("qwen2_sw", [None, WINDOW]),
                                           ("llama", [None, None])])
def test_layer_windows(ckpt, arch, windows):
    model = hf_model(ckpt(arch))
    got = [layer_sliding_window(layer.self_attn, model.config) for layer in model.model.layers]
    assert got == windows


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(ckpt, ref, arch, block_size, model_impl):
    llm, got = run(ckpt(arch), block_size=block_size, num_kv_blocks=1024 // block_size, model_impl=model_impl)
    assert llm.runner.model_impl == model_impl
    assert got == ref(arch)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_qwen2_sliding_layers(ckpt, model_impl):
    # Qwen2's windows are per layer too (use_sliding_window, max_window_layers): native llama.py and transformers
    model = ckpt("qwen2_sw")
    _, got = run(model, block_size=16, model_impl=model_impl)
    assert got == hf_greedy(model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(ckpt, ref, arch, model_impl):
    # 5-token chunks over an 8-token window: a chunk's rows see keys of earlier chunks only partly
    llm, got = run(ckpt(arch), block_size=4, max_num_batched_tokens=5, model_impl=model_impl)
    assert got == ref(arch)
    assert llm.last_stats.num_steps > sum(map(len, PROMPTS)) // 5


@pytest.mark.parametrize("backend", [b for b in paged_ops.available_backends()
                                     if b != "cpu" and "cpu" in paged_ops.backend(b).devices])
@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_other_backends(ckpt, ref, arch, backend):
    # the same end-to-end check through every other backend that runs on CPU tensors (cuda_emu;
    # triton under the interpreter): 16-token steps mix decode rows with prefill chunks
    with paged_ops.use_backend(backend):
        _, got = run(ckpt(arch), block_size=16, max_num_batched_tokens=16)
    assert got == ref(arch)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption(ckpt, ref, arch, mode):
    # 12 blocks of 4 = 48 slots for 5 requests of up to 45 tokens: decodes keep evicting each other
    llm, got = run(ckpt(arch), block_size=4, num_kv_blocks=12, preemption_mode=mode, num_cpu_blocks=64)
    assert got == ref(arch)
    assert llm.last_stats.preemptions[mode] > 0


def test_sliding_window_does_not_cap_the_length(ckpt, ref):
    """The engine used to cap max_model_len at Mistral's sliding_window (8 here), rejecting every
    longer prompt; the window is now an argument of the ops and the limit is max_position_embeddings."""
    llm = LLM(ckpt("mistral_sw"), num_kv_blocks=64, block_size=16)
    assert llm.max_model_len == 512
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref("mistral_sw")
    assert LLM(ckpt("mistral_sw"), num_kv_blocks=64, max_model_len=100).max_model_len == 100


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_logprobs_match_transformers(ckpt, arch, model_impl):
    """Logprobs are of the final logits: for Gemma 2 after final_logit_softcapping (which greedy
    argmax cannot see). The transformers path used to take lm_head's output without the cap."""
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    llm = LLM(ckpt(arch), num_kv_blocks=64, block_size=16, model_impl=model_impl)
    out = llm.generate([prompt], params)[0]
    expected = hf_logprobs(hf_model(ckpt(arch)), prompt)  # [len(prompt), vocab] float64
    token = out.outputs[0].token_ids[0]
    assert token == int(expected[-1].argmax())
    assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(float(expected[-1, token]), abs=1e-4)
    for i, lp in enumerate(out.prompt_logprobs[1:]):   # position i + 1's token given tokens 0..i
        t = prompt[i + 1]
        assert lp[t].logprob == pytest.approx(float(expected[i, t]), abs=1e-4), i


def test_bidirectional_gemma_is_rejected(tmp_path):
    from transformers import AutoConfig
    path = save_tiny_checkpoint(tmp_path / "g", "gemma2")
    cfg = AutoConfig.from_pretrained(path)
    cfg.use_bidirectional_attention = True
    cfg.save_pretrained(path)
    for impl in ("native", "transformers"):
        with pytest.raises(ValueError, match="bidirectional"):
            LLM(path, num_kv_blocks=8, model_impl=impl)


def test_bfloat16_runs_close_to_float32(ckpt, ref):
    # sinks are a bf16 parameter here: the engine hands them to the ops in float32
    for arch in ("gemma2", "gpt_oss"):
        _, got = run(ckpt(arch), dtype="bfloat16", block_size=16)
        assert sum(t[0] == r[0] for t, r in zip(got, ref(arch))) >= len(PROMPTS) - 1, arch


def test_windows_only_through_the_mask_are_rejected():
    """The engine builds no mask: an attention that transformers would restrict only through its
    mask (a "chunked_attention" layer type, or a "sliding_attention" layer whose modeling code does
    not pass sliding_window to the attention function) must fail loudly, not attend to everything."""
    from types import SimpleNamespace
    from engine.attention import check_layer_types, paged_attention_forward
    check_layer_types(SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    check_layer_types(SimpleNamespace())
    with pytest.raises(ValueError, match="chunked_attention"):
        check_layer_types(SimpleNamespace(layer_types=["chunked_attention", "full_attention"]))
    module = SimpleNamespace(layer_idx=1, is_causal=True,
                             config=SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_forward(module, q, q, q, None, 0.25, paged_metadata=object())

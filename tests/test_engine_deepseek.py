"""DeepSeek-V2/V3 (MLA) end to end: the engine caches the compressed latent, decodes in the absorbed
form and prefills in the non-absorbed one, and its greedy outputs equal transformers' generate
token for token under every scheduling regime (tiny random checkpoints: engine.demo.CONFIGS
"deepseek_v3" / "deepseek_v2", saved with save_pretrained; no hub)."""
import functools
import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_oracles import _greedy_each, hf_model
from tests.test_engine_e2e import GREEDY, MAX_TOKENS, PROMPTS, assert_all_free, run, tokens

ARCHS = ("deepseek_v3", "deepseek_v2")


@pytest.mark.parametrize("arch, block_size, model_impl", [
    ("deepseek_v3", 1, "native"), ("deepseek_v3", 16, "native"), ("deepseek_v2", 16, "native"),
    ("deepseek_v3", 16, "transformers"), ("deepseek_v2", 16, "transformers")])
def test_greedy_matches_transformers(ckpt, ref, arch, block_size, model_impl):
    llm, outs = run(ckpt(arch), block_size=block_size, num_kv_blocks=512 // block_size, enable_prefix_caching=False,
                    model_impl=model_impl)
    assert llm.runner.model_impl == model_impl
    assert tokens(outs) == ref(arch)
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(ckpt, ref, arch):
    # chunks of 5 tokens: every chunk after the first attends to context that exists only as latents
    llm, outs = run(ckpt(arch), block_size=4, max_num_batched_tokens=5)
    assert tokens(outs) == ref(arch)
    assert llm.last_stats.num_steps > 80 // 5


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching(ckpt, ref, arch):
    llm, outs = run(ckpt(arch), block_size=4, max_num_seqs=1)  # one at a time: the shared prefix hits
    assert tokens(outs) == ref(arch) and llm.last_stats.prefix_cache_hits >= 32
    again = llm.generate(PROMPTS, GREEDY)  # everything cached but the last token
    assert tokens(again) == ref(arch) and llm.last_stats.prefix_cache_hit_rate > 0.7
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(ckpt, ref, mode):
    llm, outs = run(ckpt("deepseek_v3"), block_size=4, num_kv_blocks=12, preemption_mode=mode, num_cpu_blocks=64)
    assert tokens(outs) == ref("deepseek_v3")
    assert llm.last_stats.preemptions[mode] > 0


def test_parallel_sampling_copy_on_write(ckpt, ref):
    # n=3 forks share a partly filled block of the 17-token prompt: the first write copies it
    # (copy_blocks over the latent cache's two disjoint column ranges)
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm, outs = run(ckpt("deepseek_v3"), PROMPTS, params, block_size=4)
    for o, expected in zip(outs, ref("deepseek_v3")):
        assert all(c.token_ids == expected for c in o.outputs)


@functools.cache
def hf_latents(model_dir: str, prompt: tuple) -> list[torch.Tensor]:
    """What transformers caches for prompt per layer: [kv_a_layernorm(c) | RoPE(k_pe)] [len, rank + rope]."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    return [torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1) for layer in cache.layers]


@pytest.fixture
def op_calls(monkeypatch):
    """Every torch.ops.paged call the engine makes from engine/attention.py: [(name, args)]."""
    import engine.attention as attention
    real, calls = attention.ops(), []

    class Spy:
        def __getattr__(self, name):
            def call(*args, **kw):
                calls.append((name, args))
                return getattr(real, name)(*args, **kw)
            return call
    monkeypatch.setattr(attention, "ops", Spy)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_latent_cache_layout_and_contents(ckpt, arch, op_calls):
    llm = LLM(ckpt(arch), num_kv_blocks=16, block_size=4)
    cfg, kv = llm.runner.config, llm.runner.kv
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for keys, values in zip(kv.key_caches, kv.value_caches):
        assert keys.shape == (16, 4, 1, width)
        assert values.shape == (16, 4, 1, cfg.kv_lora_rank) and values.data_ptr() == keys.data_ptr()  # a view
    assert llm.runner.bytes_per_block == cfg.num_hidden_layers * 4 * width * 4  # float32, one row per token
    prompt = PROMPTS[3]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    writes = [args for name, args in op_calls if name == "concat_and_cache_mla"]
    assert len(writes) == cfg.num_hidden_layers  # the prefill step: one write per layer
    for layer, (expected, args) in enumerate(zip(hf_latents(ckpt(arch), tuple(prompt)), writes)):
        slots = args[3]
        assert args[2] is kv.key_caches[layer] and len(slots) == len(prompt)
        # the latent after kv_a_layernorm and the RoPE part after RoPE, as transformers caches them
        torch.testing.assert_close(kv.key_caches[layer].view(-1, width)[slots], expected, rtol=1e-5, atol=1e-5)


def test_attention_op_calls(ckpt, op_calls):
    """The absorbed decode and the non-absorbed prefill, as the ops see them."""
    llm = LLM(ckpt("deepseek_v3"), num_kv_blocks=16, block_size=4)
    cfg = llm.runner.config
    rank, rope, nope, heads = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.num_attention_heads
    llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    names = [name for name, _ in op_calls]
    # a prefill step and two decode steps, each writing every layer's latents once
    assert "reshape_and_cache" not in names and names.count("concat_and_cache_mla") == 3 * cfg.num_hidden_layers
    assert names.count("prefill_attention") == names.count("decode_attention") / 2 == cfg.num_hidden_layers
    prefill = next(args for name, args in op_calls if name == "prefill_attention")
    decode = next(args for name, args in op_calls if name == "decode_attention")
    out, query, key_cache, value_cache = prefill[:4]  # per-head keys nope + rope, values v_head
    assert query.shape[1:] == (heads, nope + rope) and out.shape[1:] == (heads, cfg.v_head_dim)
    assert key_cache.shape[2:] == (heads, nope + rope) and value_cache.shape[2:] == (heads, cfg.v_head_dim)
    assert prefill[8] == decode[6] == llm.runner.model.layers[0].self_attn.scale
    out, query, key_cache, value_cache = decode[:4]  # absorbed: one latent head for every query head
    assert query.shape[1:] == (heads, rank + rope) and out.shape[1:] == (heads, rank)
    assert key_cache is llm.runner.kv.key_caches[0] and value_cache.data_ptr() == key_cache.data_ptr()
    assert value_cache.shape[-1] == rank


def test_softmax_scale_is_deepseeks(ckpt):
    # DeepSeek's YaRN mscale, written out (0.1 * mscale_all_dim * ln(factor) + 1, squared into the
    # scale) rather than imported: transformers 5.25 moved its helper out of the model's module.
    llm = LLM(ckpt("deepseek_v3"), num_kv_blocks=8)
    cfg = llm.runner.config
    rope = cfg.rope_parameters
    assert (rope["factor"], rope["mscale_all_dim"]) == (4.0, 1.0)
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    expected = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * mscale**2
    assert all(layer.self_attn.scale == pytest.approx(expected) for layer in llm.runner.model.layers)
    assert expected != pytest.approx((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)


def test_mla_context_blocks_dedupes_shared_blocks():
    from engine.attention import AttentionMetadata, KVCache, mla_context_blocks
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    kv = KVCache([torch.zeros(10, 4, 1, 8)], [], [None], [None], True)
    # sequences of 9 and 5 tokens share block 7; entries past their lengths (the 0s) are not read
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=i32([[7, 3, 9], [7, 2, 0]]),
                             cu_seqlens_q=i32([0, 1, 2]), seq_lens=i32([9, 5]), max_seqlen_q=1, decode_only=False,
                             kv=kv)
    ids, tables = mla_context_blocks(meta)
    assert ids.tolist() == [2, 3, 7, 9]
    assert ids[tables[0].long()].tolist() == [7, 3, 9] and ids[tables[1, :2].long()].tolist() == [7, 2]
    assert mla_context_blocks(meta)[0] is ids  # once per step


def hf_greedy_fp8_latents(model_dir: str, prompts, max_tokens: int, fp8: torch.dtype, scales) -> list[list[int]]:
    """transformers' greedy generate with every cached latent and RoPE part rounded through fp8 with
    the engine's per-layer scales (saturating, as the contract): the oracle of an fp8 latent cache."""
    from transformers import DynamicCache
    from paged_ops.reference import saturating_fp8_cast

    class Fp8Latents(DynamicCache):
        def update(self, latent, k_pe, layer_idx, *args, **kwargs):  # [1, 1, S, rank], [1, 1, S, rope]
            s = scales[layer_idx].float()
            rounded = lambda x: (saturating_fp8_cast(x, s, fp8).float() * s).to(x.dtype)  # noqa: E731
            return super().update(rounded(latent), rounded(k_pe), layer_idx, *args, **kwargs)

    model = hf_model(model_dir)
    return _greedy_each(model, prompts, max_tokens, lambda: Fp8Latents(config=model.config))


@pytest.mark.parametrize("arch, kv_cache_dtype", [("deepseek_v3", "fp8"), ("deepseek_v2", "fp8_e5m2")])
def test_fp8_latent_cache(ckpt, ref, arch, kv_cache_dtype):
    # chunks of 16: later chunks dequantize fp8 context latents before the up-projection
    llm, outs = run(ckpt(arch), block_size=4, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16)
    kv = llm.runner.kv
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert kv.key_caches[0].dtype == fp8 and kv.value_caches[0].data_ptr() == kv.key_caches[0].data_ptr()
    assert all(s.shape == (1,) and s.dtype == torch.float32 for s in kv.k_scales) and kv.v_scales == kv.k_scales
    assert tokens(outs) == hf_greedy_fp8_latents(ckpt(arch), PROMPTS, MAX_TOKENS, fp8, kv.k_scales)
    # the rounding shows in this tiny random model's tokens, so the oracle is not the fp32 one
    assert tokens(outs) != ref(arch)


def test_checkpoint_k_scale_is_the_latent_scale(ckpt, tmp_path):
    import shutil
    from safetensors.torch import save_file
    model = shutil.copytree(ckpt("deepseek_v3"), tmp_path / "ckpt")
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.01 * (i + 1) * (3 if kv == "v" else 1))
              for i in range(2) for kv in "kv"}
    save_file(scales, model / "kv_scales.safetensors")  # not in the HF index: only the engine reads it
    llm, outs = run(str(model), block_size=4, kv_cache_dtype="fp8")
    kv = llm.runner.kv
    assert [float(s) for s in kv.k_scales] == [float(s) for s in kv.v_scales] == pytest.approx([0.01, 0.02])
    assert tokens(outs) == hf_greedy_fp8_latents(str(model), PROMPTS, MAX_TOKENS, torch.float8_e4m3fn, kv.k_scales)


def test_bad_requests_leave_nothing(ckpt, ref):
    too_long = list(range(10)) * 5  # 50 tokens > 12 blocks * 4 slots
    llm, outs = run(ckpt("deepseek_v3"), [PROMPTS[1], too_long, []], block_size=4, num_kv_blocks=12)
    assert tokens(outs[:1]) == ref("deepseek_v3")[1:2]
    assert isinstance(outs[1].error, ValueError) and outs[1].outputs == [] and isinstance(outs[2].error, ValueError)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_runs_close_to_float32(ckpt, ref, arch):
    # bf16 weights (oneDNN-packed linears on CPUs that have them) and a bf16 latent cache; chunked
    # so the non-absorbed path reads bf16 context latents too. A tiny random model's logits are
    # flat: bf16 rounding may flip a first token, as for Llama (test_engine_e2e)
    llm, outs = run(ckpt(arch), dtype="bfloat16", block_size=4, max_num_batched_tokens=7)
    assert llm.runner.kv.key_caches[0].dtype == torch.bfloat16
    assert llm.runner.model.layers[0].self_attn.w_uk.dtype == torch.bfloat16
    assert sum(t[0] == r[0] for t, r in zip(tokens(outs), ref(arch))) >= len(PROMPTS) - 1

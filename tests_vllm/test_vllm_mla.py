"""vLLM 0.32 serving MLA models (DeepSeek-V2 / V3) with paged_ops' MLA backend (#24 item 5):
latent cache written by concat_and_cache_mla, absorbed decode by decode_attention over the
latent cache, prefill by prefill_attention over the up-projected rows (paged_ops.integrations.vllm_mla).

Greedy tokens and logprobs against vLLM's own CPU_MLA backend (mla_decode_kvcache + its SDPA
prefill), on tiny random checkpoints made locally (make_models.make_mla), float32.

* ``cpu_mla``: both runs with ``attention_backend="CPU_MLA"``, so vLLM's CPU platform treats both
  alike (block 16 forced, chunked prefill and prefix caching off: CpuPlatform.check_and_update_config).
* ``default``: ours as vLLM's platform picks for MLA models on this machine with no backend asked
  for: AMX_MLA where the CPU has AMX tiles (then blocks of 32 and 48 stay as asked), else CPU_MLA
  (block 16 forced); compared with the same vLLM CPU_MLA run (vLLM's AMX_MLA takes bf16 only, where
  greedy tokens of two kernels are not comparable).

Not covered here: prefill rows over cached context (chunked prefill, prefix hits), which only the
AMX_MLA regime allows; see the note in scenarios() for why no token-exact reference exists for them.

Run by ``make test-vllm`` in build/venv-vllm, never by the main ``make test``.
"""
from __future__ import annotations

import os
import types

import pytest

from tests_vllm.make_models import MLA_KINDS, make_mla
from tests_vllm.test_vllm_plugin import max_logprob_diff, prompts, run_llm_process

pytest.importorskip("vllm", reason="make test-vllm runs these in the venv that has vLLM")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "build", "vllm-models")
OURS = {"CPU_MLA": "paged_ops.integrations.vllm_mla.PagedOpsMLABackend",
        "AMX_MLA": "paged_ops.integrations.vllm_mla.PagedOpsAMXMLABackend"}
THEIRS = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
LOGPROB_TOL = 1e-3  # float32 on both sides, two layers (as test_vllm_plugin)
KINDS = tuple(MLA_KINDS)


def has_amx() -> bool:
    import platform

    import torch
    return platform.machine() == "x86_64" and torch.cpu._is_amx_tile_supported()


def spec(kind: str, **llm) -> dict:
    # 96 shared tokens (a prefix the default scenario caches), prompts up to 296 tokens
    return dict(model=os.path.join(MODEL_DIR, kind), prompts=prompts(5, 96, [7, 40, 200, 1]), max_tokens=12,
                rounds=2, logprobs=2, llm=llm)


def scenarios(ours: bool) -> dict[str, dict]:
    s = {f"{k}-cpu_mla": spec(k, attention_backend="CPU_MLA") for k in KINDS}
    if ours:
        # Chunked prefill and prefix caching stay off (the default on CPU_MLA, not on AMX_MLA): vLLM
        # 0.32's CPU rotary_embedding op, applied in place to the strided q[..., nope:] and k_pe
        # slices (model_executor/layers/mla.py, MultiHeadLatentAttentionWrapper.forward), gives a
        # position results that depend on the step's token count and on the strides (the same
        # prompt's k_pe at positions 2..11 differs between a 12-, a 64- and a 103-token step,
        # before paged_ops' ops are called), so a run whose steps are cut otherwise than the
        # reference's is not comparable token for token, whatever the attention backend.
        for k in KINDS:
            s[f"{k}-default-block32"] = spec(k, block_size=32, enable_prefix_caching=False,
                                             enable_chunked_prefill=False, max_num_batched_tokens=2048)
        s["deepseek_v2-default-block48"] = spec("deepseek_v2", block_size=48, enable_prefix_caching=False,
                                                enable_chunked_prefill=False, max_num_batched_tokens=2048)
    return s


def run_vllm(plugins: str | None, specs: list[dict]) -> dict:
    """run_llm_process's result plus "log": the lines of stdout and stderr that name paged_ops or a
    backend (which MLA backend vLLM picked)."""
    result, stdout, stderr = run_llm_process(plugins, specs)
    log = [ln for ln in (stdout + stderr).splitlines()
           if ("paged_ops" in ln or "backend." in ln) and not ln.startswith("RESULT ")]
    return result | {"log": log}


@pytest.fixture(scope="module")
def results():
    for kind in KINDS:
        make_mla(kind, os.path.join(MODEL_DIR, kind))
    ours_specs, theirs_specs = scenarios(True), scenarios(False)
    ours = run_vllm("paged_ops", list(ours_specs.values()))
    theirs = run_vllm(None, list(theirs_specs.values()))
    return ({"meta": ours, **dict(zip(ours_specs, ours["runs"]))},
            {"meta": theirs, **dict(zip(theirs_specs, theirs["runs"]))})


def test_plugin_replaces_both_mla_backends(results):
    ours, theirs = results
    assert ours["meta"]["backends"]["CPU_MLA"] == OURS["CPU_MLA"]
    assert ours["meta"]["backends"]["AMX_MLA"] == OURS["AMX_MLA"]
    assert theirs["meta"]["backends"]["CPU_MLA"] == THEIRS
    mla = [ln for ln in ours["meta"]["log"] if "paged_ops:" in ln and "_MLA ->" in ln]
    assert len(mla) == 1, ours["meta"]["log"]  # one line per process for its MLA layers
    assert not [ln for ln in theirs["meta"]["log"] if "paged_ops:" in ln]
    # which backend vLLM's platform picked when none was asked for
    picked = "AMX_MLA" if has_amx() else "CPU_MLA"
    assert any(f"Using {picked} backend" in ln for ln in ours["meta"]["log"]), ours["meta"]["log"]


def _same(a_rounds, b_rounds, n_rounds=2):
    for r in range(n_rounds):
        assert [o["tokens"] for o in a_rounds[r]] == [o["tokens"] for o in b_rounds[r]], f"round {r}"
        assert all(len(o["tokens"]) == 12 for o in a_rounds[r])
    assert max_logprob_diff(a_rounds, b_rounds) <= LOGPROB_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_cpu_mla(results, kind):
    ours, theirs = results
    _same(ours[f"{kind}-cpu_mla"]["rounds"], theirs[f"{kind}-cpu_mla"]["rounds"])


@pytest.mark.parametrize("name", ["deepseek_v2-default-block32", "deepseek_v3-default-block32",
                                  "deepseek_v2-default-block48"])
def test_greedy_tokens_equal_default_selection(results, name):
    """Ours where vLLM's platform picks the backend (AMX_MLA here when the CPU has AMX), at block
    sizes vLLM's CPU_MLA refuses, against vLLM's CPU_MLA at block 16."""
    ours, theirs = results
    kind = name.split("-")[0]
    _same(ours[name]["rounds"], theirs[f"{kind}-cpu_mla"]["rounds"])


def test_prefill_over_cached_context_matches_reference():
    """The path the whole-model runs cannot check token for token (chunked prefill and prefix
    hits, see scenarios()): PagedOpsMLAImpl's cache write then forward_mha for prefill requests
    with cached context (and one without), on a random latent cache in random block order, against
    the float64 reference attention over the same up-projected keys and values; and forward_mqa
    (the absorbed decode) against the reference over the latent rows."""
    import torch

    from paged_ops import reference
    from paged_ops.integrations.vllm_mla import PagedOpsMLAImpl, prefill_rows
    g = torch.Generator().manual_seed(0)
    H, rank, rope, nope, vd, bs = 4, 512, 64, 32, 32, 16
    w = torch.randn(H * (nope + vd), rank, generator=g) * rank ** -0.5
    impl = PagedOpsMLAImpl(num_heads=H, head_size=rank + rope, scale=(nope + rope) ** -0.5, num_kv_heads=1,
                           alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                           attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                           kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                           qk_head_dim=nope + rope, v_head_dim=vd, kv_b_proj=lambda x: (x @ w.T, None))
    seq_lens, q_lens = [50, 7, 33], [20, 7, 1]  # request 1 without context, request 2 one new token
    num_blocks = 16
    cache = torch.full((num_blocks, bs, rank + rope), float("nan"))
    table = torch.randperm(num_blocks, generator=g)[:12].view(3, 4).to(torch.int32)
    latent = [torch.randn(n, rank, generator=g) for n in seq_lens]
    pe = [torch.randn(n, 1, rope, generator=g) for n in seq_lens]
    slots = [table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for r, n in enumerate(seq_lens)]
    # the context was written by earlier steps, this step's rows now (as do_kv_cache_update runs first)
    for r, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        impl.do_kv_cache_update(latent[r][:n - ql], pe[r][:n - ql], cache, slots[r][:n - ql], "auto", None)
    new = lambda parts: torch.cat([x[n - ql:] for x, n, ql in zip(parts, seq_lens, q_lens)])  # noqa: E731
    impl.do_kv_cache_update(new(latent), new(pe), cache, new(slots), "auto", None)
    q = torch.randn(sum(q_lens), H, nope + rope, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    has_ctx, gather, kv_table = prefill_rows(table, torch.tensor(seq_lens), torch.tensor(q_lens), bs)
    assert has_ctx
    prefill = types.SimpleNamespace(paged_ops_has_context=True, paged_ops_slots=gather, paged_ops_kv_table=kv_table,
                                    paged_ops_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                    query_start_loc=qsl, max_query_len=max(q_lens))
    out = torch.full((sum(q_lens), H * vd), float("nan"))
    impl.forward_mha(q, new(latent), new(pe), cache, types.SimpleNamespace(prefill=prefill), None, out)
    for r, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        kv = (latent[r] @ w.T).view(n, H, nope + vd)
        k = torch.cat([kv[..., :nope], pe[r].expand(n, H, rope)], dim=-1)
        ref = reference.attention(q[qsl[r]:qsl[r + 1]].double(), k.double(), kv[..., nope:].double(), impl.scale, True)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].view(ql, H, vd).double(), ref, rtol=1e-4, atol=1e-4)
    # absorbed decode over the same cache: one query row per request
    qd = torch.randn(3, H, rank + rope, generator=g)
    decode = types.SimpleNamespace(block_table=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    o, _ = impl.forward_mqa((qd[..., :rank], qd[..., rank:]), cache, types.SimpleNamespace(decode=decode), None)
    for r, n in enumerate(seq_lens):
        kl = torch.cat([latent[r], pe[r][:, 0]], dim=-1)[:, None].double()
        ref = reference.attention(qd[r:r + 1].double(), kl, kl[..., :rank], impl.scale, True)
        torch.testing.assert_close(o[r:r + 1].double(), ref, rtol=1e-4, atol=1e-4)

"""The op contract of namespace ``paged``, written once: naive PyTorch versions of every op.

This module is the specification (README, docs/CONTRACT_NOTES.md, csrc/ops.h and the wrappers in
``paged_ops`` point here) and the oracle every test compares against.

Every function has the same signature as its op and writes into its output argument; the ops
return nothing. Pass float64 tensors (``query.double()``, a float64 ``out``) to get the float64
answer the tests compare against; caches may stay in their storage dtype (float8 caches are
dequantized exactly into float64 here).

Rules shared by every op (the public ops check them and raise ``ValueError`` naming the argument):

- Caches: ``[num_blocks, block_size, num_kv_heads, head_size]`` addressed by strides (a cache
  allocated ``[num_blocks, num_kv_heads, block_size, head_size]`` and permuted to this view works
  too); token ``j`` of a sequence lives at ``cache[block_table[j // block_size], j % block_size]``.
  The last dimension of every activation and cache is contiguous.
- Any block size >= 1; head sizes that are multiples of 8 up to 576; query dtypes float32,
  float16, bfloat16; caches of the query dtype or fp8 (``float8_e4m3fn``, ``float8_e5m2``), which
  need ``k_scale``/``v_scale``: float32, contiguous, 1 element (per tensor), ``[num_kv_heads]``
  (per KV head) or, in the attention ops, ``[num_seqs, num_kv_heads]`` (per sequence and KV
  head, FlashAttention-3's descale); K and V may each take another form.
- GQA: num_heads is any multiple of num_kv_heads; query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)``.
- Keys and values may differ in head size (MLA): in the attention ops ``query`` and ``key_cache``
  have head size ``Dk``, ``value_cache`` and ``out`` ``Dv <= Dk``; the caches agree in every other
  dimension. ``value_cache`` may be a view into ``key_cache``'s storage (absorbed MLA decode:
  ``value_cache = key_cache[..., :Dv]``, one latent per token); ``reshape_and_cache`` writes keys
  and values of their own caches' head sizes.
- Index tensors: block_tables, seq_lens, cu_seqlens_q int32; slot_mapping, block_mapping int64;
  all contiguous. Cache slots no sequence reaches and block-table entries past a sequence's length
  are never read.
- Checks that read tensor contents (block ids, slots, indices, lengths, ALiBi slopes) always run
  on CPU tensors; on CUDA tensors they cost a device sync, so they run only with
  ``PAGED_OPS_CHECK=1``.
- Outputs (``out``, ``lse``, the caches ``reshape_and_cache`` writes, ...) must not share memory
  with an input of the call or with each other (inputs may share memory with each other).
"""
from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def saturating_fp8_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, clamped to the fp8 range, cast with round-to-nearest-even.

    torch's own cast turns out-of-range values into NaN (e4m3fn) or inf (e5m2);
    the contract saturates instead, so quantized outliers stay finite.
    """
    m = fp8_max(dtype)
    return (x.to(torch.float32) / scale.to(torch.float32)).clamp(-m, m).to(dtype)


def _per_head_scale(scale: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor | None:
    # [1] or [num_kv_heads] -> [num_kv_heads, 1], broadcasting over head_size
    if scale is None:
        return None
    return scale.to(torch.float32).reshape(-1).expand(num_kv_heads).reshape(num_kv_heads, 1)


def _dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    # x: [..., num_kv_heads, head_size] -> float64
    x = x.to(torch.float64)
    if scale is not None:
        x = x * _per_head_scale(scale, x.shape[-2]).to(torch.float64)
    return x


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, dequantized: ``[seq_len, num_kv_heads, head_size]`` float64.

    scale: this sequence's scale, 1 element or ``[num_kv_heads]``."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    blocks = block_table.to(torch.int64).cpu()[positions // block_size]
    tokens = cache[blocks.to(cache.device), (positions % block_size).to(cache.device)]
    return _dequantize_kv(tokens, scale)


def _sequence_scale(scale: torch.Tensor | None, s: int) -> torch.Tensor | None:
    # [num_seqs, num_kv_heads] -> sequence s's [num_kv_heads]; 1 element / [num_kv_heads] as they are
    return scale[s] if scale is not None and scale.dim() == 2 else scale


def visible_keys(q_len: int, kv_len: int, causal: bool, window_left: int = -1, window_right: int = -1,
                 device=None) -> torch.Tensor:
    """``[q_len, kv_len]`` bool: which keys each query row sees (``attention`` defines it)."""
    position = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)  # p: [q_len, 1]
    key = torch.arange(kv_len, device=device).unsqueeze(0)  # j: [1, kv_len]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= position
    if window_left >= 0:
        visible &= key >= position - window_left
    if window_right >= 0:
        visible &= key <= position + window_right
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, *,
              softcap: float = 0.0, window_left: int = -1, sinks: torch.Tensor | None = None,
              alibi_slopes: torch.Tensor | None = None, return_lse: bool = False, window_right: int = -1):
    """Softmax attention of one sequence in float64 (the definition of every attention op).

    q: [q_len, num_heads, head_size]; k: [kv_len, num_kv_heads, head_size]; v: [kv_len,
    num_kv_heads, value_head_size] (MLA: value_head_size <= head_size).
    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA).

    Query row ``i`` sits at position ``p = kv_len - q_len + i`` (bottom-right aligned: the new
    tokens are the last ``q_len`` of the sequence; decode is ``q_len = 1``, ``p = kv_len - 1``;
    when ``q_len > kv_len`` the first rows sit before the first key). Key ``j`` is visible iff
    ``(not causal or j <= p) and (window_left < 0 or j >= p - window_left) and
    (window_right < 0 or j <= p + window_right)``. With ``s_j = scale * (q . k_j)``:

    1. ``softcap > 0``: ``s_j = softcap * tanh(s_j / softcap)`` (Gemma 2, Grok);
    2. ``alibi_slopes`` (float32 ``[num_heads]``, finite): ``s_j += slope[h] * (j - p)`` (BLOOM, MPT);
    3. the row's denominator is ``Z = sum over visible j of exp(s_j)``, plus ``exp(sinks[h])`` when
       ``sinks`` (float32 ``[num_heads]``, gpt-oss) is given; ``out = sum exp(s_j) v_j / Z``: a sink is a
       key with a logit and no value;
    4. the log-sum-exp of the row is ``ln Z`` (natural log, of the scaled, capped, biased scores).

    Keys and values a row does not see never enter its result: an inf or NaN in them changes
    nothing (a select, not a multiply by 0); a non-finite value the row sees makes it non-finite.
    A row with no visible key is 0 with log-sum-exp -inf (as FlashAttention and vLLM); with a
    sink it is 0 with log-sum-exp ``sinks[h]``. Sinks may be infinite: ``-inf`` is no sink,
    ``+inf`` gives out 0 and log-sum-exp +inf, NaN a NaN row. Returns ``out: [q_len, num_heads,
    value_head_size]`` and, with ``return_lse``, also ``lse: [q_len, num_heads]`` (float64).
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    q = q.to(torch.float64)
    k = k.to(torch.float64).repeat_interleave(group, dim=1)
    v = v.to(torch.float64).repeat_interleave(group, dim=1)
    device = q.device
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, kv_len]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)  # p: [q_len, 1]
    key = torch.arange(kv_len, device=device).unsqueeze(0)  # j: [1, kv_len]
    if alibi_slopes is not None:
        distance = (key - position).to(torch.float64)  # j - p: [q_len, kv_len]
        scores = scores + alibi_slopes.to(device, torch.float64).view(-1, 1, 1) * distance
    visible = visible_keys(q_len, kv_len, causal, window_left, window_right, device)
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        # The sink is one more logit per head in the denominator, with no value.
        sink = sinks.to(device, torch.float64).view(-1, 1, 1).expand(num_heads, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [num_heads, q_len]; -inf for a row with nothing
    # A row with nothing (lse -inf) has probabilities 0, not (-inf) - (-inf) = NaN.
    probs = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, torch.exp(scores - lse.unsqueeze(-1)))
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("hqk,khd->qhd", probs, torch.where(torch.isfinite(v), v, 0.0)).contiguous()
    # Non-finite values enter only the rows that see them (probs * v there, IEEE).
    bad = ~torch.isfinite(v) & visible.any(0).view(kv_len, 1, 1)
    if bad.any():
        ks, hs, ds = bad.nonzero(as_tuple=True)
        terms = probs[hs, :, ks] * v[ks, hs, ds].unsqueeze(1)  # [n_bad, q_len]
        terms = torch.where(visible[:, ks].T, terms, 0.0)
        out.view(q_len, -1).index_add_(1, hs * v.shape[-1] + ds, terms.T)
    # A NaN log-sum-exp (a NaN sink, a NaN score) is a NaN row, even over no key at all.
    out = torch.where(torch.isnan(lse).transpose(0, 1).unsqueeze(-1), math.nan, out)
    return (out, lse.transpose(0, 1)) if return_lse else out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write token ``t``'s key/value into slot ``slot_mapping[t]`` (skipped when negative).

    key, value: [num_tokens, num_kv_heads, head_size of its cache]; slot_mapping: int64 [num_tokens],
    slot = block * block_size + offset. fp8 caches store the saturating cast of ``x / scale``
    (``saturating_fp8_cast``; per tensor or per KV head).
    """
    block_size = key_cache.shape[1]
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, block_size)
            if cache.dtype in FP8_DTYPES:
                stored = saturating_fp8_cast(x[t], _per_head_scale(scale, x.shape[1]), cache.dtype)
            else:
                stored = x[t].to(cache.dtype)
            cache[block, offset] = stored


def concat_and_cache_mla(latent, rope, latent_cache, slot_mapping, scale=None) -> None:
    """MLA's latent cache write (vLLM's ``concat_and_cache_mla``): token ``t``'s latent and RoPE
    part, concatenated, into slot ``slot_mapping[t]`` (skipped when negative).

    latent: [num_tokens, kv_lora_rank]; rope: [num_tokens, rope_dim] (its dtype); slot_mapping:
    int64 [num_tokens]; latent_cache: [num_blocks, block_size, 1, kv_lora_rank + rope_dim] (one KV
    head, so the attention ops read it as ``key_cache`` and ``latent_cache[..., :kv_lora_rank]`` as
    ``value_cache``); kv_lora_rank > 0 and rope_dim >= 0 multiples of 8 (DeepSeek: 512 and 64). An
    fp8 cache stores the saturating cast of ``x / scale``, ``scale`` float32 with 1 element
    (required for fp8, absent otherwise). That is ``reshape_and_cache`` with the latent as the key
    and the RoPE part as the value, one KV head each, into the cache's two column ranges.
    """
    rank = latent.shape[1]
    reshape_and_cache(latent.unsqueeze(1), rope.unsqueeze(1), latent_cache[..., :rank], latent_cache[..., rank:],
                      slot_mapping, scale, scale)


def prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, scale, causal=True, k_scale=None, v_scale=None, *, softcap=0.0,
                      window_left=-1, sinks=None, alibi_slopes=None, lse=None, batch_invariant=False,
                      window_right=-1) -> None:
    """Varlen paged attention over a flattened batch of query tokens.

    query: [total_q_tokens, num_heads, head_size]; out: [total_q_tokens, num_heads, value_head_size]
    (value_cache's head size, <= head_size: MLA); sequence ``s`` owns query rows
    ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]`` and attends to its first ``seq_lens[s]`` cached
    tokens, which include the new tokens themselves (their K/V are already in the cache), so
    0 <= q_len <= seq_len. cu_seqlens_q: int32 [num_seqs + 1], from 0 to total_q_tokens;
    max_seqlen_q: the longest q_len (a hint: no row is left uncomputed if it is too small, but
    validation rejects it on CPU tensors). Causal is bottom-right aligned (``attention``), so one
    batch covers prefill, chunked prefill over cached context and decode rows (q_len = 1);
    q_len > seq_len is allowed (the rows before the first key see none: out 0, lse -inf).

    Keyword-only variants (``attention`` defines them): ``softcap`` 0 (none) or in
    [2^-126, 2^126], ``window_left`` >= -1 (-1: no window; a query sees itself and ``window_left``
    keys before it), ``window_right`` >= -1 (-1: no limit; at most ``window_right`` keys after
    it, for non-causal local attention), ``sinks`` and ``alibi_slopes`` float32 ``[num_heads]`` on the query's device, and ``lse``:
    float32 ``[total_q_tokens, num_heads]``, contiguous, written with each row's log-sum-exp.

    ``batch_invariant=True`` (also ``paged_ops.batch_invariant()`` and
    ``PAGED_OPS_BATCH_INVARIANT=1``) changes no value here, only how a backend may compute it: every
    row's ``out`` and ``lse`` are then bitwise the same whatever else is in the batch, however many
    threads run, and whether the row comes from ``decode_attention`` or from a prefill of any q_len.
    """
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        if cu[s + 1] == cu[s]:
            continue
        k = gather_kv(key_cache, block_tables[s], seq_len, _sequence_scale(k_scale, s))
        v = gather_kv(value_cache, block_tables[s], seq_len, _sequence_scale(v_scale, s))
        rows = slice(cu[s], cu[s + 1])
        o, row_lse = attention(query[rows], k, v, scale, causal, softcap=softcap, window_left=window_left,
                               sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True,
                               window_right=window_right)
        out[rows] = o.to(out.dtype)
        if lse is not None:
            lse[rows] = row_lse.to(lse.dtype)


def decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     k_scale=None, v_scale=None, *, softcap=0.0, window_left=-1, sinks=None,
                     alibi_slopes=None, lse=None, batch_invariant=False, window_right=-1) -> None:
    """One query token per sequence attending to all ``seq_lens[s]`` cached tokens.

    query: [num_seqs, num_heads, head_size]; out: [num_seqs, num_heads, value_head_size];
    block_tables: int32 [num_seqs, max_blocks];
    seq_lens: int32 [num_seqs], each >= 0 (0: a padded slot, whose row sees no key: out 0, lse
    -inf); lse: float32 [num_seqs, num_heads]. Same as prefill with q_len = 1 (causal), variants
    and ``batch_invariant`` included (``window_right`` changes nothing under causal).
    """
    num_seqs = query.shape[0]
    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32)
    prefill_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      1, scale, True, k_scale, v_scale, softcap=softcap, window_left=window_left,
                      sinks=sinks, alibi_slopes=alibi_slopes, lse=lse, batch_invariant=batch_invariant,
                      window_right=window_right)


def merge_attention_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """Attention over two disjoint key sets, from attention over each (cascade / shared-prefix).

    out, prefix_out, suffix_out: [num_tokens, num_heads, head_size] (one float dtype);
    prefix_lse, suffix_lse, out_lse (optional): float32 [num_tokens, num_heads], contiguous.
    ``merge_states`` of the two states: see there.
    """
    merge_states(out, out_lse, torch.stack([prefix_out, suffix_out], dim=1),
                 torch.stack([prefix_lse, suffix_lse], dim=1))


def merge_states(out, out_lse, states, states_lse) -> None:
    """Attention over N disjoint key sets, from attention over each (split-KV, context parallelism).

    states: [num_tokens, num_states, num_heads, head_size] (out's dtype; last dimension
    contiguous, other strides free); states_lse: float32 [num_tokens, num_states, num_heads];
    out: [num_tokens, num_heads, head_size]; out_lse (optional): float32 [num_tokens, num_heads].
    With l_i the states' log-sum-exps: ``out = sum_i e^{l_i} states_i / sum_i e^{l_i}``,
    ``out_lse = ln sum_i e^{l_i}``. A state whose lse is -inf (attention over no key)
    contributes nothing, even its out; all -inf (or no state) gives out 0 and -inf, as attention
    over no key does. A state with lse +inf or NaN makes the row NaN.
    """
    lse = states_lse.to(torch.float64)  # [T, N, H]
    num_tokens, num_states, num_heads = lse.shape
    m = (lse.amax(dim=1, keepdim=True) if num_states else
         torch.full((num_tokens, 1, num_heads), -math.inf, dtype=torch.float64))
    bad = torch.isnan(lse).any(dim=1, keepdim=True) | torch.isposinf(lse).any(dim=1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)  # every state empty: weights 0, not NaN
    w = torch.exp(lse - m)  # [T, N, H]; 0 where lse is -inf
    parts = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, w.unsqueeze(-1) * states.to(torch.float64))
    total = w.sum(dim=1, keepdim=True)  # [T, 1, H]
    merged = torch.where(total.unsqueeze(-1) > 0, parts.sum(dim=1, keepdim=True) / total.unsqueeze(-1), 0.0)
    merged = torch.where(bad.unsqueeze(-1), math.nan, merged)
    merged_lse = torch.where(bad, math.nan, m + torch.log(total))
    out.copy_(merged.squeeze(1).to(out.dtype))
    if out_lse is not None:
        out_lse.copy_(merged_lse.squeeze(1).to(out_lse.dtype))


def quantize_fp8(out, input, scale) -> None:
    """``out = saturate(input / scale)`` cast to out's fp8 dtype (round-to-nearest-even).

    Bit-identical to torch's cast of ``(input / scale).clamp(-max, max)``; scale: float32, 1 element.
    """
    out.copy_(saturating_fp8_cast(input, scale.reshape(()), out.dtype))


def dequantize_fp8(out, input, scale) -> None:
    """``out = input * scale`` computed in float32, cast to out's dtype."""
    out.copy_((input.to(torch.float32) * scale.to(torch.float32).reshape(())).to(out.dtype))


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """For every (src, dst) row of ``block_mapping`` and every layer: ``cache[dst] = cache[src]``.

    block_mapping: int64 [n, 2], on the CPU or the caches' device; destinations are distinct and
    never sources (copy-on-write), so the order of the rows does not matter.
    """
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def swap_blocks(src, dst, block_mapping) -> None:
    """``dst[d] = src[s]`` for every (s, d) row; src and dst may be on different devices.

    Completion, when one side is a GPU (as vLLM's ``swap_blocks``): the copies are *ordered on the
    current CUDA stream* of the GPU tensor's device, not complete on return. Work queued later on
    that stream (kernels reading a swapped-in block) sees the data; anything else (the host reading
    or reusing a swapped-out CPU block, another stream) must synchronize with the stream first,
    e.g. ``torch.cuda.current_stream().synchronize()`` or an event. The host side should be pinned
    memory (``pin_memory=True``) so the copy is truly asynchronous; pageable memory is copied
    correctly but the call may block. ``block_mapping`` is a CPU tensor, so the op never syncs to
    read it. On CPU-only tensors the copies are complete on return.
    """
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)

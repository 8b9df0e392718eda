"""KV-cache bytes per token: DeepSeek's latent (MLA) cache against the per-head cache of the same model.

The model is DeepSeek-V3 at its real sizes: transformers' ``DeepseekV3Config()`` defaults (61
layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128),
no weights. The bytes come from the engine's own allocation: ``engine.attention.cache_layout``
is the layout ``ModelRunner`` picks (the native model's latent, one ``kv_lora_rank + rope`` row per
token whose value cache is a view of it; or, through transformers' modeling code, per-head keys of
``qk_nope + rope`` and values of ``v_head`` for every head), ``KVCache.allocate`` allocates one
block of one token for one layer, and the bytes of the distinct tensors it holds are counted (and
checked against ``ModelRunner``'s ``bytes_per_block`` formula, ``CacheLayout.bytes_per_token``).
Run: ``python -m bench.kv_bytes``.
"""
from __future__ import annotations

import argparse

import torch
from transformers import DeepseekV3Config

from engine.attention import KVCache, cache_layout

GiB = 1 << 30
LAYOUTS = {"latent (MLA, native)": True, "per-head K/V (transformers path)": False}


def allocated_bytes_per_token(config, latent: bool, dtype: torch.dtype) -> int:
    """Bytes one token takes in one layer's cache, measured on what the engine allocates."""
    layout = cache_layout(config, latent=latent)
    kv = KVCache.allocate(layout, num_layers=1, num_blocks=1, block_size=1, dtype=dtype, device="cpu")
    measured = sum(t.numel() * t.element_size() for t in kv.storage())
    assert measured == layout.bytes_per_token(dtype), (measured, layout)
    return measured


DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  # the model's dtype, and kv_cache_dtype="fp8" (both layouts take it)


def rows(config=None, dtypes=DTYPES) -> list[dict]:
    """One row per (dtype, layout); ``x latent``: bytes against the first dtype's latent row."""
    config = config or DeepseekV3Config()
    out = []
    for dtype, (name, latent) in ((d, item) for d in dtypes for item in LAYOUTS.items()):
        layout = cache_layout(config, latent=latent)
        per_layer = allocated_bytes_per_token(config, latent, dtype)
        per_token = per_layer * config.num_hidden_layers
        out.append({"cache": name, "dtype": str(dtype).removeprefix("torch."),
                    "shape per block": f"[*, bs, {layout.num_kv_heads}, {layout.key_size}]"
                                       + ("" if layout.value_in_key else
                                          f" + [*, bs, {layout.num_kv_heads}, {layout.value_size}]"),
                    "bytes/token/layer": per_layer, "KiB/token (all layers)": per_token / 1024,
                    "tokens/GiB": GiB // per_token})
    latent_bytes = out[0]["bytes/token/layer"]
    for r in out:
        r["x latent"] = r["bytes/token/layer"] / latent_bytes
    return out


COLUMNS = ["cache", "dtype", "shape per block", "bytes/token/layer", "KiB/token (all layers)", "tokens/GiB", "x latent"]


def summary(table_rows: list[dict], config=None) -> str:
    from bench.common import table
    c = config or DeepseekV3Config()
    return (table(table_rows, COLUMNS) + f"\nDeepSeek-V3 ({c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
            f"kv_lora_rank {c.kv_lora_rank}, rope {c.qk_rope_head_dim}, qk_nope {c.qk_nope_head_dim}, "
            f"v_head {c.v_head_dim}); bytes from engine.attention.KVCache.allocate; x latent: against the first row")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", nargs="+", default=[str(d).removeprefix("torch.") for d in DTYPES],
                    choices=["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
    ap.add_argument("--save", action="store_true",
                    help="write the 'kv_bytes' section of the results file (bench.common.RESULTS_DIR)")
    args = ap.parse_args(argv)
    result = rows(dtypes=[getattr(torch, d) for d in args.dtype])
    print(summary(result))
    if args.save:
        from bench.common import save_section
        print("written:", save_section("kv_bytes", {"rows": result}))
    return result


if __name__ == "__main__":
    main()

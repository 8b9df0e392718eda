"""EngineConfig: every engine argument, validated once, in one place."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from numbers import Integral, Real

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# "native": engine/models (Llama, Mistral, Qwen2; fused projections); "transformers": any decoder
# through transformers' attention interface; "auto": native where it exists.
MODEL_IMPLS = ("auto", "native", "transformers")
PREEMPTION_MODES = ("recompute", "swap")
GiB = 1 << 30
# vLLM engine arguments that LLM(...) takes at vLLM's default only, where they change nothing here
# (one device, no quantization, no LoRA, a local directory and no hub revision)
VLLM_DEFAULT_ONLY = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "quantization": None,
                     "revision": None, "tokenizer_revision": None, "tokenizer_mode": "auto",
                     "enable_lora": False}


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_kwargs(owner: str, kwargs: dict, supported, default_only: dict | None = None) -> dict:
    """kwargs without the vLLM arguments that are at their default_only value; ValueError naming
    the first other argument that is not in supported (a vLLM habit that would otherwise be
    a dataclass' TypeError)."""
    default_only = default_only or {}
    for name, value in kwargs.items():
        if name in supported:
            continue
        if name in default_only and value == default_only[name]:
            continue
        only = f" (only {name}={default_only[name]!r})" if name in default_only else ""
        raise ValueError(f"{name}={value!r} is not supported by paged_ops' engine{only}; {owner} takes: "
                         f"{', '.join(sorted(supported))}")
    return {k: v for k, v in kwargs.items() if k in supported}


@dataclass
class EngineConfig:
    """Arguments of ``LLM`` / ``LLMEngine`` (vLLM's names). The KV pool is num_kv_blocks blocks
    if given, else kv_cache_memory_bytes (CPU, default 1 GiB) or gpu_memory_utilization of the
    device (CUDA). The swap pool (preemption_mode="swap" only) is num_cpu_blocks blocks if given,
    else swap_space GiB, else swap_space_bytes. ``from_kwargs`` is the constructor LLM uses: any
    other keyword is a ValueError naming it."""
    model: str
    tokenizer: str | None = None          # directory of the tokenizer; default: the model's
    dtype: str = "float32"                # "auto": the checkpoint's, float32 -> bfloat16 (vLLM)
    device: str | None = None             # default: cuda if available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None      # default: the model's limit (max_position_embeddings)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    preemption_mode: str = "recompute"
    swap_space: float | None = None       # GiB, as vLLM
    swap_space_bytes: int = GiB
    num_cpu_blocks: int | None = None
    seed: int | None = 0                  # the engine's sampling generator; None: unseeded (random)
    model_impl: str = "auto"
    enforce_eager: bool = False           # accepted, no effect: the engine has no CUDA graphs, always eager
    trust_remote_code: bool = False       # the checkpoint's own modeling code (local files only)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """EngineConfig(model, **kwargs) for LLM(...): the vLLM arguments of VLLM_DEFAULT_ONLY are
        accepted at their default, any other unknown keyword is a ValueError naming it."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"model"}
        return cls(model, **check_kwargs("LLM", kwargs, fields, VLLM_DEFAULT_ONLY))

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)) or not os.path.isdir(self.model):
            raise ValueError(f"model must be a local checkpoint directory (no hub downloads); "
                             f"{str(self.model)!r} does not exist")
        self.model = str(self.model)
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a local directory; {self.tokenizer!r} does not exist")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            self._check_int(name, minimum=1)
        for name in ("num_kv_blocks", "max_model_len"):
            self._check_int(name, minimum=1, optional=True)
        for name in ("kv_cache_memory_bytes", "num_cpu_blocks"):
            self._check_int(name, minimum=0, optional=True)
        self._check_int("swap_space_bytes", minimum=0)
        self._check_int("seed", minimum=-2 ** 63, optional=True)
        for name in ("enforce_eager", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.gpu_memory_utilization, Real) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.swap_space is not None:
            if not (isinstance(self.swap_space, Real) and self.swap_space >= 0):
                raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
            self.swap_space_bytes = int(self.swap_space * GiB)

    def _check_int(self, name: str, minimum: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        if not _is_int(value) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolve_dtype(self, hf_config) -> torch.dtype:
        """The model dtype. "auto" is vLLM's rule: the checkpoint's dtype, except that float32
        checkpoints run in the platform's preferred dtype (bfloat16; float16 on CUDA GPUs
        without bfloat16)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype == torch.float32:
            cuda = self.torch_device.type == "cuda"
            return torch.bfloat16 if not cuda or torch.cuda.is_bf16_supported() else torch.float16
        return dtype

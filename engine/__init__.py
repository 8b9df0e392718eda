"""A small paged-attention inference engine over ``torch.ops.paged.*`` (nano-vllm sized,
vLLM semantics). ``from engine import LLM, SamplingParams`` in the repository,
``from paged_ops.engine import ...`` when installed (imports inside are relative)."""
from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput, RunStats
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RunStats"]

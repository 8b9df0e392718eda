"""A small paged-attention inference engine over ``torch.ops.paged.*`` (nano-vllm sized,
vLLM semantics). ``from engine import LLM, SamplingParams``."""
from engine.llm_engine import LLM, CompletionOutput, RequestOutput, RunStats
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RunStats"]

"""Adapters that let other frameworks run their attention through ``torch.ops.paged.*``.

Each submodule imports its framework; this package imports none of them, so ``import paged_ops``
never pulls in vLLM. ``paged_ops.integrations.vllm``: an attention backend for vLLM 0.32,
enabled by the ``paged_ops`` entry point in the ``vllm.general_plugins`` group;
``paged_ops.integrations.vllm_mla``: its MLA backend (DeepSeek-V2/V3), registered by the same entry point.
"""

"""CPU linears with their weights pre-packed for oneDNN once, at load time.

A plain bf16/fp16 ``F.linear`` on CPU hands oneDNN a row-major weight, which it re-lays-out into
its blocked format on every call: for the 32000 x 512 lm_head of the benchmark model that was
~65% of a 16-row call and ~30% of a 64-row one (bench/README.md). Packing once removes it; the
products are the same oneDNN kernels, so results match ``F.linear`` (checked in the tests).
This is the packing torch's own inductor applies to frozen CPU graphs (``mkldnn._linear_pointwise``).
"""
from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's packed path exists for 16-bit floats on CPUs with bf16/fp16 support."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class PackedLinear(nn.Module):
    """``nn.Linear`` with a oneDNN-packed weight (the row count a step usually has as the hint)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in model by a PackedLinear; returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
                count += 1
    return count

"""engine/models: the oneDNN-packed linear against F.linear, and the native model's pieces."""
import pytest
import torch
from torch import nn

from engine.models.packed_linear import PackedLinear, can_pack, pack_linears
from paged_ops.testing import TOLERANCE


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_packed_linear_matches_f_linear():
    dtype = torch.bfloat16  # fp16 packs too where the CPU has AVX512-FP16 (not on the CI machines)
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip("this CPU has no oneDNN bf16 support")  # the engine then keeps nn.Linear
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 200, bias=bias).to(dtype)
        packed = PackedLinear(lin)
        for shape in [(1, 96), (37, 96), (64, 96), (130, 96), (2, 5, 96)]:
            x = torch.randn(shape, generator=g).to(dtype)
            ref = torch.nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            got = packed(x)
            assert got.shape == ref.shape and got.dtype == dtype
            assert rel_l2(got, ref) <= TOLERANCE[dtype], (bias, shape)


def test_pack_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False))).bfloat16()
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no oneDNN bf16 support")
    x = torch.randn(3, 8).bfloat16()
    before = model(x)
    assert pack_linears(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert rel_l2(model(x), before) <= TOLERANCE[torch.bfloat16]


def test_float32_is_never_packed():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))

"""int4: the packed layout, the quantization's error bound, and the C kernel against a plain PyTorch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.int4 import Int4Linear, best, dequantized, quantize_groups

pytestmark = pytest.mark.kernels


def _reference(layer: Int4Linear, rows: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: each row rounded to int8 with scale max|x| / 127, times the dequantized
    weight, plus the bias."""
    rows = rows.float()
    step = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127
    levels = (rows * (1 / step)).round().clamp(-127, 127)
    out = (levels.double() @ layer.dequantized().double().T) * step.double()
    return out if layer.bias is None else out + layer.bias.double()


def test_levels_keep_within_half_a_step_of_the_weight():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    weight[3, :64] = 0.25  # a constant group: scale 0, the offset alone carries it
    levels, scales, offsets = quantize_groups(weight, 64)
    assert levels.dtype == torch.uint8 and int(levels.max()) <= 15
    error = (dequantized(levels, scales, offsets) - weight).abs().view(64, 4, 64)
    bound = scales.float()[..., None] / 2 + 1e-3 * weight.abs().view(64, 4, 64).amax(dim=2, keepdim=True)
    assert bool((error <= bound).all())
    assert torch.equal(dequantized(levels, scales, offsets)[3, :64], torch.full((64,), 0.25))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_packed_layer_stands_for_its_levels(group):
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    layer = Int4Linear(weight, None, group=group)
    assert torch.equal(layer.dequantized(), dequantized(*quantize_groups(weight, group)))
    assert layer.packed.numel() == 96 * 256 // 2 + 96 * 256 // group * 4  # two weights a byte, two float16 a group


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_the_reference(rows, dtype):
    """Every row count the kernel's passes split into (1 to 4 rows at a time), over three tiles, float32 and bfloat16
    input, with a bias."""
    kernel, note = best()
    assert kernel is not None, note
    generator = torch.Generator().manual_seed(rows)
    layer = Int4Linear(torch.randn(96, 512, generator=generator) / 10, torch.randn(96, generator=generator),
                       group=64)
    x = (torch.randn(rows, 512, generator=generator) * 3).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    want = _reference(layer, x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4  # the result is rounded to the input's dtype
    assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance * float(want.abs().max()))


def test_a_model_shaped_product_stays_close_to_the_float_one():
    """At a language model's shape (2,048 inputs) the 4-bit product keeps the float one's direction: its error is
    what 4-bit groups of 64 cost, about a tenth of the output's size for Gaussian weights, not more."""
    generator = torch.Generator().manual_seed(2)
    weight, x = torch.randn(256, 2048, generator=generator) / 45, torch.randn(4, 2048, generator=generator)
    with torch.inference_mode():
        got, want = Int4Linear(weight, None)(x), F.linear(x, weight)
    relative = float((got - want).norm() / want.norm())
    assert 0.02 < relative < 0.12, relative
    assert float(F.cosine_similarity(got, want, dim=1).min()) > 0.99

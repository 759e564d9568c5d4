"""4-bit weights: Int4Linear, on this project's C kernel (int4_linear.c), for the language model's products.

Decode reads every weight once per token, so halving int8's bytes is worth up to twice its decode rate. No
maintained CPU kernel read 4-bit weights near the memory's rate at these shapes (docs/decisions.md, "Four-bit
weights"), so the kernel is this project's: 4-bit weights with a float16 scale and offset per group of GROUP
inputs, times activations rounded to int8 per row, added up exactly in 32-bit integers. One kernel serves decode
(1 to 8 rows) and prefill (any rows), AVX-512 VNNI or AVX2.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_linear.c")
TILE = 32  # output channels a tile of the packed layout holds (int4_linear.c)
# Inputs that share a scale and offset: the choice by drift and speed is in docs/decisions.md ("Four-bit weights").
GROUP = 64


def quantize_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, in) weight -> levels (out, in) uint8 in 0..15, float16 scales and offsets (out, in / group), such that
    weight ~ scale * level + offset. Levels are rounded against the float16 scale and offset the kernel reads."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"in features {in_features} are not a multiple of the group size {group}")
    levels = torch.empty(weight.shape, dtype=torch.uint8)
    scales = torch.empty((out_features, in_features // group), dtype=torch.float16)
    offsets = torch.empty_like(scales)
    for start in range(0, out_features, 1024):  # blocks of rows: the float32 temporaries stay small
        block = weight[start:start + 1024].to(torch.float32).view(-1, in_features // group, group)
        low, high = block.amin(dim=2), block.amax(dim=2)
        scale, offset = ((high - low) / 15).half(), low.half()
        if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
            raise ValueError("a weight is beyond float16's range: 4-bit groups keep float16 scales")
        divisor = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
        level = ((block - offset.float()[..., None]) / divisor[..., None]).round_().clamp_(0, 15)
        levels[start:start + 1024] = level.view(-1, in_features).to(torch.uint8)
        scales[start:start + 1024], offsets[start:start + 1024] = scale, offset
    return levels, scales, offsets


def pack(levels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Levels (out, in) in 0..15 with their float16 scales and offsets (out, groups) -> int4_linear.c's layout:
    (tiles of 32 channels, groups, a 128-byte head of 32 scales and 32 offsets, then blocks of 8 inputs of 128 bytes,
    each two halves of 16 channels where byte 4c+j = input j of channel c | input j+4 << 4)."""
    out_features, in_features = levels.shape
    tiles, groups = out_features // TILE, scales.shape[1]
    blocks = levels.view(tiles, 2, 16, groups, in_features // groups // 8, 2, 4).permute(0, 3, 4, 1, 2, 6, 5)
    weights = (blocks[..., 0] | (blocks[..., 1] << 4)).reshape(tiles, groups, -1)

    def head(table: torch.Tensor) -> torch.Tensor:
        return table.view(tiles, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([head(scales), head(offsets), weights], dim=2).contiguous()


def unpack(packed: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse: levels (out, in), scales and offsets (out, groups)."""
    tiles, groups, _ = packed.shape
    in_features = groups * group

    def table(part: torch.Tensor) -> torch.Tensor:
        return part.contiguous().view(torch.float16).transpose(1, 2).reshape(tiles * TILE, groups)

    weights = packed[..., 4 * TILE:].reshape(tiles, groups, group // 8, 2, 16, 4)
    levels = torch.stack([weights & 15, weights >> 4], dim=-1)  # (tiles, groups, blocks, half, c, j, lo/hi)
    levels = levels.permute(0, 3, 4, 1, 2, 6, 5).reshape(tiles * TILE, in_features)
    return levels, table(packed[..., :2 * TILE]), table(packed[..., 2 * TILE:4 * TILE])


def dequantized(levels: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float32 weight that levels, scales and offsets stand for."""
    groups = scales.shape[1]
    blocks = levels.float().view(levels.shape[0], groups, -1)
    return (blocks * scales.float()[..., None] + offsets.float()[..., None]).view(levels.shape)


class Int4Kernel:
    """int4_linear.c loaded: `product(x, layer)` for any rows."""

    def __init__(self, library: ctypes.CDLL):
        self._function = library.int4_linear
        self._function.restype = ctypes.c_int
        int64, address = ctypes.c_int64, ctypes.c_void_p
        self._function.argtypes = [int64, int64, int64, int64, address, ctypes.c_int, address, address, address]
        isa = library.int4_kernel_isa
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()

    def product(self, rows: torch.Tensor, layer: "Int4Linear") -> torch.Tensor:
        """rows (m, in) float32 or bfloat16, contiguous -> (m, out) float32."""
        count = rows.shape[0]
        out = torch.empty((count, layer.out_features), dtype=torch.float32)
        bias = layer.bias.data_ptr() if layer.bias is not None else None
        failed = self._function(count, layer.out_features, layer.in_features, layer.group, rows.data_ptr(),
                                int(rows.dtype == torch.bfloat16), layer.packed.data_ptr(), bias, out.data_ptr())
        if failed:
            raise MemoryError("int4 product: no scratch memory")
        return out


def _agrees(kernel: Int4Kernel) -> bool:
    """The kernel against F.linear on the dequantized weight, for 1, 5 and 37 rows, float32 and bfloat16 input.
    Activations are rounded to int8 per row, so agreement is to that rounding, not to the bit."""
    generator = torch.Generator().manual_seed(0)
    layer = Int4Linear(torch.randn(64, 128, generator=generator), torch.randn(64, generator=generator),
                       group=32, kernel=kernel)
    weight = layer.dequantized()
    for count in (1, 5, 37):
        x = torch.randn(count, 128, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            rows = x.to(dtype)
            want = F.linear(rows.float(), weight, layer.bias)
            got = kernel.product(rows.contiguous(), layer)
            if not torch.allclose(got, want, atol=0.05 * float(want.abs().max()), rtol=0.05):
                return False
    return True


@functools.cache
def best() -> tuple[Int4Kernel | None, str]:
    """The kernel where it builds and agrees with F.linear, else None; and a line saying which (or why not)."""
    try:
        kernel = Int4Kernel(native.load(SOURCE))
        with torch.inference_mode():
            if not _agrees(kernel):
                return None, "int4: vlscope's kernel disagreed with F.linear here"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("int4 kernel unavailable: %s", exc)
        return None, f"int4: building vlscope's kernel failed ({exc})"
    return kernel, f"int4 on vlscope's kernel ({kernel.isa})"


class Int4Linear(nn.Module):
    """4-bit weights in groups of `group` inputs (a float16 scale and offset each) times int8 activations (one
    scale per row), through int4_linear.c, for any number of rows."""

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the kernel's tiles take a weight of this shape."""
        return out_features % TILE == 0 and in_features % 8 == 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int | None = None,
                 kernel: Int4Kernel | None = None):
        """group: inputs per scale and offset; GROUP, or the largest of 32, 16 and 8 that divides a narrower layer's
        inputs, if None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if not self.fits(self.out_features, self.in_features):
            raise ValueError(f"a {self.out_features} x {self.in_features} weight does not fit int4 tiles of {TILE} "
                             "outputs and 8 inputs")
        self.group = group or next(size for size in (GROUP, 32, 16, 8) if self.in_features % size == 0)
        self.register_buffer("packed", pack(*quantize_groups(weight.detach(), self.group)))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._kernel = kernel

    @property
    def kernel(self) -> Int4Kernel:
        if self._kernel is None:
            self._kernel = best()[0]
            if self._kernel is None:
                raise RuntimeError(best()[1])
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()
        out = self.kernel.product(rows.contiguous(), self)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and drift checks)."""
        return dequantized(*unpack(self.packed, self.group))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 in groups of {self.group} "
                "x int8 (vlscope's kernel)")

"""Weights stored in fewer bytes than they compute in: int8 and int4 (language model), bfloat16 inside a float32 model.

Decode reads every weight once per token, so it is paid in bytes; prefill and the vision tower are paid in
matmul rate. The two are chosen separately: decode-sized products (a few rows) go through the compact kernel,
prefill-sized ones through a matmul in the model's compute dtype on weights widened for that one product.

int8 runs as int8 x int8 through fbgemm, the fastest int8 product measured; where bfloat16 matmul is emulated, the
model computes in float32 and keeps its weights compact. The kernels measured against each other are in
docs/decisions.md ("Linear kernels", "What bfloat16 and int8 weights compute in").
"""
from __future__ import annotations

import functools
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .int4 import Int4Linear
from .packing import PackedLinear, packing_works, quantized_engine
from ..machine import cpu_flags

KERNEL_DTYPE = torch.bfloat16  # activations of CompactLinear's decode-sized products
# Above this many rows (prefill) CompactLinear widens its weight and runs one matmul in the compute dtype: the
# small-product kernels are built for matrix-vector work (docs/decisions.md has the figures).
DIRECT_ROWS = 16


def quantize_rows(weight: torch.Tensor, block_rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row. Done in blocks of rows so each float32 temporary stays in cache:
    one pass over memory instead of five whole-matrix temporaries."""
    quantized = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], block_rows):
        block = weight[start:start + block_rows].to(torch.float32, copy=True)  # never scale the caller's tensor
        block_scales = block.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0)
        quantized[start:start + block_rows] = block.div_(block_scales[:, None]).round_().clamp_(-128, 127)
        scales[start:start + block_rows] = block_scales
    return quantized, scales


class CompactLinear(nn.Module):
    """A Linear whose weight is stored in fewer bytes than it computes in. Decode-sized products (up to
    DIRECT_ROWS rows) go through `small_product` on bfloat16 activations; larger ones through a matmul in the
    input's dtype on the weight widened by `widened` for that one product."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def small_product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= DIRECT_ROWS:
            out = self.small_product(rows.to(KERNEL_DTYPE).contiguous()).to(x.dtype)
        else:
            out = F.linear(rows, self.widened(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def has_int8_dot_product(flags: frozenset[str] | None = None) -> bool:
    """VNNI (or AMX) adds int8 products in 32 bits; without it fbgemm's AVX2 path adds each pair of u8 x s8
    products in 16 bits (vpmaddubsw), which saturates above 2 x 127 x 128 unless activations keep to 7 bits."""

    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & (flags if flags is not None else cpu_flags()))


INT8_WITHOUT_VNNI = ("int8: this CPU has no int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX), so "
                     "one token's activations keep 7 bits, and products of several rows run as two on 7-bit halves "
                     "(exact, twice the work)")


class Int8Linear(nn.Module):
    """int8 weights (one scale per output row) times int8 activations (one scale per token), through fbgemm.

    The weight is packed once, at load, into fbgemm's layout; each call quantizes its activations row by row,
    multiplies in int8 with 32-bit sums (VNNI, or AMX where present) and returns float32 scaled back. Per-token
    activation scales keep one outlier token (the first one often is) from crushing the precision of the rest.
    It reads the weights faster than any other int8 product measured (docs/decisions.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split: bool | None = None):
        """split: keep fbgemm's 16-bit pair sums from saturating (a CPU without int8 dot products): one token's
        activations keep 7 bits, products of several rows run as two on 7-bit halves of 8-bit activations. None:
        where this CPU needs it."""
        super().__init__()
        self.split = (not has_int8_dot_product()) if split is None else split
        quantized, scales = quantize_rows(weight.detach())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        with warnings.catch_warnings():  # PyTorch marks quantized tensors deprecated; fbgemm's packing needs one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(quantized, scales.double(),
                                                               torch.zeros(self.out_features, dtype=torch.long), 0)
        with quantized_engine("fbgemm"):
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.packed_nbytes = quantized.numel()  # held by fbgemm, outside parameters and buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if rows.shape[0] == 1:
            # One token: the op's own per-tensor scale is a per-token one. Where pairs add in 16 bits it keeps
            # activations to 7 bits (reduce_range): one product, so decode reads the weights once.
            out = torch.ops.quantized.linear_dynamic(rows, self._packed, self.split)
        else:
            # Each row scaled to +-127 and rounded, then handed over with scale 1 (fbgemm's uint8 activations around
            # zero point 128); the row's scale is multiplied back onto the float32 result.
            row_scales = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            levels = (rows / row_scales).round_()  # a new tensor: rows may be the caller's
            if self.split:
                # u8 x s8 pairs add in 16 bits without VNNI: 2 x 255 x 127 overflows, 2 x 128 x 127 does not. So
                # the levels go as a high half (-63..63) and the rest (-64..64), each around zero point 64.
                high = levels.clamp(-63.0, 63.0)
                out = self._product(high, 64).add_(self._product(levels.sub_(high), 64))
            else:
                out = self._product(levels, 128)
            out.mul_(row_scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _product(self, levels: torch.Tensor, zero_point: int) -> torch.Tensor:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(levels, 1.0, zero_point, self._packed)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for tests and drift checks)."""
        weight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return weight.dequantize()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 x int8 (fbgemm)"




def swap_linears_(root: nn.Module, layer) -> int:
    """Swap every nn.Linear under `root` for `layer(weight, bias)`, one at a time, so that only one layer's wide
    weight and its compact copy are alive at once. Returns how many were swapped."""
    swapped = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, layer(child.weight, child.bias))
                child.weight = None  # the wide copy goes now, not when the loop's references drop
                swapped += 1
    return swapped


def quantize_language_model_(model: nn.Module, layer, head=None) -> int:
    """The language model's Linear layers as `layer(weight, bias)` and the LM head as `head(weight, bias)` (`layer`
    if None). Returns how many were swapped.

    The LM head is tied to the token embeddings: it gets its own copy and the embeddings stay as they are (only
    looked up, one row per token)."""
    swapped = swap_linears_(model.model.language_model, layer)
    model.lm_head = (head or layer)(model.lm_head.weight, getattr(model.lm_head, "bias", None))
    return swapped + 1


def quantize_int8_(model: nn.Module) -> int:
    """The language model's Linears and LM head as Int8Linear."""
    return quantize_language_model_(model, Int8Linear)


def quantize_vision_int8_(model: nn.Module) -> int:
    """The vision tower's Linear layers as Int8Linear (rows each scaled to int8, as the language model's)."""
    return swap_linears_(model.model.visual, Int8Linear)


# A vision tower's product for a 448x448 picture: 784 patches into a 1024 -> 4096 projection.
VISION_ROWS, VISION_IN, VISION_OUT = 784, 1024, 4096


@functools.cache
def int8_vision_is_faster(threads: int, compute_dtype: str) -> bool:
    """Whether a vision-sized product runs faster through fbgemm's int8 than packed in `compute_dtype`, the best of
    five interleaved timings each (a few tenths of a second; cached per thread count). The vision tower is paid in matmul rate, and VNNI's int8
    products add twice bfloat16's pairs an instruction; AMX's bfloat16 tiles, which fbgemm lacks, would not lose."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
        linear = nn.Linear(VISION_IN, VISION_OUT, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(VISION_OUT, VISION_IN, generator=generator) / 32)
        rows = torch.randn(VISION_ROWS, VISION_IN, generator=generator).to(dtype)
        wide = PackedLinear(linear) if packing_works(dtype) else linear
        compact = Int8Linear(linear.weight.detach().float(), None)
        best = {compact: float("inf"), wide: float("inf")}
        with torch.inference_mode():
            compact(rows), wide(rows)
            for _ in range(5):  # interleaved: a noisy host's slow second falls on both
                for product in best:
                    started = time.perf_counter()
                    product(rows)
                    best[product] = min(best[product], time.perf_counter() - started)
        return best[compact] < best[wide]
    finally:
        torch.set_num_threads(previous)


def int4_or_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """Int4Linear where the layer's shape fits its kernel's tiles, else Int8Linear."""
    return (Int4Linear if Int4Linear.fits(*weight.shape) else Int8Linear)(weight, bias)


# The LM head of int4: 4-bit too. It is a sixth of what a token reads, and at 8 bits it moved agreement with float32
# by one position in 77 (docs/decisions.md, "Four-bit weights").
INT4_HEAD = int4_or_int8


def quantize_int4_(model: nn.Module) -> int:
    """The language model's Linears as Int4Linear (Int8Linear where a shape does not fit its tiles); the LM head
    as INT4_HEAD makes it (docs/decisions.md, "Four-bit weights")."""
    return quantize_language_model_(model, int4_or_int8, INT4_HEAD)


class Bf16Linear(CompactLinear):
    """bfloat16 weights in a model that computes in float32 (for CPUs without fast bfloat16 matmul)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(KERNEL_DTYPE))  # no copy when already bfloat16
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def small_product(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16"


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of a Linear-like layer's weight (and scales) as stored: what one product reads (one copy of a weight
    kept in two layouts)."""
    return getattr(module, "read_nbytes", getattr(module, "packed_nbytes", 0)) + sum(t.numel() * t.element_size() for t in list(module.parameters(recurse=False))
               + [b for b in module.buffers(recurse=False) if b is not None])


LINEAR_KINDS = (nn.Linear, CompactLinear, Int8Linear, Int4Linear, PackedLinear)


class Bf16Embedding(nn.Module):
    """A token embedding kept in bfloat16 (often shared with the LM head) that hands out float32 rows."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(KERNEL_DTYPE))
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).float()


def compute_in_float32_(model: nn.Module) -> None:
    """Make a bfloat16 (or int8) model compute in float32 while its big matrices stay compact.

    Linear layers become Bf16Linear (int8 ones keep their kernel), the token embedding a Bf16Embedding sharing
    its tensor with the LM head when they are tied; everything else (norms, convolution, position tables,
    biases) is small and becomes float32. Activations, attention and the KV cache are then float32."""
    token_embedding = model.get_input_embeddings()
    for parent in list(model.modules()):
        if isinstance(parent, (CompactLinear, Int8Linear, Int4Linear, PackedLinear, Bf16Embedding)):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Bf16Linear(child.weight, child.bias))
            elif child is token_embedding:
                setattr(parent, name, Bf16Embedding(child.weight, child.padding_idx))
        if isinstance(parent, nn.Linear) or parent is token_embedding:
            continue
        for name, param in list(parent.named_parameters(recurse=False)):
            if param.is_floating_point():
                param.data = param.data.float()
        for name, buffer in list(parent.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_floating_point():
                parent._buffers[name] = buffer.float()

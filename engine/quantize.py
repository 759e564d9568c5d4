"""Weights stored in fewer bytes than they compute in: int8 (language model) and bfloat16 inside a float32 model.

Decode reads every weight once per token, so it is paid in bytes; prefill and the vision tower are paid in
matmul rate. The two are chosen separately: decode-sized products (a few rows) go through the compact kernel,
prefill-sized ones through a matmul in the model's compute dtype on weights widened for that one product.

int8: on a stack of 28 Linear(2048, 6144) layers, batch 1, 2 threads, on an AVX-512 BF16 EPYC: bfloat16 29.5 ms
per pass, torchao's Int8WeightOnlyConfig 91 ms, torchao's dynamic int8 504 ms, and PyTorch's own int8 weight
kernel (aten._weight_int8pack_mm, the one gpt-fast uses) 13.0 ms: this module uses the aten kernel.

bfloat16 weights, float32 compute: on an AVX2 EPYC with no bfloat16 instructions, per Linear(2048, 6144):
256 rows take 112 ms in float32, 558 ms in bfloat16 and 127 ms widening bfloat16 weights to float32 first;
one row takes 3.3 ms in float32, 2.4 ms in bfloat16 and 1.5 ms through the int8 kernel (bfloat16 activations;
7.9 ms with float32 ones). So on such a CPU the model computes in float32 and keeps its weights compact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_DTYPE = torch.bfloat16  # activations of the decode-sized kernels
# Above this many rows (prefill) a matmul on widened weights beats the int8 kernel, which is built for
# matrix-vector products (measured: 28 layers x 210 rows, 553 ms int8 kernel vs 208 ms bf16 + dequant cost).
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


class Int8Linear(CompactLinear):
    """int8 weights with one scale per output row. The decode kernel takes bfloat16 activations (measured
    faster than float32 ones on both CPUs above)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        quantized, scales = quantize_rows(weight.detach())
        self.register_buffer("weight", quantized)
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def small_product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scales.to(dtype)[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8_(model: nn.Module) -> int:
    """Swap the language model's Linear layers and the LM head for Int8Linear. Returns how many were swapped.

    The LM head is tied to the token embeddings; it gets its own int8 copy and the embeddings stay as they are
    (only looked up, one row per token)."""
    language_model = model.model.language_model
    swapped = 0
    for parent in list(language_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
                swapped += 1
    model.lm_head = Int8Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None))
    return swapped + 1


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
        if isinstance(parent, (CompactLinear, Bf16Embedding)):
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

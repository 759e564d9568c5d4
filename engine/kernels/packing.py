"""Float32 and bfloat16 Linear weights packed once, at load, into the layouts their kernels stream: oneDNN's blocked
layout, and for bfloat16's one-row products (decode) fbgemm's float16 copy. Each kernel is probed once per process
on a tiny product, with its own generator, and a CPU that lacks one keeps PyTorch's stock kernels with a one-line
note (packing_unavailable)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..machine import cpu_flags


class quantized_engine:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = self.name

    def __exit__(self, *exc):
        torch.backends.quantized.engine = self.previous


class PackedLinear(nn.Module):
    """A float32 or bfloat16 Linear whose weight oneDNN reorders once, at load, into the blocked layout its
    kernels stream; the plain copy is dropped, so memory stays one copy of the weight. Decode reads every weight
    once per token, and the packed layout reads nearly twice as fast as F.linear's (docs/decisions.md)."""

    def __init__(self, linear: nn.Linear, one_row_fp16: bool = False, rows: int = 1):
        """one_row_fp16: also keep fbgemm's float16 copy of a bfloat16 weight for one-row products (decode).
        rows: the rows of the decode-sized products a float32 weight is laid out for (oneDNN's batch-size hint);
        a product of fewer rows is padded up to them. A decode step of four answers reads a layout for four at
        the rate one answer reads a layout for one (docs/decisions.md, "float32 weights laid out for the batch");
        bfloat16's products measured the same on either layout, so they keep the one-row one."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed_nbytes = weight.numel() * weight.element_size()  # held outside parameters and buffers
        self.rows = rows if weight.dtype == torch.float32 else 1
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self._one_row = fp16_packed(weight, linear.bias) if one_row_fp16 and weight.dtype == torch.bfloat16 else None
        self.read_nbytes = self.packed_nbytes  # what one product reads: one of the copies
        if self._one_row is not None:
            self.packed_nbytes += weight.numel() * 2

    @property
    def one_row_dtype(self) -> torch.dtype | None:
        """What a one-row product computes in best: float32 where it runs on the float16 copy (it takes and gives
        float32; rounding to bfloat16 around it is work for nothing)."""
        return torch.float32 if self._one_row is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._one_row is not None and rows.shape[0] == 1:
            out = torch.ops.quantized.linear_dynamic_fp16(rows.float(), self._one_row)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        count = rows.shape[0]
        if count < self.rows:  # each row's result is the one it gets beside others: the same kernel computes it
            rows = torch.cat([rows, rows.new_zeros(self.rows - count, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._packed, self.bias, "none", [], "")[:count]
        return out.reshape(*x.shape[:-1], self.out_features)

    def unpacked(self) -> torch.Tensor:
        """The weight in nn.Linear's plain (out, in) layout, a copy (for tests and checks)."""
        return self._packed.to_dense().reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        one_row = ", one row on fbgemm float16" if self._one_row is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.dtype}, oneDNN-packed{one_row}"


def fp16_packed(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """fbgemm's packed float16 copy of a bfloat16 weight for one-row products, or None where fbgemm is missing or
    the weight leaves float16's range. float16 holds every bfloat16 value from 2**-14 to 65504 exactly (3 more
    mantissa bits, a narrower exponent); smaller ones round to float16's subnormals, off by at most 2**-25.

    Why: decode reads every weight once per token, and fbgemm's float16 product reads faster than oneDNN's packed
    bfloat16 for one row; from two rows up it is the other way round, so prefill keeps the oneDNN copy and the
    language model's weights are held twice (docs/decisions.md, "bfloat16 decodes on a float16 copy")."""
    if not fp16_products_work() or not bool(weight.abs().max() <= torch.finfo(torch.float16).max):
        return None
    with quantized_engine("fbgemm"):
        return torch.ops.quantized.linear_prepack_fp16(weight.float(), None if bias is None else bias.detach().float())


@functools.cache
def fp16_products_work() -> bool:
    """fbgemm's float16-weight product exists in this build and agrees with F.linear (checked once, tiny)."""
    try:
        with quantized_engine("fbgemm"), torch.inference_mode():
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(48, 64, generator=generator).bfloat16().float()
            x = torch.randn(1, 64, generator=generator)
            packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
            return torch.allclose(torch.ops.quantized.linear_dynamic_fp16(x, packed), F.linear(x, weight),
                                  atol=1e-4, rtol=1e-4)
    except (RuntimeError, AttributeError):
        return False


def keeps_fp16_copy(compute_dtype: str) -> bool:
    """Whether packing gives bfloat16 Linears fbgemm's float16 copy for one-row products (fp16_packed): bfloat16
    compute, oneDNN's packing and fbgemm's float16 product all present."""
    return compute_dtype == "bfloat16" and fp16_products_work() and packing_works(torch.bfloat16)


def packing_unavailable(dtype: torch.dtype) -> str:
    """One line for the sidebar and the log: why `dtype` weights run on PyTorch's stock kernels here."""
    name = str(dtype).removeprefix("torch.")
    if not torch.backends.mkldnn.is_available():
        return f"{name}: this PyTorch build has no oneDNN, so Linear layers run on PyTorch's stock kernels"
    if dtype == torch.bfloat16 and not ({"avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
                                        or "avx_ne_convert" in cpu_flags()):
        return (f"{name}: oneDNN cannot pack bfloat16 weights on this CPU (it needs AVX-512 BW/VL/DQ or "
                "AVX-NE-CONVERT), so Linear layers run on PyTorch's stock kernels")
    return f"{name}: oneDNN's packed Linear disagrees with F.linear here, so Linear layers run on stock kernels"


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """oneDNN's packed product exists in this build and agrees with F.linear (checked once per process, tiny)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        linear = nn.Linear(64, 48)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(48, 64, generator=generator) / 8)
            linear.bias.copy_(torch.randn(48, generator=generator) / 8)
        linear = linear.to(dtype)
        x = torch.randn(3, 64, generator=generator).to(dtype)
        with torch.inference_mode():
            return torch.allclose(PackedLinear(linear)(x).float(), linear(x).float(), atol=0.05, rtol=0.02)
    except (RuntimeError, AttributeError):
        return False


# Most rows a float32 decode layout is made for: a lone answer's products are padded up to them, which costs it a
# little more the more rows there are (docs/decisions.md, "float32 weights laid out for the batch").
MAX_DECODE_ROWS = 4


def wide_layout_pays(flags: frozenset[str] | None = None) -> bool:
    """Whether a float32 layout for several rows costs a lone answer little: with oneDNN's AVX-512 kernels a row
    padded to four takes a few percent more than on the one-row layout; with its AVX2 kernels about 1.6x."""
    return "avx512f" in (flags if flags is not None else cpu_flags())


def decode_rows(max_batch: int, kv_cache: bool = True) -> int:
    """The rows decode-sized products are laid out for: the batch decode runs at, up to MAX_DECODE_ROWS, where that
    layout costs a lone answer little (wide_layout_pays); else one (without a KV cache, decode runs one sequence
    through transformers' forward)."""
    return max(1, min(max_batch, MAX_DECODE_ROWS)) if kv_cache and wide_layout_pays() else 1


def pack_linears_(model: nn.Module, dtype: torch.dtype, one_row_fp16: bool = False, rows: int = 1) -> int:
    """Swap every nn.Linear whose weight is in `dtype` for a PackedLinear. Returns how many were swapped.
    The language model's Linears and the LM head, which decode runs, are laid out for `rows` rows; with
    one_row_fp16 they also keep a float16 copy for decode (fp16_packed). The vision tower's keep the one-row layout.

    The LM head is tied to the token embeddings: it gets its own packed copy and the embeddings stay as they are
    (only looked up, one row per token)."""
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    decoding = {id(module) for module in language_model.modules()} if language_model else set()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == dtype:
                decodes = id(parent) in decoding or (parent is model and name == "lm_head")
                setattr(parent, name, PackedLinear(child, one_row_fp16=one_row_fp16 and decodes,
                                                   rows=rows if decodes else 1))
                swapped += 1
    return swapped


def pack_remaining_linears(model, compute_dtype: str, progress=None, rows: int = 1) -> list[str]:
    """oneDNN-packed kernels for every plain Linear left in `model` (the default kernels), decode's laid out for
    `rows` rows (packing.decode_rows). Returns why not, where this CPU or build cannot pack them: they then run on
    PyTorch's stock kernels."""
    wide = torch.float32 if compute_dtype == "float32" else torch.bfloat16
    if not packing_works(wide):
        return [packing_unavailable(wide)]
    one_row_fp16 = keeps_fp16_copy(compute_dtype)
    if progress is not None:
        progress(0.92, "Packing bfloat16 weights for oneDNN (prefill) and as float16 for fbgemm (decode)"
                 if one_row_fp16 else f"Packing {compute_dtype} weights for oneDNN's kernels")
    pack_linears_(model, wide, one_row_fp16, rows)
    return []  # the plain weights they replace are freed: the caller hands the memory back (release_freed_memory)

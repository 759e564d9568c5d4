"""Decode attention for every sequence of a step in one call: a small C kernel built at first use, else matmuls.

Each sequence of a decode step attends its own keys and values, which are read whole at every step. PyTorch's
batched matmuls (single_query below) read them at about half the rate memory allows at these shapes,
and four answers at once spent a third of their step there. decode_attention.c writes each new key and value and
attends in one pass over each sequence's buffers, for all sequences and heads in one OpenMP loop (docs/decisions.md,
"Decode attention kernel").

The kernel is compiled once per machine with the system's C compiler ($CC, cc or gcc) into the user's cache
folder, for this CPU, or for AVX2 under VLSCOPE_MAX_CPU_ISA=avx2. Its result is checked against the matmuls before
it is used. Without a compiler, or where the check fails, decode attends through the matmuls and the decode note
says why.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from . import native
from ..machine import held_to_avx2

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")


class SequenceKV:
    """One sequence's keys and values in the step's buffers: per layer (kv heads, capacity, head dim), and
    how many positions are filled. Each sequence of a batch has its own, so each attends over its own length."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values, self.length = keys, values, length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0


def single_query(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """grouped (kv heads, groups, d): each key head's query rows; keys and values (kv heads, n, d) -> (kv heads,
    groups, d). The scores are taken as keys times queries, keys first: with two query rows against hundreds of
    keys, that product streams the keys twice as fast as queries times transposed keys (docs/decisions.md,
    "Single-query attention")."""
    scores = torch.bmm(keys, grouped.transpose(1, 2)).mul_(scaling)  # (kv heads, n, groups)
    probs = torch.softmax(scores.transpose(1, 2), dim=-1)
    return torch.bmm(probs, values)

def _load(library: ctypes.CDLL):
    function = library.decode_attention
    function.restype = ctypes.c_int
    int64, address = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [int64, int64, int64, int64, address, address, address, address, address, address, address,
                         ctypes.c_int, ctypes.c_float, address]
    return function

class KernelAttention:
    """The C kernel: `step(kvs)` prepares a decode step's tables, then one call per layer."""

    reads_bfloat16 = True  # widens bfloat16 buffers as it reads them

    def __init__(self, function):
        self._function = function

    def step(self, kvs, kv_heads: int, groups: int, dim: int, scaling: float, written: bool = False):
        """kvs: the step's SequenceKV (room for one more position each). Returns attend(layer, query (B, heads, dim)
        float32, key and value (B, kv heads, dim)) -> (B, kv heads, groups, dim) ((kv heads, groups, dim) for one
        sequence, as the compiled one-row segments were traced), having written the key and value, unless
        `written`: the caller wrote them (sequences that share buffers, each reading what the ones before wrote)."""
        rows = len(kvs)
        keys = torch.tensor([[kv.keys[layer].data_ptr() for kv in kvs] for layer in range(len(kvs[0].keys))],
                            dtype=torch.int64)
        values = torch.tensor([[kv.values[layer].data_ptr() for kv in kvs] for layer in range(len(kvs[0].keys))],
                              dtype=torch.int64)
        capacities = torch.tensor([kv.capacity for kv in kvs], dtype=torch.int64)
        lengths = torch.tensor([kv.length for kv in kvs], dtype=torch.int64)
        row_bytes, function = rows * 8, self._function
        bfloat16 = int(kvs[0].keys[0].dtype == torch.bfloat16)

        # The tables point into the buffers: attend keeps them alive (_buffers) for as long as it can be called.
        def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   _buffers=tuple(kvs)) -> torch.Tensor:
            query = query.contiguous()
            key, value = key.float().contiguous(), value.float().contiguous()
            out = torch.empty((rows, kv_heads, groups, dim))
            fresh = (None, None) if written else (key.data_ptr(), value.data_ptr())
            failed = function(rows, kv_heads, groups, dim, query.data_ptr(), *fresh,
                              keys.data_ptr() + layer * row_bytes, values.data_ptr() + layer * row_bytes,
                              capacities.data_ptr(), lengths.data_ptr(), bfloat16, scaling, out.data_ptr())
            if failed:
                raise MemoryError("decode attention: a sequence had no room for its new token, or no scratch memory")
            return out[0] if rows == 1 else out

        return attend

    def cached(self, grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        """single_query's contract over keys and values that already hold the new token: grouped (b * kv heads,
        groups, d) float32, keys and values (b * kv heads, n, d) float32 or bfloat16 -> (b * kv heads, groups, d)."""
        heads, groups, dim = grouped.shape
        length = keys.shape[1]
        if keys.dtype not in (torch.float32, torch.bfloat16) or values.dtype != keys.dtype:
            keys, values = keys.float(), values.float()
        keys, values = keys.contiguous(), values.contiguous()
        out = torch.empty((heads, groups, dim))
        one = torch.tensor([keys.data_ptr()], dtype=torch.int64), torch.tensor([values.data_ptr()], dtype=torch.int64)
        capacity, filled = torch.tensor([length], dtype=torch.int64), torch.tensor([length - 1], dtype=torch.int64)
        failed = self._function(1, heads, groups, dim, grouped.contiguous().data_ptr(), None, None, one[0].data_ptr(),
                                one[1].data_ptr(), capacity.data_ptr(), filled.data_ptr(),
                                int(keys.dtype == torch.bfloat16), scaling, out.data_ptr())
        if failed:
            raise MemoryError("decode attention: no scratch memory")
        return out

class MatmulAttention:
    """PyTorch's batched matmuls, a sequence at a time (single_query)."""

    reads_bfloat16 = False  # would widen a bfloat16 cache whole at every step: float32 buffers suit it

    def step(self, kvs, kv_heads: int, groups: int, dim: int, scaling: float, written: bool = False):
        """As KernelAttention.step; sequences are taken in order, so each reads what the ones before it wrote."""
        def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            outputs = []
            for row, kv in enumerate(kvs):
                keys, values, position = kv.keys[layer], kv.values[layer], kv.length
                keys[:, position].copy_(key[row])
                values[:, position].copy_(value[row])
                outputs.append(single_query(query[row].view(kv_heads, groups, dim), keys[:, :position + 1].float(),
                                            values[:, :position + 1].float(), scaling))
            return outputs[0] if len(kvs) == 1 else torch.stack(outputs)

        return attend

    @staticmethod
    def cached(grouped, keys, values, scaling):
        return single_query(grouped, keys.float(), values.float(), scaling)

def _agrees(kernel: KernelAttention, dtype: torch.dtype) -> bool:
    """The kernel against the matmuls on a small random case, with a sequence of its own length each."""
    generator = torch.Generator().manual_seed(0)
    kvs = [SequenceKV([torch.randn(2, 48, 64, generator=generator).to(dtype)],
                      [torch.randn(2, 48, 64, generator=generator).to(dtype)], length) for length in (5, 31)]
    copies = [SequenceKV([kv.keys[0].clone()], [kv.values[0].clone()], kv.length) for kv in kvs]
    query, key, value = (torch.randn(2, 4, 64, generator=generator), torch.randn(2, 2, 64, generator=generator),
                         torch.randn(2, 2, 64, generator=generator))
    got = kernel.step(kvs, 2, 2, 64, 0.125)(0, query, key, value)
    want = MatmulAttention().step(copies, 2, 2, 64, 0.125)(0, query, key, value)
    return torch.allclose(got, want, atol=1e-5, rtol=1e-4) and all(
        torch.equal(a.keys[0], b.keys[0]) and torch.equal(a.values[0], b.values[0]) for a, b in zip(kvs, copies))

def choose(compiler: str | None) -> tuple[KernelAttention | MatmulAttention, str]:
    """The kernel built with `compiler` where it builds and agrees with the matmuls, else the matmuls; and a line
    saying which (or why not the kernel)."""
    if not compiler:
        return MatmulAttention(), "attention on PyTorch's matmuls: no C compiler to build vlscope's kernel"
    try:
        kernel = KernelAttention(_load(native.load(SOURCE, compiler)))
        with torch.inference_mode():
            if not all(_agrees(kernel, dtype) for dtype in (torch.float32, torch.bfloat16)):
                return MatmulAttention(), "attention on PyTorch's matmuls: vlscope's kernel disagreed with them here"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("decode attention kernel unavailable: %s", exc)
        return MatmulAttention(), f"attention on PyTorch's matmuls: building vlscope's kernel failed ({exc})"
    return kernel, f"attention on vlscope's kernel ({'AVX2' if held_to_avx2() else 'this CPU'})"

@functools.cache
def best() -> tuple[KernelAttention | MatmulAttention, str]:
    """What decode attends with in this process. One choice for the process: the direct step and transformers'
    forward attend alike, so their logits agree to the bit."""
    return choose(native.compiler())

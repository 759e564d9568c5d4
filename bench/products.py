"""`python -m bench.products`: the compact product kernels at the language model's shapes, against the read ceiling.

Each kernel multiplies 1, 4 and 256 rows by weights of Qwen3-VL-2B's projections, with enough copies of each weight
that they never sit in the caches (decode reads every weight once a token). It reports the time of one product and
the weight bytes it read a second, as a share of this CPU's read ceiling: the best of the reads measured before
each kernel and at the end (a shared host's rate moves by a third within a minute). Kernels:
vlscope's int4 (int4_linear.c) and int8 (fbgemm), PyTorch's 4-bit weight-only product
(`_weight_int4pack_mm_for_cpu`, bfloat16 activations), and torchao's CPU 4-bit configurations where torchao imports
(`pip install torchao`). docs/decisions.md ("Four-bit weights") keeps a run's table.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.kernels.int4 import Int4Linear
from engine.kernels.memory_read import memory_read_gb_per_s
from engine.kernels.quantize import Int8Linear

from .cli import machine_line

SHAPES = {"qkv_proj": (4096, 2048), "o_proj": (2048, 2048), "gate_up_proj": (12288, 2048), "down_proj": (2048, 6144)}
GROUP = 64


class AtenInt4:
    """PyTorch's CPU 4-bit weight-only product: bfloat16 activations, a bfloat16 scale and zero point per group."""

    def __init__(self, weight: torch.Tensor):
        out_features, in_features = weight.shape
        blocks = weight.float().view(out_features, -1, GROUP)
        low, high = blocks.amin(2), blocks.amax(2)
        scale = ((high - low) / 15).clamp(min=1e-8)
        levels = ((blocks - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(out_features, in_features)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)
        # zero point as the kernel reads it: w = (q - 8) * scale + zero
        zero = low + 8 * scale
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=2).contiguous().bfloat16()
        self.nbytes = self.packed.numel() + self.scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), self.packed, GROUP, self.scales_zeros)


class BfloatInput:
    """A torchao-quantized Linear fed bfloat16 rows, as its kernels take them."""

    def __init__(self, linear: torch.nn.Module):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.bfloat16())

    def parameters(self):
        return self.linear.parameters()

    def buffers(self):
        return self.linear.buffers()


def torchao_kernels() -> dict:
    """torchao's CPU 4-bit configurations that build here, by name; none where torchao is missing."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        return {}

    def maker(config):
        def make(weight):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
            linear.weight.data.copy_(weight)
            quantize_(linear, config)
            return BfloatInput(linear)
        return make

    return {
        "torchao int4 weight-only": maker(Int4WeightOnlyConfig(group_size=GROUP)),
        "torchao int8 activations x int4 weights": maker(Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP))),
    }


def kernels() -> dict:
    found = {"vlscope int4": lambda w: Int4Linear(w, None, group=GROUP),
             "vlscope int8 (fbgemm)": lambda w: Int8Linear(w, None),
             "aten _weight_int4pack_mm_for_cpu": AtenInt4}
    return found | torchao_kernels()


def weight_bytes(layer) -> int:
    if hasattr(layer, "nbytes"):
        return layer.nbytes
    if hasattr(layer, "packed_nbytes"):
        return layer.packed_nbytes + layer.scales.numel() * 4
    tensors = list(layer.parameters()) + list(layer.buffers())
    inner = [t for tensor in tensors for t in getattr(tensor, "__tensor_flatten__", lambda: ((), None))()[0]]
    parts = [getattr(tensor, name) for tensor in tensors for name in inner] or tensors
    return sum(part.numel() * part.element_size() for part in parts)


def measure(make, weight: torch.Tensor, rows: list[int], copies: int, repeats: int) -> dict:
    """Seconds of one product per row count (best of `repeats` passes over the copies), the weight's bytes, and the
    relative error of four rows against F.linear (a kernel that computes something else shows here)."""
    layers = [make(torch.roll(weight, shifts=i, dims=1)) for i in range(copies)]
    x = torch.randn(4, weight.shape[1])
    want = F.linear(x, weight)
    result = {"weight_bytes": weight_bytes(layers[0]),
              "error": float((layers[0](x).float() - want).norm() / want.norm())}
    for count in rows:
        x = torch.randn(count, weight.shape[1])
        layers[0](x)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for layer in layers:
                layer(x)
            times.append((time.perf_counter() - started) / len(layers))
        result[count] = min(times)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.products", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 256])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bytes-per-kernel", type=float, default=400e6,
                        help="weight bytes of copies per shape, beyond the caches (default 400 MB)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line())
    ceilings = [memory_read_gb_per_s()]
    lines = ["| kernel | product | weight MB | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms" for r in args.rows)
             + " | one row GB/s | % of read ceiling | relative error |", "|---" * (6 + len(args.rows)) + "|"]
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape_name, shape in SHAPES.items():
            weight = (torch.randn(*shape, generator=generator) / 45).bfloat16().float()
            for name, make in kernels().items():
                ceilings.append(memory_read_gb_per_s())  # the host's rate moves: the ceiling is the run's best
                try:
                    copies = max(2, int(args.bytes_per_kernel // weight_bytes(make(weight))))
                    result = measure(make, weight, args.rows, copies, args.repeats)
                except (RuntimeError, NotImplementedError, ValueError, ImportError, AssertionError) as exc:
                    lines.append(f"| {name} | {shape_name} | failed: {str(exc).splitlines()[0][:80]} |")
                    continue
                rate = result["weight_bytes"] / result[args.rows[0]] / 1e9
                lines.append(f"| {name} | {shape_name} | {result['weight_bytes'] / 1e6:.1f} | "
                             + " | ".join(f"{result[r] * 1e3:.3f}" for r in args.rows)
                             + f" | {rate:.1f} | {{ceiling:{rate}}} | {result['error']:.3f} |")
                print(lines[-1].split(" | {")[0], flush=True)
    ceilings.append(memory_read_gb_per_s())
    ceiling = max(ceilings)
    table = [line if "{ceiling:" not in line else
             line.split("{ceiling:")[0] + f"{100 * float(line.split('{ceiling:')[1].split('}')[0]) / ceiling:.0f}"
             + line.split("{ceiling:")[1].split("}", 1)[1]
             for line in lines]
    print(f"\nread ceiling {ceiling:.1f} GB/s (best of {', '.join(f'{c:.1f}' for c in ceilings)}), "
          f"{args.threads} threads\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which precision suits this CPU: a quick measured probe, read together with the ISA flags.

float32 stays the default setting; this only recommends, and shows its evidence.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from .system import SystemReport, system_report

# Shapes of Qwen3-VL-2B's language model: an MLP projection, a prefill-sized block of rows and one decode token.
# Kept small enough to finish in seconds where bfloat16 is emulated (about 0.5 s per 256-row product there).
HIDDEN, INTERMEDIATE, PREFILL_ROWS = 2048, 6144, 128


@dataclass(frozen=True)
class PrecisionAdvice:
    recommended: str  # "float32" or "bfloat16"
    reasons: tuple[str, ...]
    evidence: dict = field(default_factory=dict)  # measured GFLOP/s and GB/s per dtype


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def probe(dtype: torch.dtype, layers: int = 4) -> dict:
    """Prefill-like matmul throughput, and decode-like weight streaming over more weights than the caches hold."""
    weights = [torch.randn(INTERMEDIATE, HIDDEN).to(dtype) for _ in range(layers)]
    rows = torch.randn(PREFILL_ROWS, HIDDEN).to(dtype)
    vector = torch.randn(1, HIDDEN).to(dtype)
    with torch.inference_mode():
        prefill_s = _best_seconds(lambda: [rows @ w.t() for w in weights], 3)
        decode_s = _best_seconds(lambda: [vector @ w.t() for w in weights], 5)
    return {
        "prefill_gflops": 2 * PREFILL_ROWS * HIDDEN * INTERMEDIATE * layers / prefill_s / 1e9,
        "decode_weight_gb_per_s": layers * HIDDEN * INTERMEDIATE * weights[0].element_size() / decode_s / 1e9,
        "decode_ms_per_layer": decode_s / layers * 1000,
    }


def advise(report: SystemReport | None = None) -> PrecisionAdvice:
    report = report or system_report()
    fp32, bf16 = probe(torch.float32), probe(torch.bfloat16)
    native = bool({"amx_bf16", "avx512_bf16"} & set(report.isa_flags))
    prefill_gain = bf16["prefill_gflops"] / fp32["prefill_gflops"]
    decode_gain = fp32["decode_ms_per_layer"] / bf16["decode_ms_per_layer"]
    reasons = [
        f"bfloat16 matmul measured {prefill_gain:.1f}x float32's rate on prefill-sized products "
        f"({bf16['prefill_gflops']:.0f} vs {fp32['prefill_gflops']:.0f} GFLOP/s)",
        f"one decode step of a layer took {decode_gain:.1f}x less time in bfloat16 "
        f"({bf16['decode_ms_per_layer']:.2f} vs {fp32['decode_ms_per_layer']:.2f} ms)",
        "the CPU has native bfloat16 instructions" if native else "the CPU has no native bfloat16 instructions",
    ]
    compute = "bfloat16" if bfloat16_matmul_is_faster(torch.get_num_threads()) else "float32"
    reasons.append(f"bfloat16 or int8 weights would compute in {compute} here (compute_dtype=auto)"
                   + ("" if compute == "bfloat16" else ": compact weights for decode, float32 matmul for prefill"))
    recommended = "bfloat16" if prefill_gain > 1.2 and decode_gain > 1.2 else "float32"
    if recommended == "bfloat16":
        reasons.append("bfloat16 rounds weights to 8 bits of mantissa: check the benchmark's drift figures "
                       "(and OCR accuracy with real weights) before switching.")
    return PrecisionAdvice(recommended, tuple(reasons), {"float32": fp32, "bfloat16": bf16, "native_bf16": native,
                                                         "compact_weights_compute": compute})


@functools.cache
def bfloat16_matmul_is_faster(threads: int) -> bool:
    """A prefill-sized product in each dtype, timed now (well under a second even where bfloat16 is emulated).
    Cached per thread count: the answer is a property of the CPU, asked at every model load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, weight = torch.randn(PREFILL_ROWS, HIDDEN), torch.randn(HIDDEN, HIDDEN)  # nn.Linear's layout
        with torch.inference_mode():
            fp32 = _best_seconds(lambda: torch.nn.functional.linear(rows, weight), 3)
            rows, weight = rows.bfloat16(), weight.bfloat16()
            bf16 = _best_seconds(lambda: torch.nn.functional.linear(rows, weight), 3)
    finally:
        torch.set_num_threads(previous)
    return bf16 < fp32

"""Which precision suits this CPU: a quick measured probe, read together with the ISA flags.

float32 stays the default setting; this only recommends, and shows its evidence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.compute import runs_on_compute_thread
from engine.machine import (HIDDEN, INTERMEDIATE, PREFILL_ROWS, SystemReport, best_seconds, bfloat16_matmul_is_faster,
                            system_report)

from .record import REFRESH


@dataclass(frozen=True)
class PrecisionAdvice:
    recommended: str  # "float32" or "bfloat16"
    reasons: tuple[str, ...]
    evidence: dict = field(default_factory=dict)  # measured GFLOP/s and GB/s per dtype


def probe(dtype: torch.dtype, layers: int = 4) -> dict:
    """Prefill-like matmul throughput, and decode-like weight streaming over more weights than the caches hold."""
    weights = [torch.randn(INTERMEDIATE, HIDDEN).to(dtype) for _ in range(layers)]
    rows = torch.randn(PREFILL_ROWS, HIDDEN).to(dtype)
    vector = torch.randn(1, HIDDEN).to(dtype)
    with torch.inference_mode():
        prefill_s = best_seconds(lambda: [rows @ w.t() for w in weights], 3)
        decode_s = best_seconds(lambda: [vector @ w.t() for w in weights], 5)
    return {
        "prefill_gflops": 2 * PREFILL_ROWS * HIDDEN * INTERMEDIATE * layers / prefill_s / 1e9,
        "decode_weight_gb_per_s": layers * HIDDEN * INTERMEDIATE * weights[0].element_size() / decode_s / 1e9,
        "decode_ms_per_layer": decode_s / layers * 1000,
    }


@runs_on_compute_thread
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
    reasons.append(f"bfloat16, int8 or int4 weights would compute in {compute} here (compute_dtype=auto)"
                   + ("" if compute == "bfloat16" else ": compact weights for decode, float32 matmul for prefill"))
    recommended = "bfloat16" if prefill_gain > 1.2 and decode_gain > 1.2 else "float32"
    if recommended == "bfloat16":
        reasons.append("bfloat16 rounds weights to 8 bits of mantissa: check the benchmark's drift figures "
                       "(and OCR accuracy with real weights) before switching.")
    return PrecisionAdvice(recommended, tuple(reasons), {"float32": fp32, "bfloat16": bf16, "native_bf16": native,
                                                         "compact_weights_compute": compute})


# Top-1 agreement with float32 a compact precision must keep to be recommended: what int8 keeps on a VNNI CPU.
MIN_TOP1_AGREEMENT = 0.95


def recommend(cases: list[dict], drift: dict, probe: PrecisionAdvice | None = None) -> PrecisionAdvice:
    """The precision to serve with, from what this CPU measured: each precision's end-to-end time on the standard
    request (the bench's "tuned <dtype>" cases) and its drift against float32. The fastest whose top-1 agreement
    with float32 is at least MIN_TOP1_AGREEMENT wins; float32 is the reference and always qualifies."""
    measured = {}
    for case in cases:
        spec, summary = case["case"], case["summary"]
        if case["case"].get("group") == "precision" and (summary.get("e2e_s") or {}).get("median"):
            measured[spec["dtype"]] = (summary["e2e_s"]["median"], summary.get("rss_peak_bytes"),
                                       summary.get("compute_dtype"))
    reasons, eligible = [], []
    for dtype, (e2e, rss, compute) in sorted(measured.items(), key=lambda item: item[1][0]):
        top1 = 1.0 if dtype == "float32" else (drift.get(dtype) or {}).get("top1_agreement")
        line = f"{dtype}: {e2e:.1f} s end to end"
        if rss:
            line += f", peak RSS {rss / 1e9:.1f} GB"
        if dtype != "float32":
            line += (f", top-1 agreement with float32 {top1:.1%}" if top1 is not None else ", drift not measured")
        if dtype == "bfloat16" and compute == "float32":
            line += " (computes in float32 on this CPU: it saves memory, not time)"
        reasons.append(line)
        if top1 is not None and top1 >= MIN_TOP1_AGREEMENT:
            eligible.append(dtype)
    if not eligible:
        return PrecisionAdvice("float32", ("no precision was measured end to end here: float32 stays",)
                               + (probe.reasons if probe else ()), probe.evidence if probe else {})
    recommended = eligible[0]
    reasons.insert(0, f"{recommended} is the fastest end to end here among precisions within "
                      f"{MIN_TOP1_AGREEMENT:.0%} top-1 agreement of float32")
    if recommended != "float32":
        reasons.append("drift is measured on this model's weights: with real weights, check answers (OCR "
                       "especially) before switching; the default stays float32")
    evidence = {"end_to_end_s": {dtype: values[0] for dtype, values in measured.items()},
                "top1_agreement": {dtype: (drift.get(dtype) or {}).get("top1_agreement") for dtype in measured}}
    if probe is not None:
        evidence["probe"] = probe.evidence
        reasons += [f"probe: {reason}" for reason in probe.reasons]
    return PrecisionAdvice(recommended, tuple(reasons), evidence)


def drift_measured_on(document: dict) -> str:
    """What a benchmark document's drift was measured on, in words (bench/harness.py's drift case)."""
    picture = "a 256x256 picture (64 vision tokens), 8 answer tokens" if document.get("quick") else \
        "a 448x448 picture, 32 answer tokens"
    return picture + (", synthetic weights" if document.get("synthetic") else "")


def agreement_line(document: dict | None, dtype: str = "int4", same_cpu: bool = True) -> str:
    """One line: how often `dtype`'s weights pick float32's token, from a benchmark document's drift, with what it
    was measured on, or how to measure it. One figure for every page that shows it."""
    if dtype == "float32":
        return "float32 is the reference: the other precisions' agreement is measured against its tokens."
    drift = ((document or {}).get("drift_vs_float32") or {}).get(dtype) or {}
    if drift.get("top1_agreement") is None:
        return (f"What {dtype} costs in agreement with float32 is not measured here yet: `{REFRESH}` measures each "
                "precision's top-1 agreement with float32.")
    where = "a CPU of this kind" if same_cpu else "a CPU of another kind"
    positions = f" at {drift['positions']} positions" if drift.get("positions") else ""
    return (f"{dtype} picks float32's token {drift['top1_agreement']:.1%} of the time{positions} "
            f"({drift_measured_on(document)}; benchmark of {str(document.get('created', ''))[:10]} on {where}).")

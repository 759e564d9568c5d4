"""What an engine runs with (model, precision, threads, weights, how it decodes): shown beside every figure and copied
into every record of its requests."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    model: str
    synthetic: bool
    dtype: str
    threads: int
    weight_bytes: int
    load_seconds: float
    context_length: int
    compute_dtype: str | None = "float32"  # activations and KV cache (bfloat16 and int8 weights vary); None: unknown
    kv_cache: bool = True
    decode_weight_bytes: int = 0  # weights one decode step reads (language model and head); 0 when unknown
    decode: str = ""  # how decode steps run (compiled or eager) and why, with the load-time measurement
    notes: tuple[str, ...] = ()  # kernels this CPU cannot serve and what runs instead, one line each
    read_ceiling_gb_per_s: float | None = None  # memory read rate measured at load on the compute thread

"""What a benchmark sweep runs: its cases, in the order that loads each model once."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import DTYPES

PROMPT = "Describe this image."
FOLLOW_UPS = ("What colours stand out?", "Is there any text in it?")
IMAGE_SIZES = {"448x448": (448, 448), "1280x960": (1280, 960), "1920x1080": (1920, 1080), "4000x3000": (4000, 3000)}


@dataclass(frozen=True)
class Case:
    """One benchmarked situation: engine settings, image, answer length, turns."""

    name: str
    group: str  # precision, baseline, threads, image_size, kv_cache, multi_turn
    dtype: str = "float32"
    threads: int | None = None
    kv_cache: bool = True
    image: str = "448x448"
    max_new_tokens: int = 128
    turns: int = 1
    baseline: bool = False  # plain transformers generate instead of the engine
    remote_url: str = ""  # another OpenAI-compatible server, measured through the remote engine (--against)

    def engine_key(self) -> tuple:
        return (self.dtype, self.threads, self.kv_cache)


def plan(quick: bool, cores: int) -> list[Case]:
    """The cases, in report order. Quick: precisions, the float32 baseline, and a short multi-turn case in each
    precision (a follow-up's time to first token is a target in every one; each runs on the engine its precision
    case already loaded, so it adds seconds, not a load)."""
    tokens = 32 if quick else 128
    precisions = DTYPES
    cases = [Case(f"tuned {d}", "precision", dtype=d, max_new_tokens=tokens) for d in precisions]
    cases += [Case(f"baseline {d}", "baseline", dtype=d, max_new_tokens=tokens, baseline=True)
              for d in (("float32",) if quick else ("float32", "bfloat16"))]
    cases += [Case(f"multi-turn {d}", "multi_turn", dtype=d, max_new_tokens=16 if quick else 64, turns=3)
              for d in precisions]
    if quick:
        return cases
    cases += [Case(f"threads {n}", "threads", threads=n, max_new_tokens=tokens) for n in range(1, cores + 1)
              if n != cores]
    cases += [Case(f"image {name} {d}", "image_size", dtype=d, image=name, max_new_tokens=32)
              for d in ("float32", "bfloat16") for name in IMAGE_SIZES if name != "448x448"]
    cases += [Case(f"no KV cache {d}", "kv_cache", dtype=d, kv_cache=False, max_new_tokens=8) for d in ("float32", "bfloat16")]
    return cases


def execution_order(cases: list[Case]) -> list[Case]:
    """Cases that share engine settings run back to back, so each model is loaded (and warmed up) once."""
    first_seen: dict[tuple, int] = {}
    for index, case in enumerate(cases):
        first_seen.setdefault((case.baseline, case.engine_key()), index)
    return sorted(cases, key=lambda c: first_seen[(c.baseline, c.engine_key())])


APP_SWEEP = (
    Case("448x448", "image_size", max_new_tokens=16),
    Case("1280x960", "image_size", image="1280x960", max_new_tokens=16),
    Case("multi-turn", "multi_turn", max_new_tokens=16, turns=3),
)

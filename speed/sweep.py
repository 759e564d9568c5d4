"""A sweep of this server's speed on an engine already loaded (the Benchmark page's, and each case of
`python -m bench`): the machine's ceilings, the measured runs of each case, and their summary against the ceilings."""
from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from engine.client import Engine
from engine.config import PROJECT_DIR
from engine.core import compute
from engine.kernels.memory_read import memory_read_gb_per_s
from engine.kernels.quantize import LINEAR_KINDS
from engine.machine import system_report
from engine.request import ChatRequest, Turn

from .plan import APP_SWEEP, FOLLOW_UPS, IMAGE_SIZES, PROMPT, Case
from .record import code_commit

Report = Callable[[float, str], None]
SAMPLES_DIR = PROJECT_DIR / "samples"
_CONVERSATIONS = itertools.count(1)


@dataclass
class CaseResult:
    case: Case
    runs: list[dict] = field(default_factory=list)  # one metrics record per measured repetition (or turn)
    load_s: float | None = None
    summary: dict = field(default_factory=dict)
    remote_runs: list[dict] = field(default_factory=list)  # the compared server's runs, interleaved with these

    def to_dict(self) -> dict:
        return {"case": dataclasses.asdict(self.case), "summary": self.summary, "runs": self.runs}


@dataclass
class BenchResult:
    """One sweep, as bench.json keeps it and the reports and the Benchmark page read it."""

    model: str
    synthetic: bool
    quick: bool
    repeats: int
    machine: dict
    precision_advice: dict
    ceilings: dict
    drift_vs_float32: dict
    cases: list[CaseResult]
    against: dict | None = None  # the compared server's URL and model (--against)
    prompt: str = PROMPT
    created: str = field(default_factory=lambda: dt.datetime.now().isoformat(timespec="seconds"))
    code: str | None = field(default_factory=code_commit)  # the commit measured

    def to_dict(self) -> dict:
        document = dataclasses.asdict(self) | {"cases": [result.to_dict() for result in self.cases]}
        return document


# ---- the machine's ceilings ------------------------------------------------------------------------------------

@compute.runs_on_compute_thread
def measure_ceilings(threads: int) -> dict:
    """Memory bandwidth (read of a tensor much larger than the caches) and matmul rates at model-like shapes."""
    torch.set_num_threads(threads)
    bandwidth = memory_read_gb_per_s()
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # The weight laid out as nn.Linear keeps it, (out, in): the other layout can take a path 60x slower
        # in bfloat16 on CPUs without native support, which would say nothing about the model.
        rows, weight = torch.randn(256, 2048).to(dtype), torch.randn(6144, 2048).to(dtype)
        seconds = min(_timed(lambda: torch.nn.functional.linear(rows, weight)) for _ in range(5))
        rates[name] = 2 * 256 * 2048 * 6144 / seconds / 1e9
    return {"memory_read_gb_per_s": bandwidth, "matmul_gflops": rates}


def best_ceilings(first: dict, second: dict) -> dict:
    return {
        "memory_read_gb_per_s": max(first["memory_read_gb_per_s"], second["memory_read_gb_per_s"]),
        "matmul_gflops": {k: max(first["matmul_gflops"][k], second["matmul_gflops"][k]) for k in first["matmul_gflops"]},
        "measurements": [first, second],
    }


def with_decode_reads(ceilings: dict, results: list, lm_facts: dict) -> dict:
    """The read ceiling is at least what any decode in the run read: a shared host's streaming reads can come out
    below a decode's (it then showed above 100% of them). Names the case when a decode set it. A drafted decode's
    tokens are not a read each (model/draft.py): it sets nothing."""
    best, source = ceilings["memory_read_gb_per_s"], None
    for result in results:
        bytes_ = lm_facts.get(result.case.dtype, (None, None))[0]
        rates = [run.get("decode_tokens_per_s") for run in result.runs
                 if run.get("decode_tokens_per_s") and not run.get("drafted_tokens")]
        if bytes_ and rates and max(rates) * bytes_ / 1e9 > best:
            best, source = max(rates) * bytes_ / 1e9, result.case.name
    return ceilings | {"memory_read_gb_per_s": best, "memory_read_set_by": source} if source else ceilings


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def language_model_params(model) -> int:
    modules = list(model.model.language_model.modules()) + [model.lm_head]
    return sum(m.in_features * m.out_features for m in modules if isinstance(m, LINEAR_KINDS))


# ---- workloads -------------------------------------------------------------------------------------------------

def bench_image(size_name: str, images_dir: Path) -> Image.Image:
    """A real photo at the benchmark size (the 4000x3000 case is a photo-sized upscale, as phones produce)."""
    source = images_dir / "astronaut.png"
    if not source.exists():
        source = images_dir / "coffee.png"
    photo = Image.open(source).convert("RGB")
    return photo.resize(IMAGE_SIZES[size_name], Image.BICUBIC)


def within_budget(run_once: Callable[[], None], repeats: int, budget_s: float | None) -> None:
    """`repeats` calls of run_once; with a budget, another starts only if one more of the last's length still fits
    in it (at least one always runs)."""
    spent = last = 0.0
    for repetition in range(repeats):
        if repetition and budget_s is not None and spent + last > budget_s:
            return
        started = time.perf_counter()
        run_once()
        last = time.perf_counter() - started
        spent += last


def run_engine_case(engine: Engine, case: Case, image: Image.Image, repeats: int,
                    budget_s: float | None = None) -> list[dict]:
    """`repeats` measured runs of the case; with a budget, another run starts only if one more of the last's
    length still fits in it (at least one always runs)."""
    records = []

    def conversation() -> None:
        # One pixel differs per conversation: the picture's hash then differs too, so follow-ups can reuse
        # only their own conversation's cache, never a longer one an earlier repetition or case left.
        picture = image.copy()
        serial = next(_CONVERSATIONS)
        picture.putpixel((0, 0), (serial & 255, (serial >> 8) & 255, (serial >> 16) & 255))
        history: list[Turn] = []
        prompts = (PROMPT,) + FOLLOW_UPS[: case.turns - 1]
        for turn, prompt in enumerate(prompts):
            images = (picture,) if turn == 0 else ()
            # Every repetition starts cold; only a conversation's own follow-ups reuse its cache.
            answer = engine.ask(ChatRequest(prompt=prompt, images=images, history=tuple(history),
                                            max_new_tokens=case.max_new_tokens, source="bench", reuse_cache=turn > 0,
                                            ignore_eos=True))
            record = answer.metrics.to_dict()
            record["turn"] = turn + 1
            records.append(record)
            history += [Turn("user", prompt, images), Turn("assistant", answer.text)]

    within_budget(conversation, repeats, budget_s)
    return records


def run_interleaved(engine: Engine, other, case: Case, image: Image.Image, repeats: int,
                    budget_s: float | None = None) -> tuple[list[dict], list[dict]]:
    """The same request on vlscope and on another server in turn, A B A B, so both see the same moments of a
    machine whose speed drifts; returns each side's records."""
    ours: list[dict] = []
    theirs: list[dict] = []

    def pair() -> None:
        ours.extend(run_engine_case(engine, case, image, 1))
        theirs.extend(run_engine_case(other, case, image, 1))

    within_budget(pair, repeats, budget_s)
    return ours, theirs


@compute.runs_on_compute_thread
# ---- the sweep -------------------------------------------------------------------------------------------------

def summarize(result: CaseResult, ceilings: dict, lm_bytes: int | None, lm_params: int | None) -> dict:
    runs = result.runs
    first_turns = [r for r in runs if r.get("turn", 1) == 1]

    def stat(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        return {"median": float(statistics.median(values)), "p95": float(np.percentile(values, 95))}

    summary = {
        "ttft_s": stat([r["ttft_s"] for r in first_turns]),
        "decode_tokens_per_s": stat([r["decode_tokens_per_s"] for r in runs]),
        "e2e_s": stat([r["e2e_s"] for r in first_turns]),
        "rss_peak_bytes": max(r["rss_peak_bytes"] for r in runs),
        "vision_tokens": first_turns[0]["vision_tokens"],
        "prompt_tokens": first_turns[0]["prompt_tokens"],
        "output_tokens": first_turns[0]["output_tokens"],
        "stages": {name: stat([r["stages"].get(name) for r in first_turns])
                   for name in sorted({k for r in first_turns for k in r["stages"]})},
        "load_s": result.load_s,
        "repetitions": len(first_turns),
        "compute_dtype": first_turns[0].get("compute_dtype") or ("float32" if result.case.dtype == "float32"
                                                                 else "bfloat16"),
    }
    if any(r.get("drafted_tokens") for r in runs):
        summary["drafts"] = {"drafted": sum(r.get("drafted_tokens", 0) for r in runs),
                             "kept": sum(r.get("drafts_kept", 0) for r in runs)}
    if result.case.turns > 1:
        summary["follow_up_ttft_s"] = stat([r["ttft_s"] for r in runs if r.get("turn", 1) > 1])
    rate = summary["decode_tokens_per_s"]
    if lm_bytes and rate:
        ceiling = ceilings["memory_read_gb_per_s"] * 1e9 / lm_bytes
        summary["decode_ceiling_tokens_per_s"] = ceiling
        summary["decode_fraction_of_bandwidth_ceiling"] = rate["median"] / ceiling
    prefill = summary["stages"].get("prefill")
    if lm_params and prefill and result.case.kv_cache:
        flops = 2 * lm_params * (summary["prompt_tokens"] - first_turns[0].get("cached_prompt_tokens", 0))
        achieved = flops / prefill["median"] / 1e9
        summary["prefill_gflops"] = achieved
        summary["prefill_fraction_of_compute_ceiling"] = achieved / ceilings["matmul_gflops"][summary["compute_dtype"]]
    return summary


def sweep_on_engine(engine: Engine, images_dir: Path, report: Report, cases=APP_SWEEP,
                    repeats: int = 1) -> BenchResult:
    """A small sweep on an already loaded engine (the app's): no second model in memory, same report format."""
    machine = system_report()
    report(0.0, "measuring the machine's ceilings")
    ceilings = measure_ceilings(engine.config.threads)
    lm_bytes, lm_params = engine.loaded.decode_weight_bytes, language_model_params(engine.loaded.model)
    results = []
    for index, template in enumerate(cases):
        case = dataclasses.replace(template, dtype=engine.config.dtype, threads=engine.config.threads,
                                   kv_cache=engine.config.kv_cache)
        report((index + 0.5) / (len(cases) + 1), f"running {case.name}")
        results.append(CaseResult(case, run_engine_case(engine, case, bench_image(case.image, images_dir), repeats),
                                  engine.info.load_seconds))
    ceilings = with_decode_reads(ceilings, results, {engine.config.dtype: (lm_bytes, lm_params)})
    for result in results:
        result.summary = summarize(result, ceilings, lm_bytes, lm_params)
    report(1.0, "done")
    return BenchResult(engine.info.model, engine.info.synthetic, True, repeats, machine_facts(machine),
                       {"recommended": "–", "reasons": ["not measured in the app sweep"]}, ceilings, {}, results)


def machine_facts(machine) -> dict:
    return dataclasses.asdict(machine) | {"cpu_kind": machine.cpu_kind, "advice": machine.advice}

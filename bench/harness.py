"""`python -m bench`: what a request costs on this CPU, per precision, thread count, image size and path.

Runs the cases bench/plan.py lays out; bench/report.py turns the result into tables and a figure. Every figure is
measured in the run: the machine's ceilings (memory bandwidth, matmul rate), vlscope's tuned path, a plain
transformers baseline, and the numerical drift of each precision against float32. Warm-up runs are excluded; each
case is repeated and reported as median and p95. Output: JSON, a markdown table, a plotly HTML.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image

from engine.core import compute
from engine.config import DTYPES, PROJECT_DIR, SKELETON_DIR, EngineConfig
from engine.environment import shared_dir
from engine.client import Engine
from engine.inputs.limits import fit_to_budget
from engine.records.metrics import PeakRss
from engine.model.loading import has_weights, load_model
from engine.inputs.preprocess import single_image_inputs
from engine.kernels.quantize import LINEAR_KINDS
from engine.request import ChatRequest, Turn
from engine.kernels.memory_read import memory_read_gb_per_s
from engine.machine import cpu_kind, system_report

from .advisor import advise, recommend
from .plan import APP_SWEEP, FOLLOW_UPS, IMAGE_SIZES, PROMPT, Case, execution_order, plan
from .provenance import code_commit
from .report import html_report, markdown_report

Report = Callable[[float, str], None]
# Seconds of measured runs a quick case may take: a second repetition only where one run is well under a
# minute, so the quick sweep stays under 10 minutes on a slow CPU and keeps its repetitions on a fast one.
QUICK_CASE_BUDGET_S = 60.0
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
    below a decode's (it then showed above 100% of them). Names the case when a decode set it."""
    best, source = ceilings["memory_read_gb_per_s"], None
    for result in results:
        bytes_ = lm_facts.get(result.case.dtype, (None, None))[0]
        rates = [run.get("decode_tokens_per_s") for run in result.runs if run.get("decode_tokens_per_s")]
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
def run_baseline_case(model_source: str, case: Case, image: Image.Image, threads: int) -> tuple[float, list[dict]]:
    """What a first deployment does: load, the processor's default image budget, model.generate, no warm-up."""
    # compute_dtype pinned to the weights' dtype: a plain from_pretrained in that dtype, none of vlscope's choices.
    config = EngineConfig(model=model_source, dtype=case.dtype, threads=threads, warmup=False,
                          compute_dtype="float32" if case.dtype == "float32" else "bfloat16")
    with PeakRss() as rss:
        started = time.perf_counter()
        loaded = load_model(config)
        load_s = time.perf_counter() - started
        size = loaded.image_processor.size
        resized = fit_to_budget(*image.size, size["shortest_edge"], size["longest_edge"])
        request_started = time.perf_counter()
        prompt, patches = single_image_inputs(loaded, image, resized, PROMPT)
        token_times: list[float] = []
        output = greedy_generate(loaded, prompt, patches, case.max_new_tokens, token_times, case.kv_cache)
        finished = time.perf_counter()
    generated = output.shape[1] - prompt.input_ids.shape[1]
    new_token_times = token_times[1:]
    ttft = new_token_times[0] - request_started if new_token_times else None
    decode_s = new_token_times[-1] - new_token_times[0] if len(new_token_times) > 1 else None
    record = {
        "status": "ok", "synthetic": loaded.synthetic, "dtype": case.dtype, "compute_dtype": loaded.compute_dtype,
        "threads": threads,
        "vision_tokens": int(prompt.mm_token_type_ids.sum()), "prompt_tokens": prompt.input_ids.shape[1],
        "output_tokens": generated, "ttft_s": ttft, "e2e_s": finished - request_started,
        "decode_tokens_per_s": (len(new_token_times) - 1) / decode_s if decode_s else None,
        "rss_before_bytes": rss.before, "rss_peak_bytes": rss.peak, "rss_after_bytes": rss.after,
        "weight_bytes": loaded.weight_bytes, "stages": {}, "turn": 1,
    }
    del loaded, output
    gc.collect()
    return load_s, [record]


def greedy_generate(loaded, prompt, patches, new_tokens: int, token_times: list[float] | None = None,
                    use_cache: bool = True) -> torch.Tensor:
    """transformers' own greedy generate of exactly `new_tokens`: the baseline's answer, and the answer the drift
    is read on. With `token_times`, the time each new token came out is appended to it."""
    from transformers import TextStreamer

    class Clock(TextStreamer):
        def put(self, value):  # the first call carries the prompt, later ones one new token each
            token_times.append(time.perf_counter())

        def end(self):
            pass

    with torch.inference_mode():
        return loaded.model.generate(
            input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
            mm_token_type_ids=prompt.mm_token_type_ids, pixel_values=patches.pixel_values,
            image_grid_thw=patches.image_grid_thw, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, use_cache=use_cache,
            streamer=Clock(loaded.tokenizer) if token_times is not None else None)


# ---- drift of each precision against float32 ------------------------------------------------------------------

@compute.runs_on_compute_thread
def measure_drift(model_source: str, image: Image.Image, dtypes: list[str], new_tokens: int, threads: int,
                  report: Report) -> dict:
    """Teacher-forced on float32's own greedy answer: how often each precision picks float32's top token, and
    the largest logit difference, over the prompt's text positions and the generated ones."""
    sequences: dict = {}
    reference_logits = None
    results = {}
    for dtype in ["float32"] + [d for d in dtypes if d != "float32"]:
        report(0, f"drift: {dtype}")
        loaded = load_model(EngineConfig(model=model_source, dtype=dtype, threads=threads, warmup=False))
        resized = fit_to_budget(*image.size, 64 * 1024, 1024 * 1024)
        prompt, patches = single_image_inputs(loaded, image, resized, PROMPT)
        if "tokens" not in sequences:
            sequences["tokens"] = greedy_generate(loaded, prompt, patches, new_tokens)
        with torch.inference_mode():
            tokens = sequences["tokens"]
            types = torch.zeros_like(tokens, dtype=torch.int32)
            types[:, : prompt.input_ids.shape[1]] = prompt.mm_token_type_ids
            hidden = loaded.model.model(input_ids=tokens, mm_token_type_ids=types, pixel_values=patches.pixel_values,
                                        image_grid_thw=patches.image_grid_thw, use_cache=False).last_hidden_state
            text_positions = (types[0] == 0).nonzero().view(-1)[:-1]  # predictions made at text positions
            logits = loaded.model.lm_head(hidden[0, text_positions].contiguous()).float()
        if reference_logits is None:
            reference_logits = logits
        else:
            top1 = (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()
            results[dtype] = {"top1_agreement": top1,
                              "max_abs_logit_error": (logits - reference_logits).abs().max().item(),
                              "positions": int(logits.shape[0])}
        del loaded
        gc.collect()
    return results


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
    return BenchResult(engine.info.model, engine.info.synthetic, True, repeats, _machine_facts(machine),
                       {"recommended": "–", "reasons": ["not measured in the app sweep"]}, ceilings, {}, results)


def _machine_facts(machine) -> dict:
    return dataclasses.asdict(machine) | {"cpu_kind": machine.cpu_kind, "advice": machine.advice}


def _release(engines: dict) -> None:
    """Close every engine held, so one model at a time sits in memory."""
    for key in list(engines):
        engines.pop(key).close()
    gc.collect()


def _connect(url: str, db_path: str):
    from engine.remote import RemoteEngine

    return RemoteEngine(EngineConfig(remote_url=url, db_path=db_path, max_queue=1))


def _run_case(case: Case, model: str, images_dir: Path, threads: int, repeats: int, db_path: str,
              engines: dict, lm_facts: dict, budget_s: float | None = None, remote=None) -> CaseResult:
    """One case; engines are reused across cases with the same settings (a function, so no local outlives it).
    With `remote`, a precision case runs interleaved with the same request on that server (kept in remote_runs)."""
    image = bench_image(case.image, images_dir)
    if case.baseline:
        _release(engines)
        load_s, runs = run_baseline_case(model, case, image, threads)
        return CaseResult(case, runs, load_s)
    if case.engine_key() not in engines:
        _release(engines)
        config = EngineConfig(model=model, dtype=case.dtype, threads=threads, kv_cache=case.kv_cache,
                              db_path=db_path, max_queue=1, compile=EngineConfig.from_env().compile)
        engines[case.engine_key()] = Engine(config)
        loaded = engines[case.engine_key()].loaded
        lm_facts[case.dtype] = (loaded.decode_weight_bytes, language_model_params(loaded.model))
    engine = engines[case.engine_key()]
    if remote is not None and case.group == "precision":
        ours, theirs = run_interleaved(engine, remote, case, image, repeats, budget_s)
        return CaseResult(case, ours, engine.info.load_seconds, remote_runs=theirs)
    return CaseResult(case, run_engine_case(engine, case, image, repeats, budget_s), engine.info.load_seconds)


def default_images_dir() -> Path:
    """The shared folder of real photos and scans beside the project, else the bundled samples."""
    shared = shared_dir() / "images"
    return shared if shared.is_dir() else PROJECT_DIR / "samples"


RECORDS = Path("docs") / "bench"  # one record per CPU kind: docs/bench/<kind>/bench.json
LOCAL_RUNS = Path("bench-results")  # this server's own runs, one folder each


def record_dir(kind: str, project_dir: Path = PROJECT_DIR) -> Path:
    """Where `python -m bench --record` writes the record of CPUs of this kind."""
    return project_dir / RECORDS / kind


def measured_kind(document: dict) -> str:
    machine = document.get("machine") or {}
    return machine.get("cpu_kind") or cpu_kind(machine.get("isa_flags", ()))


@dataclass(frozen=True)
class Reference:
    """The benchmark a page shows: its file, the CPU kind it was measured on, and whether this CPU is of that kind."""

    path: Path
    kind: str
    same_kind: bool


def reference_result(project_dir: Path = PROJECT_DIR) -> Reference | None:
    """The newest run from a CPU of this one's kind, this server's own (bench-results/) or the record
    (docs/bench/<kind>/); else the newest record of another kind."""
    here = system_report().cpu_kind
    found = []
    for path in [*(project_dir / LOCAL_RUNS).glob("*/bench.json"), *(project_dir / RECORDS).glob("*/bench.json")]:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        kind = measured_kind(document)
        found.append((kind == here, document.get("created", ""), str(path), kind))
    if not found:
        return None
    same_kind, _, path, kind = max(found)
    return Reference(Path(path), kind, same_kind)


def default_model() -> str:
    """Real weights when the configured model has them, else the bundled synthetic skeleton."""
    configured = EngineConfig.from_env().model
    if Path(configured).is_dir() and has_weights(Path(configured)):
        return configured
    return str(SKELETON_DIR)


def run_bench(model: str, quick: bool, repeats: int, images_dir: Path, out_dir: Path, db_path: str,
              report: Report, drift: bool = True, against: str | None = None, html: bool = True) -> BenchResult:
    machine = system_report()
    threads = machine.physical_cores
    remote = _connect(against, db_path) if against else None  # before any measuring: a wrong URL fails at once
    report(0.0, "measuring the machine's ceilings and which precision suits it")
    ceilings = measure_ceilings(threads)
    advice = advise(machine)
    cases = plan(quick, threads)
    total_steps = len(cases) + 2 + int(drift)
    step = 0

    def advance(message: str) -> None:
        nonlocal step
        step += 1
        report(step / total_steps, message)

    advance("ceilings measured")
    by_case: dict[Case, CaseResult] = {}
    lm_facts: dict[str, tuple[int, int]] = {}
    engines: dict[tuple, Engine] = {}
    for case in execution_order(cases):
        result = _run_case(case, model, images_dir, case.threads or threads, repeats, db_path, engines, lm_facts,
                           QUICK_CASE_BUDGET_S if quick else None, remote)
        by_case[case] = result
        if remote is not None and case.group == "precision":
            compared = dataclasses.replace(case, name=f"against {case.dtype}", group="against", dtype="remote",
                                           remote_url=against)
            by_case[compared] = CaseResult(compared, result.remote_runs, remote.info.load_seconds)
            cases.insert(cases.index(case) + 1, compared)
        advance(f"{case.name}: done")
    _release(engines)
    if remote is not None:
        remote.close()
    # A shared VM's speed drifts over minutes: a ceiling is the best rate seen, measured before and after.
    ceilings = best_ceilings(ceilings, measure_ceilings(threads))
    results = [by_case[case] for case in cases]
    ceilings = with_decode_reads(ceilings, results, lm_facts)
    for result in results:
        bytes_, params = lm_facts.get(result.case.dtype, (None, None))
        result.summary = summarize(result, ceilings, bytes_, params)
    drift_results = {}
    if drift:
        drift_image = bench_image("448x448", images_dir)
        if quick:  # drift is read at text positions; a 64-token image keeps it short where compute is slow
            drift_image = drift_image.resize((256, 256), Image.BICUBIC)
        drift_results = measure_drift(model, drift_image, [d for d in DTYPES if d != "float32"], 8 if quick else 32, threads, report)
        advance("drift measured")
    synthetic = not has_weights(Path(model)) if Path(model).is_dir() else False
    advice = recommend([result.to_dict() for result in results], drift_results, advice)
    result = BenchResult(model, synthetic, quick, repeats, _machine_facts(machine), dataclasses.asdict(advice),
                         ceilings, drift_results, results,
                         {"url": against, "model": remote.info.model} if remote is not None else None)
    document = result.to_dict()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(document, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown_report(document))
    if html:  # a committed record keeps none: each would carry all of plotly.js
        html_report(document, out_dir / "bench.html")
    advance("written")
    return result



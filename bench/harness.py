"""`python -m bench`: what a request costs on this CPU, per precision, thread count, image size and path.

Every figure is measured in the run: the machine's ceilings (memory bandwidth, matmul rate), vlscope's tuned path,
a plain transformers baseline, and the numerical drift of each precision against float32. Warm-up runs are
excluded; each case is repeated and reported as median and p95. Output: JSON, a markdown table, a plotly HTML.
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

from engine import compute
from engine.config import PROJECT_DIR, SKELETON_DIR, EngineConfig, shared_dir
from engine.engine import Engine
from engine.images import fit_to_budget
from engine.metrics import PeakRss
from engine.model_loading import has_weights, load_model
from engine.preprocess import single_image_inputs
from engine.quantize import LINEAR_KINDS
from engine.request import ChatRequest, Turn
from engine.system import memory_read_gb_per_s, system_report

from .advisor import advise, recommend
from .provenance import code_commit

PROMPT = "Describe this image."
FOLLOW_UPS = ("What colours stand out?", "Is there any text in it?")
IMAGE_SIZES = {"448x448": (448, 448), "1280x960": (1280, 960), "1920x1080": (1920, 1080), "4000x3000": (4000, 3000)}

Report = Callable[[float, str], None]
# Seconds of measured runs a quick case may take: a second repetition only where one run is well under a
# minute, so the quick sweep stays under 10 minutes on a slow CPU and keeps its repetitions on a fast one.
QUICK_CASE_BUDGET_S = 60.0
_CONVERSATIONS = itertools.count(1)


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


@dataclass
class CaseResult:
    case: Case
    runs: list[dict] = field(default_factory=list)  # one metrics record per measured repetition (or turn)
    load_s: float | None = None
    summary: dict = field(default_factory=dict)
    remote_runs: list[dict] = field(default_factory=list)  # the compared server's runs, interleaved with these


# ---- the machine's ceilings ------------------------------------------------------------------------------------

@compute.runs_on_compute_thread
def measure_ceilings(threads: int) -> dict:
    """Memory bandwidth (read of a tensor much larger than the caches) and matmul rates at model-like shapes."""
    torch.set_num_threads(threads)
    bandwidth = memory_read_gb_per_s(gib=2.0)
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
    from transformers import TextStreamer

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

        class Clock(TextStreamer):
            def put(self, value):  # the first call carries the prompt, later ones one new token each
                token_times.append(time.perf_counter())

            def end(self):
                pass

        with torch.inference_mode():
            output = loaded.model.generate(
                input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                mm_token_type_ids=prompt.mm_token_type_ids, pixel_values=patches.pixel_values,
                image_grid_thw=patches.image_grid_thw, max_new_tokens=case.max_new_tokens, do_sample=False,
                streamer=Clock(loaded.tokenizer), use_cache=case.kv_cache, min_new_tokens=case.max_new_tokens,
            )
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
        with torch.inference_mode():
            if "tokens" not in sequences:
                output = loaded.model.generate(
                    input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                    mm_token_type_ids=prompt.mm_token_type_ids, pixel_values=patches.pixel_values,
                    image_grid_thw=patches.image_grid_thw, max_new_tokens=new_tokens, do_sample=False)
                sequences["tokens"] = output
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

def plan(quick: bool, cores: int) -> list[Case]:
    """The cases, in report order. Quick: precisions, the float32 baseline, and a short multi-turn case in each
    precision (a follow-up's time to first token is a target in every one; each runs on the engine its precision
    case already loaded, so it adds seconds, not a load)."""
    tokens = 32 if quick else 128
    precisions = ("float32", "bfloat16", "int8")
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


APP_SWEEP = (
    Case("448x448", "image_size", max_new_tokens=16),
    Case("1280x960", "image_size", image="1280x960", max_new_tokens=16),
    Case("multi-turn", "multi_turn", max_new_tokens=16, turns=3),
)


def sweep_on_engine(engine: Engine, images_dir: Path, report: Report, cases=APP_SWEEP, repeats: int = 1) -> dict:
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
        result = CaseResult(case, run_engine_case(engine, case, bench_image(case.image, images_dir), repeats),
                            engine.info.load_seconds)
        result.summary = summarize(result, ceilings, lm_bytes, lm_params)
        results.append(result)
    report(1.0, "done")
    return {
        "created": dt.datetime.now().isoformat(timespec="seconds"), "code": code_commit(), "model": engine.info.model,
        "synthetic": engine.info.synthetic, "quick": True, "repeats": repeats, "prompt": PROMPT,
        "machine": dataclasses.asdict(machine) | {"advice": machine.advice},
        "precision_advice": {"recommended": "–", "reasons": ["not measured in the app sweep"]},
        "ceilings": ceilings, "drift_vs_float32": {},
        "cases": [{"case": dataclasses.asdict(r.case), "summary": r.summary, "runs": r.runs} for r in results],
    }


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


def reference_result(project_dir: Path = PROJECT_DIR) -> tuple[Path, bool] | None:
    """The benchmark to show beside a fresh sweep: this server's newest run (bench-results/), else the committed
    run (docs/bench/<cpu>/<sweep>/) from a CPU with this one's ISA flags, else the newest committed run.
    Returns the file and whether it was measured on a CPU like this one."""
    local = sorted((project_dir / "bench-results").glob("*/bench.json"))
    if local:
        return local[-1], True
    flags = set(system_report().isa_flags)
    committed = []
    for path in (project_dir / "docs" / "bench").glob("*/*/bench.json"):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        same_cpu = set(document.get("machine", {}).get("isa_flags", ())) == flags
        committed.append((same_cpu, not document.get("quick", True), document.get("created", ""), path))
    if not committed:
        return None
    same_cpu, _, _, path = max(committed)
    return path, same_cpu


def default_model() -> str:
    """Real weights when the configured model has them, else the bundled synthetic skeleton."""
    configured = EngineConfig.from_env().model
    if Path(configured).is_dir() and has_weights(Path(configured)):
        return configured
    return str(SKELETON_DIR)


def run_bench(model: str, quick: bool, repeats: int, images_dir: Path, out_dir: Path, db_path: str,
              report: Report, drift: bool = True, against: str | None = None) -> dict:
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
    for result in results:
        bytes_, params = lm_facts.get(result.case.dtype, (None, None))
        result.summary = summarize(result, ceilings, bytes_, params)
    drift_results = {}
    if drift:
        drift_image = bench_image("448x448", images_dir)
        if quick:  # drift is read at text positions; a 64-token image keeps it short where compute is slow
            drift_image = drift_image.resize((256, 256), Image.BICUBIC)
        drift_results = measure_drift(model, drift_image, ["bfloat16", "int8"], 8 if quick else 32, threads, report)
        advance("drift measured")
    synthetic = not has_weights(Path(model)) if Path(model).is_dir() else False
    cases_out = [{"case": dataclasses.asdict(r.case), "summary": r.summary, "runs": r.runs} for r in results]
    document = {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "code": code_commit(),
        "model": model,
        "synthetic": synthetic,
        "quick": quick,
        "repeats": repeats,
        "prompt": PROMPT,
        "machine": dataclasses.asdict(machine) | {"advice": machine.advice},
        "precision_advice": dataclasses.asdict(recommend(cases_out, drift_results, advice)),
        "ceilings": ceilings,
        "drift_vs_float32": drift_results,
        "cases": cases_out,
        "against": {"url": against, "model": remote.info.model} if remote is not None else None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(document, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown_report(document))
    html_report(document, out_dir / "bench.html")
    advance("written")
    return document


# ---- reports ---------------------------------------------------------------------------------------------------

def _fmt(value, digits=2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _precision(dtype: str, compute_dtype: str | None) -> str:
    """'bfloat16' when weights and compute agree, else 'int8 / float32' (weights / compute)."""
    return dtype if compute_dtype in (None, dtype) else f"{dtype} / {compute_dtype}"


def _median(summary: dict, key: str):
    value = summary.get(key)
    return value["median"] if isinstance(value, dict) else value


def _ratio(ours: dict, other: dict, key: str) -> float | None:
    mine, theirs = _median(ours, key), _median(other, key)
    return mine / theirs if mine and theirs else None


def markdown_report(document: dict) -> str:
    machine, ceilings = document["machine"], document["ceilings"]
    lines = [
        f"# vlscope benchmark ({'quick' if document['quick'] else 'full'}), {document['created']}",
        "",
        f"Model `{document['model']}`{' (synthetic weights: latency and memory are real, answers are not)' if document['synthetic'] else ''}. "
        f"CPU {machine['cpu_model']}, {machine['physical_cores']} cores, ISA {', '.join(machine['isa_flags'])}, "
        f"THP {machine['transparent_hugepages']}, torch {machine['torch_version']}, transformers {machine['transformers_version']}.",
        f"Ceilings measured in this run: memory read {ceilings['memory_read_gb_per_s']:.1f} GB/s; matmul "
        f"float32 {ceilings['matmul_gflops']['float32']:.0f} GFLOP/s, bfloat16 {ceilings['matmul_gflops']['bfloat16']:.0f} GFLOP/s. "
        f"Prompt: \"{document['prompt']}\", greedy; after a warm-up, median of the measured runs (the runs column; p95 in the JSON).",
        "",
        "| case | weights / compute | threads | image | runs | vision tok | load s | TTFT s | follow-up TTFT s | decode tok/s | % of bandwidth ceiling | prefill % of compute | end-to-end s | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in document["cases"]:
        case, s = entry["case"], entry["summary"]
        fraction = s.get("decode_fraction_of_bandwidth_ceiling")
        compute = s.get("prefill_fraction_of_compute_ceiling")
        lines.append(
            f"| {case['name']} | {_precision(case['dtype'], s.get('compute_dtype'))} | {case['threads'] or machine['physical_cores']} | {case['image']} | "
            f"{s.get('repetitions', document['repeats'])} | {s['vision_tokens']} | {_fmt(s.get('load_s'), 1)} | {_fmt(_median(s, 'ttft_s'))} | "
            f"{_fmt(_median(s, 'follow_up_ttft_s'))} | {_fmt(_median(s, 'decode_tokens_per_s'))} | "
            f"{_fmt(fraction * 100 if fraction else None, 0)} | {_fmt(compute * 100 if compute else None, 0)} | "
            f"{_fmt(_median(s, 'e2e_s'), 1)} | {_fmt(None if case['dtype'] == 'remote' else s['rss_peak_bytes'] / 1e9, 1)} |"
        )
    against = document.get("against")
    if against:
        by_name = {entry["case"]["name"]: entry["summary"] for entry in document["cases"]}
        lines += ["", f"Against `{against['model']}`, the same request interleaved with vlscope's in one run "
                  "(ratio vlscope / other: above 1 is faster for decode, below 1 is faster for TTFT and end to end):",
                  "", "| vlscope case | other decode tok/s | decode ratio | other TTFT s | TTFT ratio | other end-to-end s | "
                  "end-to-end ratio |", "|---|---|---|---|---|---|---|"]
        for entry in document["cases"]:
            case = entry["case"]
            other = by_name.get(f"against {case['dtype']}") if case["group"] == "precision" else None
            if other is None:
                continue
            ratios = [_ratio(entry["summary"], other, key) for key in ("decode_tokens_per_s", "ttft_s", "e2e_s")]
            lines.append(f"| {case['name']} | {_fmt(_median(other, 'decode_tokens_per_s'))} | {_fmt(ratios[0])} | "
                         f"{_fmt(_median(other, 'ttft_s'))} | {_fmt(ratios[1])} | {_fmt(_median(other, 'e2e_s'), 1)} | "
                         f"{_fmt(ratios[2])} |")
    if document["drift_vs_float32"]:
        lines += ["", "Numerical drift against float32 (teacher-forced on float32's answer):", "",
                  "| dtype | top-1 agreement | max abs logit error | positions |", "|---|---|---|---|"]
        for dtype, d in document["drift_vs_float32"].items():
            lines.append(f"| {dtype} | {d['top1_agreement'] * 100:.1f}% | {d['max_abs_logit_error']:.3f} | {d['positions']} |")
    advice = document["precision_advice"]
    lines += ["", f"Precision advice for this CPU: **{advice['recommended']}**. " + " ".join(advice["reasons"])]
    return "\n".join(lines) + "\n"


def cases_table(document: dict) -> list[dict]:
    """One row per case with the figures people compare, narrow enough for a page (the markdown has them all)."""
    rows = []
    for entry in document["cases"]:
        case, s = entry["case"], entry["summary"]
        fraction = s.get("decode_fraction_of_bandwidth_ceiling")
        rows.append({"case": case["name"], "precision": _precision(case["dtype"], s.get("compute_dtype")),
                     "TTFT s": _median(s, "ttft_s"), "decode tok/s": _median(s, "decode_tokens_per_s"),
                     "% of read ceiling": round(fraction * 100) if fraction else None,
                     "end to end s": _median(s, "e2e_s"), "peak RSS GB": round(s["rss_peak_bytes"] / 1e9, 1)})
    return rows


def html_report(document: dict, path: Path) -> None:
    path.write_text(report_figure(document).to_html(include_plotlyjs=True, full_html=True))


def report_figure(document: dict):
    from plotly.subplots import make_subplots

    cases = document["cases"]
    names = [c["case"]["name"] for c in cases]
    figure = make_subplots(rows=2, cols=2, subplot_titles=(
        "where the first answer's time goes (s, median)", "decode tokens/s (median)", "TTFT (s, median)",
        "peak RSS (GB)"))
    stage_names = sorted({k for c in cases for k in c["summary"]["stages"]})
    for stage in stage_names:
        figure.add_bar(name=stage, x=names, y=[(c["summary"]["stages"].get(stage) or {}).get("median", 0)
                                               for c in cases], row=1, col=1)
    figure.add_bar(name="decode tok/s", x=names, y=[_median(c["summary"], "decode_tokens_per_s") for c in cases],
                   row=1, col=2, showlegend=False)
    figure.add_scatter(name="memory-read ceiling", x=names, y=[c["summary"].get("decode_ceiling_tokens_per_s")
                                                               for c in cases],
                       mode="markers", marker=dict(symbol="line-ew-open", size=28, color="#e15759"), row=1, col=2)
    figure.add_bar(name="TTFT", x=names, y=[_median(c["summary"], "ttft_s") for c in cases], row=2, col=1,
                   showlegend=False)
    figure.add_bar(name="peak RSS", x=names, y=[c["summary"]["rss_peak_bytes"] / 1e9 for c in cases], row=2, col=2,
                   showlegend=False)
    figure.update_layout(barmode="stack", height=900, title=f"vlscope benchmark, {document['created']}")
    return figure

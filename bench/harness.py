"""`python -m bench`: what a request costs on this CPU, per precision, thread count, image size and path.

Runs the cases speed/plan.py lays out, each measured as speed/sweep.py measures the app's sweep; speed/tables.py
turns the result into tables and a figure. Every figure is measured in the run: the machine's ceilings (memory
bandwidth, matmul rate), vlscope's tuned path, a plain transformers baseline, and the numerical drift of each
precision against float32. Warm-up runs are excluded; each case is repeated and reported as median and p95.
Output: JSON, a markdown table, a plotly HTML.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

import torch
from PIL import Image

from engine.client import Engine
from engine.config import DTYPES, SKELETON_DIR, EngineConfig
from engine.core import compute
from engine.inputs.limits import fit_to_budget
from engine.inputs.preprocess import single_image_inputs
from engine.machine import system_report
from engine.model.loading import has_weights, load_model
from engine.records.metrics import PeakRss
from fixtures.places import shared_dir
from speed.advice import advise, recommend
from speed.plan import PROMPT, Case, execution_order, plan
from speed.sweep import (SAMPLES_DIR, BenchResult, CaseResult, Report, bench_image, best_ceilings,
                         language_model_params, machine_facts, measure_ceilings, run_engine_case, run_interleaved,
                         summarize, with_decode_reads)
from speed.tables import html_report, markdown_report

QUICK_CASE_BUDGET_S = 60.0


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
    return shared if shared.is_dir() else SAMPLES_DIR


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
    result = BenchResult(model, synthetic, quick, repeats, machine_facts(machine), dataclasses.asdict(advice),
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



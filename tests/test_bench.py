"""The benchmark harness end to end on the tiny model: every case measured, every report written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.harness import run_baseline_case
from engine.config import DTYPES
from engine.kernels.packing import wide_layout_pays
from engine.machine import CPU_KINDS, cpu_kind, system_report
from speed.advice import advise, agreement_line
from speed.plan import Case, execution_order, plan
from speed.record import Reference, measured_kind, reference_result
from speed.sweep import bench_image, run_engine_case

from .conftest import FULL_SKELETON, ROOT
from .test_api import start_server


def test_quick_bench_writes_json_markdown_and_html(tiny_model, images_dir, tmp_path):
    """The quick sweep, compared against another OpenAI-compatible server (a second vlscope here, as llama.cpp's
    llama-server would be) with --against."""
    out = tmp_path / "bench"
    other, url = start_server(tiny_model, tmp_path / "other.db", tmp_path / "other.log")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "bench", "--quick", "--model", str(tiny_model), "--images",
             str(images_dir), "--out", str(out), "--db", str(tmp_path / "bench.db"), "--repeats", "2",
             "--against", f"{url}/v1"],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )
    finally:
        other.terminate()
        other.wait(20)
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads((out / "bench.json").read_text())
    assert document["ceilings"]["memory_read_gb_per_s"] > 0
    assert document["ceilings"]["matmul_gflops"]["float32"] > 0
    cases = {c["case"]["name"]: c for c in document["cases"]}
    assert {"tuned float32", "tuned bfloat16", "tuned int8", "tuned int4", "baseline float32", "multi-turn float32"} <= set(cases)
    for case in cases.values():
        summary = case["summary"]
        assert summary["ttft_s"]["median"] > 0 and summary["e2e_s"]["median"] >= summary["ttft_s"]["median"]
        assert summary["decode_tokens_per_s"]["median"] > 0 and summary["rss_peak_bytes"] > 0
    # each measured request starts cold: nothing reused from the warm-up or an earlier repetition
    assert all(r["cached_prompt_tokens"] == 0 for r in cases["tuned float32"]["runs"])
    assert cases["tuned float32"]["summary"]["compute_dtype"] == "float32"
    assert cases["tuned int8"]["summary"]["compute_dtype"] in ("float32", "bfloat16")
    assert cases["tuned int4"]["summary"]["compute_dtype"] == cases["tuned int8"]["summary"]["compute_dtype"]
    tuned = cases["tuned float32"]["summary"]
    assert {"vision_encode", "prefill", "decode"} <= set(tuned["stages"])
    assert 0 < tuned["decode_fraction_of_bandwidth_ceiling"]
    # float32 drafts where its layout allows: its tokens are not a read each, so it never sets the read ceiling
    if wide_layout_pays():
        assert tuned["drafts"]["drafted"] > 0 and "Drafts kept: tuned float32" in (out / "bench.md").read_text()
    set_by = document["ceilings"].get("memory_read_set_by")
    assert set_by is None or not cases[set_by]["summary"].get("drafts")
    multi = cases["multi-turn float32"]
    assert [r["turn"] for r in multi["runs"]] == [1, 2, 3] * multi["summary"]["repetitions"]
    assert all(r["cached_prompt_tokens"] > r["vision_tokens"] for r in multi["runs"] if r["turn"] > 1)  # image not re-encoded
    assert set(document["drift_vs_float32"]) == {"bfloat16", "int8", "int4"}
    # the advice weighs all four precisions end to end, with their drift, and the record names its commit
    advice = document["precision_advice"]
    assert advice["recommended"] in DTYPES
    assert set(advice["evidence"]["end_to_end_s"]) == set(DTYPES)
    assert all(any(reason.startswith(f"{d}: ") for reason in advice["reasons"]) for d in DTYPES)
    assert len(document["code"]["commit"]) == 40
    for drift in document["drift_vs_float32"].values():
        assert 0 <= drift["top1_agreement"] <= 1 and drift["max_abs_logit_error"] >= 0
    # the other server answered the same requests, A B A B with each precision: as many runs as vlscope's
    for dtype in DTYPES:
        theirs, ours = cases[f"against {dtype}"], cases[f"tuned {dtype}"]
        assert theirs["case"]["group"] == "against" and len(theirs["runs"]) == len(ours["runs"]) >= 1
        assert all(r["dtype"] == "remote" and r["status"] == "ok" for r in theirs["runs"])
        assert [r["submitted_at"] < t["submitted_at"] for r, t in zip(ours["runs"], theirs["runs"])] == \
            [True] * len(ours["runs"])
    assert document["against"]["url"] == f"{url}/v1"
    markdown = (out / "bench.md").read_text()
    assert markdown.count("\n| ") >= len(cases) + 2 and "baseline float32" in markdown
    assert "decode ratio" in markdown and markdown.count("| tuned ") >= 8  # the case table and the comparison
    assert "plotly" in (out / "bench.html").read_text()[:100000].lower()


def test_precision_advice_is_measured():
    advice = advise()
    assert advice.recommended in ("float32", "bfloat16")
    for dtype in ("float32", "bfloat16"):
        assert advice.evidence[dtype]["prefill_gflops"] > 0 and advice.evidence[dtype]["decode_ms_per_layer"] > 0
    assert any("GFLOP/s" in reason for reason in advice.reasons)


def test_quick_plan_measures_follow_ups_in_each_precision_and_loads_each_model_once():
    def multi_turn(cases):
        return [c.dtype for c in cases if c.group == "multi_turn"]

    assert multi_turn(plan(True, 2)) == ["float32", "bfloat16", "int8", "int4"]
    for cases in (plan(True, 2), plan(False, 4)):
        order = execution_order(cases)
        assert sorted(c.name for c in order) == sorted(c.name for c in cases)
        keys = [(c.baseline, c.engine_key()) for c in order]
        contiguous_runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        assert len(contiguous_runs) == len(set(keys))  # no engine setting comes back after another one


def test_the_cpu_kind_is_the_isa_level_not_the_flag_set():
    assert cpu_kind(("avx2",)) == "avx2"
    assert cpu_kind(("avx2", "avx512f", "avx512_vnni")) == "avx512"  # no BF16: the AVX-512 kind
    assert cpu_kind(("avx2", "avx512f", "avx512_vnni", "avx512_bf16")) == "avx512-bf16"
    assert cpu_kind(("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")) == "amx"
    assert cpu_kind(()) == "other"


def test_the_read_ceiling_is_at_least_what_a_decode_read():
    from speed.sweep import CaseResult, with_decode_reads

    ceilings = {"memory_read_gb_per_s": 30.0, "matmul_gflops": {}}
    slow = CaseResult(Case("tuned int8", "precision", dtype="int8"), [{"decode_tokens_per_s": 10.0}], 1.0)
    fast = CaseResult(Case("tuned int4", "precision", dtype="int4"), [{"decode_tokens_per_s": 40.0}], 1.0)
    facts = {"int8": (1.7e9, 1), "int4": (1.0e9, 1)}
    assert with_decode_reads(ceilings, [slow], facts) == ceilings  # 17 GB/s: under the streaming reads
    raised = with_decode_reads(ceilings, [slow, fast], facts)
    assert raised["memory_read_gb_per_s"] == pytest.approx(40.0) and raised["memory_read_set_by"] == "tuned int4"


def test_docs_bench_holds_one_record_per_cpu_kind():
    """docs/bench/ is a record per CPU kind, each in the folder its machine's ISA level names: not a notebook of runs."""
    folders = [path for path in (ROOT / "docs" / "bench").iterdir()]
    assert folders and all(path.is_dir() for path in folders)
    known = {kind for kind, _, _ in CPU_KINDS}
    for folder in folders:
        assert folder.name in known and {p.name for p in folder.iterdir()} == {"bench.json", "bench.md"}
        assert measured_kind(json.loads((folder / "bench.json").read_text())) == folder.name


def test_reference_result_is_the_newest_run_from_a_cpu_of_this_kind(tmp_path):
    assert reference_result(tmp_path) is None

    def write(relative: str, flags, created: str):
        path = tmp_path / relative / "bench.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"machine": {"isa_flags": list(flags)}, "created": created, "quick": True}))
        return path

    here = system_report()
    other_flags = ("avx2",) if here.cpu_kind != "avx2" else ("avx2", "avx512f")
    other = write("docs/bench/other/", other_flags, "2026-06-01")
    assert reference_result(tmp_path) == Reference(other, cpu_kind(other_flags), False)
    # the same ISA level with another flag set (a made-up one here) is a CPU of this kind
    record = write(f"docs/bench/{here.cpu_kind}", (*here.isa_flags, "made-up-flag"), "2026-01-01")
    assert reference_result(tmp_path) == Reference(record, here.cpu_kind, True)
    (tmp_path / "docs/bench/broken").mkdir(parents=True)
    (tmp_path / "docs/bench/broken/bench.json").write_text("{not json")
    assert reference_result(tmp_path) == Reference(record, here.cpu_kind, True)
    own = write("bench-results/20260701-120000", here.isa_flags, "2026-07-01")
    assert reference_result(tmp_path).path == own  # this server's newer run
    write("bench-results/20251201-120000", here.isa_flags, "2025-12-01")
    assert reference_result(tmp_path).path == own


def test_a_time_budget_cuts_repetitions_but_never_the_first(make_engine, images_dir):
    engine = make_engine()
    image = bench_image("448x448", images_dir)
    single = Case("one", "precision", max_new_tokens=2)
    assert len(run_engine_case(engine, single, image, repeats=3)) == 3
    assert len(run_engine_case(engine, single, image, repeats=3, budget_s=0.0)) == 1
    conversation = Case("talk", "multi_turn", max_new_tokens=2, turns=2)
    records = run_engine_case(engine, conversation, image, repeats=3, budget_s=0.0)
    assert [r["turn"] for r in records] == [1, 2]  # one whole conversation, not a cut one
    twice = run_engine_case(engine, conversation, image, repeats=2)
    # the second conversation reuses its own first turn, not the longer cache the first conversation left
    assert twice[1]["cached_prompt_tokens"] == twice[3]["cached_prompt_tokens"] > 0
    assert twice[2]["cached_prompt_tokens"] == 0


def test_the_baseline_is_plain_transformers_in_the_weights_dtype(tiny_model, images_dir):
    """No vlscope choice leaks into the baseline: bfloat16 weights compute in bfloat16 there, whatever the CPU."""
    case = Case("baseline bfloat16", "baseline", dtype="bfloat16", max_new_tokens=3, baseline=True)
    load_s, [record] = run_baseline_case(str(tiny_model), case, bench_image("448x448", images_dir), threads=1)
    assert load_s > 0 and record["compute_dtype"] == "bfloat16" and record["output_tokens"] == 3
    assert record["ttft_s"] > 0 and record["e2e_s"] >= record["ttft_s"]


def test_tune_measures_each_option_on_the_same_tokens(tiny_model, images_dir):
    from bench.tune import markdown, tune
    from engine.config import EngineConfig

    lines: list[str] = []
    trials = tune(EngineConfig(model=str(tiny_model), threads=1, warmup=False), images_dir / "coffee.png",
                  new_tokens=3, repeats=1, side=128, compile_=False, report=lines.append)
    assert [(t.choice, t.option) for t in trials] == [("attention", "sdpa"), ("attention", "eager"),
                                                       ("kv cache", "dynamic"), ("kv cache", "static")]
    assert all(len(t.tokens) == 3 and t.prefill_s > 0 and t.decode_ms_per_token > 0 for t in trials)
    assert trials[0].vision_s > 0 and trials[2].vision_s is None  # the cache trials reuse one vision encode
    table = markdown(trials, "# tune")
    assert table.count("\n| ") == len(trials) + 1 and ("| NO |" in table) == any(
        t.tokens != trials[0].tokens for t in trials)


def test_measurements_called_from_another_thread_run_on_the_compute_thread():
    """The advice and the ceilings, called from the main thread, run their PyTorch work on the engine's compute
    thread: no OpenMP team (a new worker thread) is left on the caller's. One there slowed every later decode step
    of the quick bench (docs/architecture.md, "The engine API"). In a fresh process, whose threads can be counted; the same count
    does see a team started on the main thread."""
    code = (
        "import os, torch\n"
        "from engine.core import compute\n"
        "from speed.advice import advise\n"
        "from speed.sweep import measure_ceilings\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "compute.run(lambda: (torch.set_num_threads(2), torch.ones(4_000_000).sum()))\n"
        "before = threads()\n"
        "advise()\n"
        "measure_ceilings(2)\n"
        "measured = threads()\n"
        "torch.ones(4_000_000).sum()\n"
        "print(before, measured, threads())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True)
    before, measured, after_main_thread_work = map(int, run.stdout.split())
    assert measured == before
    assert after_main_thread_work > measured


def _case(dtype: str, e2e: float, compute: str) -> dict:
    return {"case": {"group": "precision", "dtype": dtype},
            "summary": {"e2e_s": {"median": e2e}, "rss_peak_bytes": 4e9, "compute_dtype": compute}}


def test_advice_is_the_fastest_precision_end_to_end_that_keeps_to_float32():
    """The figures of the AVX2 EPYC's standard request: int8 wins while its drift holds, float32 once it does not;
    bfloat16 computing in float32 is said to save memory, not time."""
    from speed.advice import recommend

    cases = [_case("float32", 23.5, "float32"), _case("bfloat16", 25.2, "float32"), _case("int8", 11.7, "float32")]
    close = {"bfloat16": {"top1_agreement": 1.0}, "int8": {"top1_agreement": 0.96}}
    advice = recommend(cases, close)
    assert advice.recommended == "int8"
    assert [r.split(":")[0] for r in advice.reasons[1:4]] == ["int8", "float32", "bfloat16"]  # fastest first
    assert "saves memory, not time" in next(r for r in advice.reasons if r.startswith("bfloat16:"))
    drifting = {"bfloat16": {"top1_agreement": 1.0}, "int8": {"top1_agreement": 0.80}}
    assert recommend(cases, drifting).recommended == "float32"
    faster_bf16 = [_case("float32", 23.5, "float32"), _case("bfloat16", 12.0, "bfloat16")]
    assert recommend(faster_bf16, drifting).recommended == "bfloat16"
    assert recommend([], {}).recommended == "float32"


def test_a_record_says_whether_the_engine_changed_since_its_commit(tmp_path):
    from speed.record import code_commit, describe, engine_changed_since

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "step.py").write_text("A = 1\n")
    git("add", "-A")
    git("commit", "-qm", "engine")
    measured = code_commit(tmp_path)
    assert measured == {"commit": measured["commit"], "edited": False}
    assert engine_changed_since(measured, tmp_path) is False
    (tmp_path / "README.md").write_text("docs only\n")
    git("add", "-A")
    git("commit", "-qm", "docs")
    assert engine_changed_since(measured, tmp_path) is False  # a docs change leaves the figures standing
    (tmp_path / "engine" / "step.py").write_text("A = 2\n")
    assert engine_changed_since(measured, tmp_path) is True  # uncommitted engine edits
    git("commit", "-qam", "faster")
    assert engine_changed_since(measured, tmp_path) is True
    assert "Older than this code" in describe({"created": "2026-12-02T10:00:00", "code": measured}, tmp_path)
    assert engine_changed_since(code_commit(tmp_path), tmp_path) is False
    assert "not recorded" in describe({"created": "2026-12-02T10:00:00"}, tmp_path)
    assert engine_changed_since({"commit": "0" * 40}, tmp_path) is None  # a commit this clone lacks


def test_load_burst_measures_concurrent_people_here_and_against_another_server(tiny_model, images_dir, tmp_path):
    """`python -m bench.load`: three people at once with different pictures, against the vlscope it starts and
    against a second server (as llama-server -np 3 would be): every stream answered in full, the burst's figures."""
    other, url = start_server(tiny_model, tmp_path / "other.db", tmp_path / "other.log")
    out = tmp_path / "load.json"
    try:
        run = subprocess.run([sys.executable, "-m", "bench.load", "--model", str(tiny_model), "--dtype", "float32",
                              "--clients", "3", "--max-tokens", "12", "--images", str(images_dir), "--out", str(out),
                              "--against", f"{url}/v1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        other.terminate()
        other.wait(20)
    assert run.returncode == 0, run.stderr[-3000:]
    ours, theirs = json.loads(out.read_text())
    assert theirs["server"] == f"{url}/v1" and ours["server"] != theirs["server"]
    for burst in (ours, theirs):
        assert burst["errors"] == 0 and burst["clients"] == 3
        assert [stream["tokens"] for stream in burst["streams"]] == [12, 12, 12]
        assert 0 < burst["ttft_p50_s"] <= burst["ttft_max_s"] <= burst["e2e_max_s"] <= burst["wall_s"]
        assert burst["tokens_per_s"] == pytest.approx(36 / burst["wall_s"])
        assert burst["longest_pause_s"] >= 0
    assert "| people |" in out.with_suffix(".md").read_text()


def test_a_committed_run_renders_as_html(tmp_path):
    """Committed records keep JSON and markdown; `python -m bench.render` draws the HTML report from the JSON."""
    source = sorted((ROOT / "docs" / "bench").glob("*/bench.json"))[0]
    out = tmp_path / "report.html"
    run = subprocess.run([sys.executable, "-m", "bench.render", str(source), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    html = out.read_text()
    first_case = json.loads(source.read_text())["cases"][0]["case"]["name"]
    assert html.lower().startswith("<!doctype html>") and "plotly" in html and first_case in html
    assert not list((ROOT / "docs").rglob("*.html"))  # none committed: each would carry all of plotly.js


def test_steps_compares_a_batched_decode_step_with_one_at_the_same_length(tiny_model, tmp_path):
    """`python -m bench.steps`: at each cached length, one sequence's step and a batch's step, and the tokens/s the
    batch gives against one."""
    out = tmp_path / "steps.json"
    run = subprocess.run([sys.executable, "-m", "bench.steps", "--model", str(tiny_model), "--dtype", "float32",
                          "--batch", "3", "--lengths", "20", "40", "--steps", "3", "--rounds", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["length"], r["batch"]) for r in results] == [(20, 3), (40, 3)]
    for r in results:
        assert r["one_ms"] > 0 and r["batch_ms"] > 0
        assert r["gain"] == pytest.approx(3 * r["one_ms"] / r["batch_ms"])
    assert "| cached tokens |" in out.with_suffix(".md").read_text()


def test_load_burst_alternates_free_and_grammar_held_answers(tiny_model, images_dir, tmp_path):
    """`python -m bench.load --constrained`: each burst runs with free answers, answers held to a JSON schema and a
    forced tool call, all cut by max_tokens (the same length), with the server's decode rate, grammar time and
    tokens a forward pass gave for each: a grammar's forced tokens ride along, free answers take one a step."""
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "-m", "bench.load", "--model", str(tiny_model), "--dtype", "float32",
                          "--clients", "1", "2", "--max-tokens", "24", "--constrained", "--images", str(images_dir),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    bursts = json.loads(out.read_text())
    answers = ["free", "JSON schema", "tool call"]
    assert [(b["clients"], b["answer"]) for b in bursts] == [(n, answer) for n in (1, 2) for answer in answers]
    for burst in bursts:
        assert burst["errors"] == 0 and [s["tokens"] for s in burst["streams"]] == [24] * burst["clients"]
        assert burst["decode_tokens_per_s"] > 0
        assert (burst["grammar_ms_per_token"] > 0) == burst["constrained"]
        assert (burst["tokens_per_step"] > 1.2) == burst["constrained"], burst["tokens_per_step"]
    table = out.with_suffix(".md").read_text()
    assert "JSON schema over free answers, 1 person" in table and "tool call over free answers, 2 people" in table


def test_grammars_measures_a_schema_set_and_names_what_it_refuses(tmp_path):
    """`python -m bench.grammars`: on a suite in JSON-Schema-Test-Suite's form, which schemas compile, which are
    refused by kind, and whether the engine's grammar accepts exactly the valid instances."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "bounded.json").write_text(json.dumps([
        {"description": "an enum and a bounded integer", "schema": {
            "type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "maximum": 9}},
            "required": ["kind", "n"], "additionalProperties": False},
         "tests": [{"data": {"kind": "a", "n": 3}, "valid": True}, {"data": {"kind": "c", "n": 3}, "valid": False},
                   {"data": {"kind": "b", "n": 12}, "valid": False}, {"data": {"kind": "b"}, "valid": False}]},
        {"description": "a keyword not enforced", "schema": {"type": "object", "unevaluatedProperties": False},
         "tests": [{"data": {}, "valid": True}]}]))
    out = tmp_path / "grammars.json"
    run = subprocess.run([sys.executable, "-m", "bench.grammars", "--suite", str(suite), "--model", str(FULL_SKELETON),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ours = next(result for result in json.loads(out.read_text()) if result["engine"] == "llguidance")
    assert (ours["schemas"], ours["compiled"], ours["refusals"]) == (2, 1, {"unsupported_schema": 1})
    assert (ours["instances"], ours["agreed"], ours["accepted_invalid"]) == (4, 4, 0)
    assert ours["compile_ms"]["p50"] > 0 and "| llguidance | 1 of 2 (50%)" in out.with_suffix(".md").read_text()


def test_schemas_counts_what_strict_refuses_and_what_lenient_loosens(tmp_path):
    """`python -m bench.schemas`: a set in JSONSchemaBench's layout, each schema compiled as a response format with
    and without strict, at the server's limits (here a small VLSCOPE_MAX_SCHEMA_BYTES)."""
    for category, schemas in {"plain": [{"type": "object", "properties": {"a": {"type": "integer"}}}],
                              "odd": [{"type": "array", "uniqueItems": True},
                                      {"oneOf": [{"type": "integer"}, {"minimum": 2}]},
                                      {"enum": ["x" * 300, "y" * 300]}]}.items():
        (tmp_path / "set" / category).mkdir(parents=True)
        for index, schema in enumerate(schemas):
            (tmp_path / "set" / category / f"{index}.json").write_text(json.dumps(schema))
    out = tmp_path / "schemas.json"
    run = subprocess.run([sys.executable, "-m", "bench.schemas", "--set", str(tmp_path / "set"), "--out", str(out),
                          "--model", str(FULL_SKELETON)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLSCOPE_MAX_SCHEMA_BYTES": "512"})
    assert run.returncode == 0, run.stderr[-2000:]
    odd, plain = json.loads(out.read_text())
    assert (plain["schemas"], plain["strict"], plain["lenient"], plain["loosened"]) == (1, 1, 1, 0)
    assert (odd["schemas"], odd["strict"], odd["lenient"], odd["loosened"]) == (3, 0, 2, 2)
    assert odd["refusals"] == {"schema_too_large": 1}
    assert "| **all** | 4 | 1 (25%) | 3 (75%) | 2 |" in out.with_suffix(".md").read_text()


def test_the_settings_line_says_what_a_precision_costs_and_what_it_was_measured_on():
    document = {"created": "2026-12-06T08:00:00", "quick": True, "synthetic": True, "drift_vs_float32": {
        "bfloat16": {"top1_agreement": 0.987}, "int8": {"top1_agreement": 0.974, "positions": 21},
        "int4": {"top1_agreement": 0.818, "positions": 21}}}
    assert agreement_line(document) == (
        "int4 picks float32's token 81.8% of the time at 21 positions (a 256x256 picture (64 vision tokens), "
        "8 answer tokens, synthetic weights; benchmark of 2026-12-06 on a CPU of this kind).")
    assert agreement_line(document, "int8").startswith("int8 picks float32's token 97.4% of the time at 21 ")
    assert "another kind" in agreement_line(document, "int8", same_cpu=False)
    assert agreement_line(document, "float32").startswith("float32 is the reference")
    del document["drift_vs_float32"]["int4"]
    assert "python -m bench --quick --record" in agreement_line(document) and "python -m bench" in agreement_line(None)


def test_the_estimate_before_sending_gives_back_what_it_was_measured_on_and_grows_faster_than_the_prompt():
    from transformers import AutoConfig

    from engine.config import SKELETON_DIR
    from speed.estimate import from_record

    config = AutoConfig.from_pretrained(SKELETON_DIR)
    record = json.loads(next(ROOT.glob("docs/bench/*/bench.json")).read_text())
    case = next(c for c in record["cases"] if c["case"]["name"] == "tuned int8")
    summary, weights = case["summary"], case["runs"][0]["weight_bytes"]
    rates = from_record(record, "int8", weights, config)
    measured = summary["stages"]["vision_encode"]["median"] + summary["stages"]["prefill"]["median"]
    picture, prompt = summary["vision_tokens"], summary["prompt_tokens"]
    assert rates.first_token_s([picture], prompt, config) == pytest.approx(measured)
    assert rates.answer_s(32) == pytest.approx(32 / summary["decode_tokens_per_s"]["median"])
    # a picture of four times the tokens costs more than four times the seconds: attention grows with the square
    assert rates.first_token_s([4 * picture], 4 * prompt, config) > 4 * measured
    assert from_record(record, "int8", weights // 4, config) is None  # measured on a model of another size

"""A benchmark result as people read it: a markdown table, a narrow table for a page, a plotly figure."""
from __future__ import annotations

from pathlib import Path


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
    set_by = (f" (what {ceilings['memory_read_set_by']} read in decode, above the streaming reads)"
              if ceilings.get("memory_read_set_by") else "")
    lines = [
        f"# vlscope benchmark ({'quick' if document['quick'] else 'full'}), {document['created']}",
        "",
        f"Model `{document['model']}`{' (synthetic weights: latency and memory are real, answers are not)' if document['synthetic'] else ''}. "
        f"CPU {machine['cpu_model']}, {machine['physical_cores']} cores, ISA {', '.join(machine['isa_flags'])}, "
        f"THP {machine['transparent_hugepages']}, torch {machine['torch_version']}, transformers {machine['transformers_version']}.",
        f"Ceilings measured in this run: memory read {ceilings['memory_read_gb_per_s']:.1f} GB/s{set_by}; matmul "
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
    drafted = [(entry["case"]["name"], entry["summary"]["drafts"]) for entry in document["cases"]
               if entry["summary"].get("drafts")]
    if drafted:
        kept = "; ".join(f"{name} {d['kept']} of {d['drafted']}" for name, d in drafted)
        lines += ["", "Drafted decode (float32's speculative decoding, docs/decisions.md): its share of the read ceiling "
                  f"counts each token as a plain step's read, so it can pass 100%. Drafts kept: {kept}."]
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


# The record's case each case of the app's sweep compares with, by the sweep case's name: the same picture and turns.
RECORD_CASE_OF_SWEEP = {"448x448": "tuned", "multi-turn": "multi-turn"}


def _weights(entry: dict) -> int | None:
    runs = entry.get("runs") or ()
    return runs[0].get("weight_bytes") if runs else None


def against_record(sweep: dict, record: dict) -> list[dict]:
    """The app's sweep beside the benchmark on record, case by case at the sweep's precision: first token and decode
    as "now / on record", and each ratio now / record (first token: below 1 is faster now; decode: above 1 is)."""
    by_name = {entry["case"]["name"]: entry for entry in record.get("cases", ())}
    rows = []
    for entry in sweep["cases"]:
        case, now = entry["case"], entry["summary"]
        prefix = RECORD_CASE_OF_SWEEP.get(case["name"])
        then = by_name.get(f"{prefix} {case['dtype']}") if prefix else None
        if then is None:
            continue
        ttft, decode = _median(now, "ttft_s"), _median(now, "decode_tokens_per_s")
        ttft_then, decode_then = _median(then["summary"], "ttft_s"), _median(then["summary"], "decode_tokens_per_s")
        rows.append({"case": case["name"],
                     "TTFT s": f"{ttft:.2f} / {ttft_then:.2f}" if ttft and ttft_then else None,
                     "TTFT x": ttft / ttft_then if ttft and ttft_then else None,
                     "tok/s": f"{decode:.1f} / {decode_then:.1f}" if decode and decode_then else None,
                     "tok/s x": decode / decode_then if decode and decode_then else None,
                     "same model": _weights(entry) == _weights(then)})
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

"""Plotly figures of request metrics. Pure functions of the records, so they are tested without a browser."""
from __future__ import annotations

import datetime as dt
import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import RequestMetrics
from engine.records.stages import DECODE, PREFILL, QUEUE_WAIT, STAGES

GIB = 1 << 30
# One colour per name of QUEUE_WAIT + STAGES, in that order.
STAGE_COLOURS = dict(zip((QUEUE_WAIT,) + STAGES, ("#bab0ac", "#9c755f", "#d4a6c8", "#8cd17d", "#499894", "#b07aa1",
                                                  "#ff9da7", "#edc948", "#f28e2b", "#e15759", "#ff9d9a", "#4e79a7",
                                                  "#76b7b2", "#59a14f"), strict=True))


def label(record: RequestMetrics) -> str:
    """A short, unique axis label: time and the id's first characters."""
    return f"{dt.datetime.fromtimestamp(record.submitted_at):%H:%M:%S} {record.id[:6]}"


def client_stages(record: RequestMetrics) -> dict:
    return {QUEUE_WAIT: record.queue_wait_s, **record.stages}


def server_stages(record: RequestMetrics) -> dict:
    """A remote server's own timings: vlscope's metrics record, or llama.cpp's `timings` (milliseconds)."""
    server = record.server_metrics or {}
    if isinstance(server.get("stages"), dict):  # kept as numbers by engine/remote.py; older records unchecked
        stages = {html.escape(str(name))[:40]: seconds for name, seconds in server["stages"].items()
                  if isinstance(seconds, (int, float))}
        wait = server.get("queue_wait_s")
        return {QUEUE_WAIT: wait if isinstance(wait, (int, float)) else 0.0, **stages}
    prompt_ms, predicted_ms = server.get("prompt_ms"), server.get("predicted_ms")
    if isinstance(prompt_ms, (int, float)) or isinstance(predicted_ms, (int, float)):
        return {PREFILL: (prompt_ms if isinstance(prompt_ms, (int, float)) else 0) / 1000,
                DECODE: (predicted_ms if isinstance(predicted_ms, (int, float)) else 0) / 1000}
    return {}


def stage_bars(records: list[RequestMetrics], stages_of=client_stages) -> go.Figure:
    """One stacked bar per request (oldest left): where its end-to-end time went."""
    records = sorted(records, key=lambda r: r.submitted_at)
    labels = [label(r) for r in records]
    per_record = [stages_of(r) for r in records]
    known = (QUEUE_WAIT,) + STAGES
    names = list(known) + sorted({name for stages in per_record for name in stages} - set(known))
    figure = go.Figure()
    for stage in names:
        values = [stages.get(stage, 0.0) for stages in per_record]
        if any(values):
            figure.add_bar(name=stage, x=labels, y=values, marker_color=STAGE_COLOURS.get(stage),
                           hovertemplate="%{x}<br>" + stage + ": %{y:.3f} s<extra></extra>")
    figure.update_layout(barmode="stack", yaxis_title="seconds", xaxis_title="request", legend_title="stage",
                         margin=dict(t=30, b=10), height=380)
    return figure


def rss_chart(records: list[RequestMetrics]) -> go.Figure:
    records = sorted(records, key=lambda r: r.submitted_at)
    labels = [label(r) for r in records]
    figure = go.Figure()
    for name, attribute, dash in (("before", "rss_before_bytes", "dot"), ("peak", "rss_peak_bytes", "solid"),
                                  ("after", "rss_after_bytes", "dash")):
        figure.add_scatter(name=name, x=labels, y=[getattr(r, attribute) / GIB for r in records],
                           mode="lines+markers", line=dict(dash=dash))
    figure.add_scatter(name="weights", x=labels, y=[r.weight_bytes / GIB for r in records], mode="lines",
                       line=dict(color="#999", width=1))
    figure.update_layout(yaxis_title="GiB", xaxis_title="request", margin=dict(t=30, b=10), height=320)
    return figure


def latency_over_time(records: list[RequestMetrics]) -> go.Figure:
    records = sorted(records, key=lambda r: r.submitted_at)
    times = [dt.datetime.fromtimestamp(r.submitted_at) for r in records]
    figure = make_subplots(rows=1, cols=2, subplot_titles=("time to first token (s)", "decode tokens/s"))
    figure.add_scatter(x=times, y=[r.ttft_s for r in records], mode="lines+markers", name="TTFT", row=1, col=1)
    figure.add_scatter(x=times, y=[r.decode_tokens_per_s for r in records], mode="lines+markers",
                       name="decode tok/s", row=1, col=2)
    figure.update_layout(showlegend=False, margin=dict(t=40, b=10), height=300)
    return figure


def token_latency_chart(record: RequestMetrics) -> go.Figure:
    figure = go.Figure()
    figure.add_scatter(x=list(range(2, len(record.token_latencies_s) + 2)),
                       y=[s * 1000 for s in record.token_latencies_s], mode="lines", name="step")
    figure.update_layout(xaxis_title="output token", yaxis_title="decode step (ms)", margin=dict(t=30, b=10),
                         height=300)
    return figure


def records_frame(records: list[RequestMetrics]) -> pd.DataFrame:
    rows = []
    for r in records:
        rows.append({
            "time": dt.datetime.fromtimestamp(r.submitted_at), "id": r.id[:8], "status": r.status, "source": r.source,
            "warmup": r.warmup, "dtype": r.dtype, "threads": r.threads, "synthetic": r.synthetic,
            "vision tokens": r.vision_tokens, "prompt tokens": r.prompt_tokens, "output tokens": r.output_tokens,
            "queue wait s": r.queue_wait_s, "TTFT s": r.ttft_s, "tok/s": r.decode_tokens_per_s, "decode GB/s": r.decode_gb_per_s,
            "batch": (sum(r.decode_batch_sizes) / len(r.decode_batch_sizes)) if r.decode_batch_sizes else None,
            "drafts kept": f"{r.drafts_kept}/{r.drafted_tokens}" if r.drafted_tokens else None,
            "forced tokens": r.forced_tokens or None,
            "paused s": r.paused_s, "total s": r.e2e_s,
            "peak RSS GiB": r.rss_peak_bytes / GIB, "error": r.error,
        })
    return pd.DataFrame(rows)


def decode_intervals(records: list[RequestMetrics]) -> list[tuple[float, float, int]]:
    """(start, end, tokens) of each record's decode, in unix time: from its first token to its end."""
    spans = []
    for r in records:
        if r.ttft_s is None or not r.output_tokens:
            continue
        start = r.submitted_at + r.ttft_s
        spans.append((start, max(start, r.finished_at), r.output_tokens))
    return spans


def concurrency_series(records: list[RequestMetrics], bins: int = 120) -> pd.DataFrame:
    """Over the records' time span: how many answers were decoding at once, and the tokens per second they made
    together (each record's tokens spread evenly over its decode)."""
    spans = decode_intervals(records)
    if not spans:
        return pd.DataFrame({"time": [], "active": [], "tokens_per_s": []})
    first, last = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
    width = max((last - first) / bins, 0.5)
    edges = [first + i * width for i in range(int((last - first) / width) + 2)]
    active, rates = [], []
    for left in edges:
        right = left + width
        overlap = [(min(e, right) - max(s, left), e - s, n) for s, e, n in spans if s < right and e > left]
        active.append(sum(o for o, _, _ in overlap) / width)
        rates.append(sum(n * (o / d if d > 0 else 1.0) for o, d, n in overlap) / width)
    return pd.DataFrame({"time": [dt.datetime.fromtimestamp(t) for t in edges], "active": active,
                         "tokens_per_s": rates})


def concurrency_chart(records: list[RequestMetrics]) -> go.Figure:
    """Answers decoding at once and the tokens per second they made together, over time."""
    series = concurrency_series(records)
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(name="answers decoding at once", x=series["time"], y=series["active"], mode="lines",
                       line=dict(shape="hv", color="#4e79a7"), secondary_y=False)
    figure.add_scatter(name="tokens/s, all answers", x=series["time"], y=series["tokens_per_s"], mode="lines",
                       line=dict(color="#f28e2b"), secondary_y=True)
    figure.update_yaxes(title_text="answers at once", secondary_y=False, rangemode="tozero")
    figure.update_yaxes(title_text="tokens/s", secondary_y=True, rangemode="tozero")
    figure.update_layout(margin=dict(t=30, b=10), height=320)
    return figure

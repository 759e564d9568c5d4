"""Plotly figures of request metrics. Pure functions of the records, so they are tested without a browser."""
from __future__ import annotations

import datetime as dt
import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import RequestMetrics
from engine.records.stages import DECODE, FRAME_DECODE, PREFILL, QUEUE_WAIT, STAGES

GIB = 1 << 30
# One colour per name of QUEUE_WAIT + STAGES, in that order.
STAGE_COLOURS = dict(zip((QUEUE_WAIT,) + STAGES, ("#bab0ac", "#9c755f", "#d4a6c8", "#8cd17d", "#499894", "#b07aa1",
                                                  "#ff9da7", "#edc948", "#f28e2b", "#e15759", "#ff9d9a", "#4e79a7",
                                                  "#76b7b2", "#59a14f"), strict=True))


LABEL_WORDS = 4  # of a stored question, in a bar's label


def asked(record: RequestMetrics) -> str:
    """What the request was about, in a few words: a PDF's pages, a clip, pictures or text alone, and the question's
    first words where content is stored."""
    if record.document_pages:
        pages = [page.get("page") for page in record.document_pages]
        what = f"PDF p. {pages[0]}" + (f"-{pages[-1]}" if len(pages) > 1 else "")
    elif FRAME_DECODE in record.stages:
        what = "clip"
    elif record.image_sizes:
        count = len(record.image_sizes)
        what = "picture" if count == 1 else f"{count} pictures"
    else:
        what = "text"
    if record.warmup:
        what = f"warm-up, {what}"
    if record.prompt:
        words = html.escape(" ".join(record.prompt.split()[:LABEL_WORDS]))
        what += f": {words}{'…' if len(record.prompt.split()) > LABEL_WORDS else ''}"
    return what


def label(record: RequestMetrics) -> str:
    """A unique axis label of two lines: what was asked, then the time and the id's first characters."""
    return f"{asked(record)}<br>{dt.datetime.fromtimestamp(record.submitted_at):%H:%M:%S} {record.id[:6]}"


def label_line(record: RequestMetrics) -> str:
    """The label on one line, for a list to choose from."""
    return label(record).replace("<br>", " · ")


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


def records_frame(records: list[RequestMetrics], every_column: bool = False) -> pd.DataFrame:
    """The requests as a table: the columns that fit the page, or `every_column` for the whole record's figures."""
    rows = []
    for r in records:
        row = {
            "time": dt.datetime.fromtimestamp(r.submitted_at).strftime("%H:%M:%S"), "asked": asked(r),
            "status": r.status, "source": r.source, "dtype": r.dtype, "vision tokens": r.vision_tokens,
            "output tokens": r.output_tokens, "TTFT s": r.ttft_s, "tok/s": r.decode_tokens_per_s, "total s": r.e2e_s,
            "peak RSS GiB": r.rss_peak_bytes / GIB,
        }
        if r.replica:  # a cluster's record: which replica served it
            row["replica"] = r.replica
        if every_column:
            row.update({
                "id": r.id[:8], "warmup": r.warmup, "threads": r.threads, "synthetic": r.synthetic,
                "prompt tokens": r.prompt_tokens, "queue wait s": r.queue_wait_s, "decode GB/s": r.decode_gb_per_s,
                "batch": (sum(r.decode_batch_sizes) / len(r.decode_batch_sizes)) if r.decode_batch_sizes else None,
                "drafts kept": f"{r.drafts_kept}/{r.drafted_tokens}" if r.drafted_tokens else None,
                "forced tokens": r.forced_tokens or None, "paused s": r.paused_s, "error": r.error,
            })
        rows.append(row)
    return pd.DataFrame(rows)


# The page's table: two decimals where a value has them, so each column stays narrow.
RECORDS_COLUMNS = {name: {"format": "%.2f"} for name in ("TTFT s", "tok/s", "total s", "peak RSS GiB")}


def decode_intervals(records: list[RequestMetrics]) -> list[tuple[float, float, float]]:
    """(start, end, tokens per second) of each record's decode, in unix time: from its first token to its end."""
    spans = []
    for r in records:
        if r.ttft_s is None or not r.output_tokens:
            continue
        start = r.submitted_at + r.ttft_s
        end = max(start, r.finished_at)
        rate = r.decode_tokens_per_s or (r.output_tokens / (end - start) if end > start else 0.0)
        spans.append((start, end, rate))
    return spans


def concurrency_series(records: list[RequestMetrics]) -> pd.DataFrame:
    """How many answers were decoding at once, as whole counts, and the tokens per second they made together, from
    each moment an answer's decode began or ended to the next: a step function, not an average over bins."""
    spans = decode_intervals(records)
    moments = sorted({moment for start, end, _ in spans for moment in (start, end)})
    active, rates = [], []
    for moment in moments:
        running = [rate for start, end, rate in spans if start <= moment < end]
        active.append(len(running))
        rates.append(sum(running))
    return pd.DataFrame({"time": [dt.datetime.fromtimestamp(t) for t in moments], "active": active,
                         "tokens_per_s": rates})


def concurrency_chart(records: list[RequestMetrics]) -> go.Figure:
    """Answers decoding at once and the tokens per second they made together, over time."""
    series = concurrency_series(records)
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(name="answers decoding at once", x=series["time"], y=series["active"], mode="lines",
                       line=dict(shape="hv", color="#4e79a7"), secondary_y=False)
    figure.add_scatter(name="tokens/s, all answers", x=series["time"], y=series["tokens_per_s"], mode="lines",
                       line=dict(shape="hv", color="#f28e2b"), secondary_y=True)
    figure.update_yaxes(title_text="answers at once", secondary_y=False, rangemode="tozero", dtick=1,
                        tickformat="d")
    figure.update_yaxes(title_text="tokens/s", secondary_y=True, rangemode="tozero")
    figure.update_layout(margin=dict(t=30, b=10), height=320)
    return figure

"""GET /metrics in Prometheus' text format, from the metrics database and the live process."""
from __future__ import annotations

from engine import STAGES, MetricsStore
from engine.metrics import current_rss

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _labels(**labels) -> str:
    inner = ",".join(f'{k}="{str(v).replace(chr(34), "")}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def render(store: MetricsStore, queue_depth: int, weight_bytes: int, ready: bool) -> str:
    records = [r for r in store.between(0) if not r.warmup]
    lines = ["# HELP vlscope_requests_total Requests recorded, by status and source.",
             "# TYPE vlscope_requests_total counter"]
    counts: dict[tuple[str, str], int] = {}
    for record in records:
        counts[(record.status, record.source)] = counts.get((record.status, record.source), 0) + 1
    for (status, source), count in sorted(counts.items()):
        lines.append(f"vlscope_requests_total{_labels(status=status, source=source)} {count}")
    lines += ["# HELP vlscope_stage_seconds Seconds per request stage.", "# TYPE vlscope_stage_seconds histogram"]
    for stage in STAGES + ("ttft", "e2e"):
        values = [r.ttft_s if stage == "ttft" else r.e2e_s if stage == "e2e" else r.stages.get(stage)
                  for r in records]
        values = [v for v in values if v is not None]
        for bound in BUCKETS:
            lines.append(f"vlscope_stage_seconds_bucket{_labels(stage=stage, le=bound)} "
                         f"{sum(v <= bound for v in values)}")
        lines.append(f"vlscope_stage_seconds_bucket{_labels(stage=stage, le='+Inf')} {len(values)}")
        lines.append(f"vlscope_stage_seconds_sum{_labels(stage=stage)} {sum(values)}")
        lines.append(f"vlscope_stage_seconds_count{_labels(stage=stage)} {len(values)}")
    lines += [
        "# HELP vlscope_rss_bytes Resident memory of the server process.", "# TYPE vlscope_rss_bytes gauge",
        f"vlscope_rss_bytes {current_rss()}",
        "# HELP vlscope_queue_depth Requests waiting or running.", "# TYPE vlscope_queue_depth gauge",
        f"vlscope_queue_depth {queue_depth}",
        "# HELP vlscope_weight_bytes Model weights in memory.", "# TYPE vlscope_weight_bytes gauge",
        f"vlscope_weight_bytes {weight_bytes}",
        "# HELP vlscope_model_ready 1 when the model is loaded.", "# TYPE vlscope_model_ready gauge",
        f"vlscope_model_ready {int(ready)}",
    ]
    return "\n".join(lines) + "\n"

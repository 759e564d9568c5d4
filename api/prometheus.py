"""GET /metrics in Prometheus' text format, from the metrics database and the live process.

Counters are kept as requests finish: each scrape reads only the records written since the one before, so a scrape
costs the same at 50,000 stored records as at 50."""
from __future__ import annotations

import threading

from engine import STAGES, MetricsStore, RequestMetrics
from engine.records.metrics import current_rss

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SERIES = STAGES + ("ttft", "e2e")


def _labels(**labels) -> str:
    inner = ",".join(f'{k}="{str(v).replace(chr(34), "")}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


class Counters:
    """Request counts and stage histograms of one metrics database, folded in as records arrive."""

    def __init__(self):
        self.row = 0  # the newest row of the database already counted
        self.requests: dict[tuple[str, str], int] = {}
        self.buckets = {series: [0] * len(BUCKETS) for series in SERIES}
        self.sums = dict.fromkeys(SERIES, 0.0)
        self.counts = dict.fromkeys(SERIES, 0)
        self.decode_rate = 0.0  # the newest finished request's decode tokens a second
        self.lock = threading.Lock()

    def fold(self, store: MetricsStore) -> None:
        with self.lock:
            records, self.row = store.finished_since(self.row)
            for record in records:
                if not record.warmup:
                    self._add(record)

    def _add(self, record: RequestMetrics) -> None:
        key = (record.status, record.source)
        self.requests[key] = self.requests.get(key, 0) + 1
        if record.decode_tokens_per_s:
            self.decode_rate = record.decode_tokens_per_s
        for series in SERIES:
            value = record.ttft_s if series == "ttft" else record.e2e_s if series == "e2e" else record.stages.get(series)
            if value is None:
                continue
            self.sums[series] += value
            self.counts[series] += 1
            for index, bound in enumerate(BUCKETS):
                if value <= bound:
                    self.buckets[series][index] += 1


_counters: dict[str, Counters] = {}


def render(store: MetricsStore, queue_depth: int, weight_bytes: int, ready: bool, active: int = 0,
           batch_limit: int = 0, guard_refusals: dict[str, int] | None = None) -> str:
    counters = _counters.setdefault(str(store.path), Counters())
    counters.fold(store)
    lines = ["# HELP vlscope_requests_total Requests recorded, by status and source.",
             "# TYPE vlscope_requests_total counter"]
    for (status, source), count in sorted(counters.requests.items()):
        lines.append(f"vlscope_requests_total{_labels(status=status, source=source)} {count}")
    lines += ["# HELP vlscope_guard_refusals_total Requests the server guard turned away (bad keys, foreign hosts), "
              "each counted; only the first of a kind in a minute is recorded.",
              "# TYPE vlscope_guard_refusals_total counter"]
    lines += [f"vlscope_guard_refusals_total{_labels(kind=kind)} {count}"
              for kind, count in sorted((guard_refusals or {}).items())]
    lines += ["# HELP vlscope_stage_seconds Seconds per request stage.", "# TYPE vlscope_stage_seconds histogram"]
    for series in SERIES:
        for bound, count in zip(BUCKETS, counters.buckets[series]):
            lines.append(f"vlscope_stage_seconds_bucket{_labels(stage=series, le=bound)} {count}")
        lines.append(f"vlscope_stage_seconds_bucket{_labels(stage=series, le='+Inf')} {counters.counts[series]}")
        lines.append(f"vlscope_stage_seconds_sum{_labels(stage=series)} {counters.sums[series]}")
        lines.append(f"vlscope_stage_seconds_count{_labels(stage=series)} {counters.counts[series]}")
    lines += [
        "# HELP vlscope_rss_bytes Resident memory of the server process.", "# TYPE vlscope_rss_bytes gauge",
        f"vlscope_rss_bytes {current_rss()}",
        "# HELP vlscope_decode_tokens_per_second Decode rate of the newest request that decoded.",
        "# TYPE vlscope_decode_tokens_per_second gauge",
        f"vlscope_decode_tokens_per_second {counters.decode_rate:.3f}",
        "# HELP vlscope_queue_depth Requests waiting or running.", "# TYPE vlscope_queue_depth gauge",
        f"vlscope_queue_depth {queue_depth}",
        "# HELP vlscope_batch_active Sequences decoding together now.", "# TYPE vlscope_batch_active gauge",
        f"vlscope_batch_active {active}",
        "# HELP vlscope_batch_limit Sequences that may decode together (VLSCOPE_MAX_BATCH).",
        "# TYPE vlscope_batch_limit gauge",
        f"vlscope_batch_limit {batch_limit}",
        "# HELP vlscope_batch_occupancy Active sequences over the batch limit.",
        "# TYPE vlscope_batch_occupancy gauge",
        f"vlscope_batch_occupancy {active / batch_limit if batch_limit else 0.0:.4f}",
        "# HELP vlscope_weight_bytes Model weights in memory.", "# TYPE vlscope_weight_bytes gauge",
        f"vlscope_weight_bytes {weight_bytes}",
        "# HELP vlscope_model_ready 1 when the model is loaded.", "# TYPE vlscope_model_ready gauge",
        f"vlscope_model_ready {int(ready)}",
    ]
    return "\n".join(lines) + "\n"

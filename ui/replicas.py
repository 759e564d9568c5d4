"""The replicas of a cluster side by side, from the /metrics text its front serves (each sample labelled by replica)."""
from __future__ import annotations

from collections import defaultdict

import streamlit as st
from prometheus_client.parser import text_string_to_metric_families

from engine.records.stages import STAGES

GIB = 1 << 30


def replica_rows(text: str) -> list[dict]:
    """One row a replica: requests, queue, decoding, decode rate, RSS and mean seconds of each stage it ran."""
    rows: dict[str, dict] = defaultdict(lambda: {"requests": 0, "queue": 0, "decoding": 0, "decode tok/s": 0.0,
                                                 "RSS GiB": 0.0})
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    gauges = {"vlscope_queue_depth": "queue", "vlscope_batch_active": "decoding",
              "vlscope_decode_tokens_per_second": "decode tok/s", "vlscope_rss_bytes": "RSS GiB"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica is None:
                continue
            row = rows[replica]
            if sample.name == "vlscope_requests_total":
                row["requests"] += int(sample.value)
            elif sample.name in gauges:
                row[gauges[sample.name]] = sample.value / GIB if sample.name == "vlscope_rss_bytes" else sample.value
            elif sample.name in ("vlscope_stage_seconds_sum", "vlscope_stage_seconds_count"):
                sums[replica, sample.labels["stage"]][sample.name.endswith("_count")] += sample.value
    for (replica, stage), (total, count) in sums.items():
        if count and (stage in STAGES or stage == "ttft"):
            rows[replica][f"{stage} s"] = total / count
    return [{"replica": replica, **row} for replica, row in rows.items()]


def render_replicas(text: str | None) -> bool:
    """The table, when the server behind the remote backend is a cluster (then True); nothing otherwise."""
    rows = replica_rows(text) if text else []
    if not rows:
        return False
    st.subheader(f"Replicas ({len(rows)})")
    st.caption("Each replica of the cluster this app fronts, from its metrics: mean seconds per stage over the "
               "requests it served. Every request's record is in the cluster's one store: \"Whole cluster\" "
               "below shows them.")
    st.dataframe(rows, hide_index=True, key="table_replicas",
                 column_config={"RSS GiB": st.column_config.NumberColumn(format="%.2f"),
                                "decode tok/s": st.column_config.NumberColumn(format="%.1f")})
    return True

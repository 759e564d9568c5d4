"""Profiling page: every request from every session, live from the metrics database."""
import time
from collections import Counter

import streamlit as st

from engine import DTYPES, STATUSES, stage_percentiles, to_csv
from engine.records.stages import REFUSED
from engine.remote import RemoteEngine
from engine.machine import ISA_FLAGS, system_report
from ui.charts import (RECORDS_COLUMNS, concurrency_chart, label_line, latency_over_time, records_frame, rss_chart,
                       server_stages, stage_bars, token_latency_chart)
from server.slot import engine_slot, get_store
from ui.replicas import render_replicas

MAX_ROWS_READ = 2_000  # rows one refresh reads
WINDOWS = {"last 15 minutes": 15 * 60, "last hour": 3600, "last 24 hours": 86400, "all": None}
GIB = 1 << 30

st.title("Profiling")
controls = st.columns([2, 3, 2, 2])
window = controls[0].selectbox("Time window", list(WINDOWS), index=1, key="prof_window")
statuses = controls[1].multiselect("Status", list(STATUSES), default=list(STATUSES), key="prof_status")
sources = controls[2].multiselect("Source", ["app", "api", "cli", "bench", "python", "warmup"], key="prof_source",
                                  placeholder="all sources")
dtypes = controls[3].multiselect("Precision", [*DTYPES, "remote"], key="prof_dtype",
                                 placeholder="all precisions")
switches = st.columns([1, 1, 1, 3])
show_warmups = switches[0].toggle("Show warm-ups", value=False, key="prof_warmups")
live = switches[1].toggle("Live", value=True, key="prof_live", help="Refresh every 2 seconds; off to pause.")
whole_cluster = switches[2].toggle("Whole cluster", value=True, key="prof_cluster",
                                   help="When this app fronts a vlscope cluster: every replica's records from the "
                                        "cluster's store; off, this app's own records of its requests.")


def read_ceiling() -> float | None:
    """The loaded engine's memory read rate, measured at its load on its compute thread (None for a remote one)."""
    loaded = engine_slot().loaded
    return loaded.engine.info.read_ceiling_gb_per_s if loaded is not None else None


@st.fragment(run_every=2 if live else None)
def live_view() -> None:
    loaded = engine_slot().loaded
    remote = loaded.engine if loaded is not None and isinstance(loaded.engine, RemoteEngine) else None
    cluster = remote is not None and render_replicas(remote.server_metrics())
    store = get_store()
    seconds = WINDOWS[window]
    # The newest rows only: a refresh every 2 s costs the same at a million stored records as at a thousand.
    since = time.time() - seconds if seconds else 0.0
    served = remote.cluster_records(since, MAX_ROWS_READ) if cluster and whole_cluster else None
    if cluster and whole_cluster:
        st.subheader("Every request the cluster served" if served else "The cluster's records could not be read")
    records, total = served or (store.between(since, limit=MAX_ROWS_READ), None)
    if len(records) == MAX_ROWS_READ:
        total = total if total is not None else store.count_since(since)
        st.caption(f"The newest {MAX_ROWS_READ:,} of {total:,} requests in this window are shown and exported.")
    records = [r for r in records if r.status in statuses and (show_warmups or not r.warmup)
               and (not sources or r.source in sources) and (not dtypes or r.dtype in dtypes)]
    if store.last_error:
        st.error(store.last_error)
    if not records:
        st.info("No requests in this window yet. Ask something on the Chat page; it shows up here within seconds.")
        return
    latest = records[0]
    # Units go in the labels: a value in a sixth of the page fits only as a bare number.
    top = st.columns(6)
    top[0].metric("requests", len(records))
    top[1].metric("last TTFT s", f"{latest.ttft_s:.2f}" if latest.ttft_s is not None else "–")
    top[2].metric("last decode tok/s", f"{latest.decode_tokens_per_s:.1f}" if latest.decode_tokens_per_s else "–")
    top[3].metric("last total s", f"{latest.e2e_s:.1f}")
    top[4].metric("last peak RSS GiB", f"{latest.rss_peak_bytes / GIB:.2f}")
    rate = latest.decode_gb_per_s
    ceiling = read_ceiling() if rate else None
    top[5].metric("last read GB/s", f"{rate:.1f}" if rate else "–",
                  delta=f"{rate / ceiling:.0%} of {ceiling:.0f}" if rate and ceiling else None,
                  delta_color="off", delta_arrow="off",
                  help="Weights one decode step reads (the language model and its head) times tokens per second, "
                       "against this machine's memory read rate, measured at load on the engine's compute thread: "
                       "decode cannot go faster than that.")

    shown = records[:60]  # the newest; older ones stay in the table and the CSV
    st.subheader("Where the time went, per request")
    st.plotly_chart(stage_bars(shown), key="chart_stages")
    reported = [r for r in shown if server_stages(r)]
    if reported:
        st.subheader("As the remote server reports it")
        st.caption("Requests served by a remote backend: above, what this client measured (upload, first token, "
                   "decode); here, the server's own stage timings.")
        st.plotly_chart(stage_bars(reported, stages_of=server_stages), key="chart_server_stages")
    left, right = st.columns(2)
    with left:
        st.subheader("Memory (RSS) per request")
        st.plotly_chart(rss_chart(shown), key="chart_rss")
    with right:
        st.subheader("p50 / p95 per stage")
        summary = stage_percentiles(records)
        st.dataframe({"stage": list(summary), "p50 s": [v[50] for v in summary.values()],
                      "p95 s": [v[95] for v in summary.values()]}, hide_index=True, key="table_percentiles")
    st.subheader("TTFT and decode speed over time")
    st.plotly_chart(latency_over_time(records), key="chart_over_time")
    st.subheader("Answers at once and the tokens they make together")
    st.caption("Requests decode together, one token each per step: a step for several costs little more than "
               "a step for one.")
    st.plotly_chart(concurrency_chart(records), key="chart_concurrency")

    with_tokens = [r for r in records if r.token_latencies_s]
    if with_tokens:
        st.subheader("Per-token decode latency")
        chosen = st.selectbox("Request", with_tokens, format_func=label_line, key="token_request")
        st.plotly_chart(token_latency_chart(chosen), key="chart_tokens")

    refused = Counter(r.error_type or "unknown" for r in records if r.status == REFUSED)
    if refused:
        st.subheader("Refused, by kind")
        st.caption("Requests turned away before any model compute: bad input, a missing key, a full queue.")
        st.dataframe({"kind": list(refused), "requests": list(refused.values())}, hide_index=True,
                     key="table_refused")

    st.subheader("Requests")
    every_column = st.toggle("Every column", key="prof_every_column",
                             help="Queue wait, pauses, batch sizes, drafts, errors, ...; the CSV has them all.")
    st.dataframe(records_frame(records, every_column), hide_index=True, key="table_requests",
                 column_config={name: st.column_config.NumberColumn(format=spec["format"])
                                for name, spec in RECORDS_COLUMNS.items()})
    st.download_button("Download CSV", to_csv(records), file_name="vlscope-requests.csv", mime="text/csv",
                       key="download_csv")


live_view()

with st.expander("System", icon=":material/memory:"):
    report = system_report()
    st.markdown(
        f"**CPU** {report.cpu_model} · {report.physical_cores} physical / {report.logical_cores} logical cores  \n"
        f"**ISA** {', '.join(ISA_FLAGS[f] for f in report.isa_flags) or 'none of note'}  \n"
        f"**Transparent huge pages** {report.transparent_hugepages} · **torch threads** {report.torch_threads}  \n"
        f"**torch** {report.torch_version} · **transformers** {report.transformers_version}  \n"
        f"**Memory** {report.memory_available_bytes / GIB:.1f} GiB free of {report.memory_total_bytes / GIB:.1f} GiB"
    )
    for tip in report.advice:
        st.info(tip, icon=":material/lightbulb:")

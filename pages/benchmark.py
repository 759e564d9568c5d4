"""Benchmark page: a small sweep on the loaded model, the CPU's precision advice, and the latest full bench."""
import dataclasses
import json

import streamlit as st

from engine.config import PROJECT_DIR
from engine.machine import cpu_kind_name, system_report
from speed.advice import advise
from speed.record import REFRESH, describe, reference_result
from speed.sweep import SAMPLES_DIR, sweep_on_engine
from speed.tables import cases_table, markdown_report, report_figure
from ui.engine_resource import get_engine

st.title("Benchmark")
st.caption("Measured on this server, now. The full sweep (every precision, the plain-transformers baseline, "
           "threads, image sizes, drift against float32) runs from the shell: `python -m bench`.")

loaded = get_engine(show_problems=False)
left, right = st.columns(2)
with left:
    st.subheader("Small sweep on the loaded model")
    st.write("Two image sizes and a three-question conversation, 16 tokens each. Other users wait while it runs.")
    if loaded is not None and st.button("Run the sweep", key="run_sweep", type="primary"):
        bar = st.progress(0.0, text="starting")
        try:
            st.session_state["sweep"] = sweep_on_engine(
                loaded.engine, SAMPLES_DIR, lambda fraction, message: bar.progress(fraction, text=message)).to_dict()
        except Exception as exc:  # a busy queue or a refused request: say so, keep the page
            st.error(f"The sweep stopped: {exc}")
        bar.empty()
with right:
    st.subheader("Precision advice for this CPU")
    reference = reference_result()
    record = json.loads(reference.path.read_text()) if reference is not None and reference.same_kind else None
    measured = (record or {}).get("precision_advice") or {}
    if measured.get("recommended", "–") != "–":
        st.success(f"Recommended: **{measured['recommended']}** (the default stays float32), from every "
                   "precision end to end on this CPU and their drift against float32.")
        for reason in measured["reasons"]:
            st.markdown(f"- {reason}")
        st.caption(describe(record))
    else:
        st.write(f"No benchmark of every precision on a CPU of this kind yet: `{REFRESH}` measures them end to "
                 "end with their drift and recommends from that.")
    if st.button("Quick probe: float32 against bfloat16 matmul", key="run_advice"):
        with st.spinner("Probing matmul and weight streaming…"):
            st.session_state["advice"] = dataclasses.asdict(advise())
    advice = st.session_state.get("advice")
    if advice:
        st.info(f"The probe favours **{advice['recommended']}** for matmul alone.")
        for reason in advice["reasons"]:
            st.markdown(f"- {reason}")

def show(document: dict, key: str) -> None:
    st.plotly_chart(report_figure(document), key=key)
    st.dataframe(cases_table(document), hide_index=True, key=f"{key}_table")
    with st.expander("Full report: every column, drift, precision advice"):
        st.markdown(markdown_report(document))
    st.download_button("Download JSON", json.dumps(document, indent=1, default=str), file_name="bench.json",
                       mime="application/json", key=f"{key}_json")


if "sweep" in st.session_state:
    st.divider()
    show(st.session_state["sweep"], "sweep_chart")

reference = reference_result()
if reference is not None:
    here = system_report().cpu_kind
    st.divider()
    record = json.loads(reference.path.read_text())
    st.subheader(f"Benchmark on record for {cpu_kind_name(reference.kind)} CPUs")
    st.caption(f"`{reference.path.relative_to(PROJECT_DIR)}`. {describe(record)}")
    if not reference.same_kind:
        st.info(f"Measured on a CPU of another kind ({cpu_kind_name(reference.kind)}) than this one "
                f"({cpu_kind_name(here)}): `{REFRESH}` here measures this one and makes its record.",
                icon=":material/info:")
    show(record, "latest_chart")

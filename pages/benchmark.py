"""Benchmark page: a small sweep on the loaded model beside the record for this CPU kind, and the precision advice."""
import dataclasses
import json

import streamlit as st

from engine.config import PROJECT_DIR
from engine.machine import cpu_kind_name, system_report
from speed.advice import advise
from speed.record import REFRESH, describe, reference_result
from speed.sweep import SAMPLES_DIR, sweep_on_engine
from speed.tables import against_record, cases_table, markdown_report, report_figure
from ui.engine_resource import get_engine

WHY_FLOAT32 = ("The default stays float32 by design: the case study vlscope comes from lost OCR accuracy in int8 on "
               "CPUs without native support, so a compact precision is a choice to make after checking its answers.")

st.title("Benchmark")
st.caption("Measured on this server, now, beside the benchmark on record for CPUs of this kind. The full sweep "
           "(every precision, the plain-transformers baseline, threads, image sizes, drift against float32) runs "
           "from the shell: `python -m bench`.")

loaded = get_engine(show_problems=False)
reference = reference_result()
record = json.loads(reference.path.read_text()) if reference is not None else None
here = system_report().cpu_kind


def show(document: dict, key: str) -> None:
    st.plotly_chart(report_figure(document), key=key)
    st.dataframe(cases_table(document), hide_index=True, key=f"{key}_table")
    with st.expander("Full report: every column, drift, precision advice"):
        st.markdown(markdown_report(document))
    st.download_button("Download JSON", json.dumps(document, indent=1, default=str), file_name="bench.json",
                       mime="application/json", key=f"{key}_json")


left, right = st.columns(2)
with left:
    st.subheader("This server, now")
    st.write("A small sweep on the loaded model: two image sizes and a three-question conversation, 16 tokens each. "
             "Other users wait while it runs.")
    if loaded is not None and st.button("Run the sweep", key="run_sweep", type="primary"):
        bar = st.progress(0.0, text="starting")
        try:
            st.session_state["sweep"] = sweep_on_engine(
                loaded.engine, SAMPLES_DIR, lambda fraction, message: bar.progress(fraction, text=message)).to_dict()
        except Exception as exc:  # a busy queue or a refused request: say so, keep the page
            st.error(f"The sweep stopped: {exc}")
        bar.empty()
    sweep = st.session_state.get("sweep")
    rows = against_record(sweep, record) if sweep and record else []
    if rows:
        st.dataframe([{k: v for k, v in row.items() if k != "same model"} for row in rows], hide_index=True,
                     key="sweep_against_record",
                     column_config={name: st.column_config.NumberColumn(format="%.2fx")
                                    for name in ("TTFT x", "tok/s x")})
        st.caption(f"At {sweep['cases'][0]['case']['dtype']}, now / on record, and the ratio: first token below 1x "
                   "and decode above 1x are faster now."
                   + ("" if all(row["same model"] for row in rows) else
                      " The loaded model is not the one on record (its weights differ in size): the ratios "
                      "compare two models.")
                   + ("" if reference.same_kind else " The record is from a CPU of another kind."))
    elif sweep:
        st.caption("No benchmark on record to set it beside: its cases follow below.")
with right:
    st.subheader("On record, and the precision it recommends")
    same_kind_record = record if reference is not None and reference.same_kind else None
    measured = (same_kind_record or {}).get("precision_advice") or {}
    if measured.get("recommended", "–") != "–":
        st.success(f"Recommended here: **{measured['recommended']}**, from every precision end to end on this CPU "
                   "and their drift against float32.")
        st.caption(WHY_FLOAT32)
        for reason in measured["reasons"]:
            st.markdown(f"- {reason}")
        st.caption(describe(same_kind_record))
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

if sweep:
    st.divider()
    st.subheader("This server's sweep, case by case")
    show(sweep, "sweep_chart")

if reference is not None:
    st.divider()
    st.subheader(f"Benchmark on record for {cpu_kind_name(reference.kind)} CPUs")
    st.caption(f"`{reference.path.relative_to(PROJECT_DIR)}`. {describe(record)}")
    if not reference.same_kind:
        st.info(f"Measured on a CPU of another kind ({cpu_kind_name(reference.kind)}) than this one "
                f"({cpu_kind_name(here)}): `{REFRESH}` here measures this one and makes its record.",
                icon=":material/info:")
    show(record, "latest_chart")

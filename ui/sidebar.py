"""The sidebar every page shows: what is loaded, what it weighs, what the process holds now."""
from __future__ import annotations

import streamlit as st

from engine.metrics import current_rss

from .engine_resource import LoadedEngine

GIB = 1 << 30


def render_status(loaded: LoadedEngine | None) -> None:
    with st.sidebar:
        if loaded is None:
            st.caption("No model loaded.")
            return
        engine, info = loaded.engine, loaded.engine.info
        if info.synthetic:
            st.warning("Synthetic weights: answers are noise, latency and memory are real.",
                       icon=":material/science:")
        if loaded.fallback_reason:
            with st.expander("Why, and how to load the real model"):
                st.caption(f"The configured model {engine.config.model!r} could not be loaded, so the synthetic "
                           f"skeleton stands in. {loaded.fallback_reason}")
        st.markdown(f"**Model** `{info.model}`")
        left, right = st.columns(2)
        left.metric("dtype", info.dtype, help=f"Weights in {info.dtype}; activations, attention and the KV cache "
                    f"in {info.compute_dtype}, chosen by measuring this CPU unless set in Settings")
        right.metric("threads", info.threads)
        left.metric("weights", f"{info.weight_bytes / GIB:.2f}G", help="Model weights in memory, GiB")
        right.metric("RSS", f"{current_rss() / GIB:.2f}G", help="This server process's resident memory, GiB")
        st.caption(f"Queue: {engine.queue_depth} request(s) · loaded in {info.load_seconds:.1f} s")
        if engine.store.last_error:
            st.error(f"Metrics are not being saved: {engine.store.last_error}")

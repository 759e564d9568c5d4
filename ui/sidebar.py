"""The sidebar every page shows: what is loaded, what it weighs, what the process holds now."""
from __future__ import annotations

import streamlit as st

from engine.records.metrics import current_rss
from server.signed_in import exposed_without_sign_in
from server.slot import LoadedEngine

from .access import is_admin

GIB = 1 << 30


def render_status(loaded: LoadedEngine | None) -> None:
    with st.sidebar:
        if is_admin() and exposed_without_sign_in():
            st.warning("Open to the network: no API key and no sign-in.", icon=":material/lock_open:")
            with st.expander("How to lock it down"):
                st.caption("This server listens beyond loopback and anyone who reaches it may use the app and the "
                           "API. Set VLSCOPE_API_KEYS for the API and VLSCOPE_APP_PASSWORD (or an [auth] table) for "
                           "the app, or listen on loopback only (--server.address 127.0.0.1). docs/hosting.md.")
        if loaded is None:
            st.caption("No model loaded.")
            return
        engine, info = loaded.engine, loaded.engine.info
        if info.synthetic:
            st.warning("Synthetic weights: answers are noise, latency and memory are real.",
                       icon=":material/science:")
            with st.expander("Why, and how to load the real model"):
                st.caption(what_is_loaded(loaded))
        st.markdown(f"**Model** `{info.model}`")
        # The precision gets the sidebar's width: "bfloat16" does not fit in half of it.
        st.metric("precision", info.dtype, help=f"Weights in {info.dtype}; activations, attention and the KV cache "
                  f"in {info.compute_dtype}, chosen by measuring this CPU unless set in Settings")
        left, right = st.columns(2)
        left.metric("weights GiB", f"{info.weight_bytes / GIB:.2f}", help="Model weights in memory")
        right.metric("RSS GiB", f"{current_rss() / GIB:.2f}", help="This server process's resident memory")
        st.caption(f"Queue: {engine.queue_depth} request(s), {engine.active_sequences} of {engine.batch_limit()} "
                   f"answering together · {info.threads} threads · loaded in {info.load_seconds:.1f} s")
        if info.decode:  # empty for a remote engine
            st.caption(decode_line(info.decode, engine.store.recent(1, include_warmup=False)))
            with st.expander("How decode runs here"):
                st.caption(info.decode)
                for note in info.notes:
                    st.caption(f":material/info: {note}")
        if engine.store.last_error:
            st.error(f"Metrics are not being saved: {engine.store.last_error}")


def what_is_loaded(loaded: LoadedEngine) -> str:
    """One honest sentence of which model answers and why, and how to load the real weights from the page."""
    info = loaded.engine.info
    if not info.synthetic:
        return f"The model's own weights, from `{info.model}`."
    how = ("To load the real weights, put Qwen3-VL-2B-Instruct's files in a folder on this server and enter that "
           "folder as the Model on the Settings page.")
    if loaded.fallback_reason:
        return (f"The bundled skeleton answers (the real architecture, tokenizer and chat template, synthetic "
                f"weights): the configured model `{loaded.configured_model}` could not be loaded, as "
                f"{loaded.fallback_reason}. {how}")
    return (f"`{info.model}` has the real architecture, tokenizer and chat template but no weights, so they are "
            f"synthetic. {how}")


def decode_line(decode: str, latest: list) -> str:
    """One plain line for a room: compiled or eager, and the last answer's speed."""
    kind = "compiled" if decode.startswith("compiled") else "eager"
    rate = latest[0].decode_tokens_per_s if latest and latest[0].decode_tokens_per_s else None
    return f"Decode: {kind}, {rate:.1f} tok/s on the last answer" if rate else f"Decode: {kind}"

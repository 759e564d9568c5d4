"""The shared engine for a page, with a progress bar while it loads and a retry button when it failed."""
from __future__ import annotations

import streamlit as st

from server.slot import LoadedEngine, engine_slot, ensure_loaded, retry_loading


def get_engine(show_problems: bool = True) -> LoadedEngine | None:
    """The shared engine for a page: loads it with a progress bar if needed; on failure a message and a retry.

    The router shows load problems; pages pass show_problems=False so the message and its button appear once."""
    slot = engine_slot()
    if slot.ready:
        return slot.loaded
    loaded = None
    if slot.error is None:
        bar = st.empty()
        if slot.loading:
            bar.info("The model is loading (started elsewhere)…", icon=":material/hourglass:")

        def progress(fraction: float, message: str) -> None:
            bar.progress(min(max(fraction, 0.0), 1.0), text=f"Loading model: {message}")

        loaded = ensure_loaded(progress)
        bar.empty()
    if loaded is None and slot.error is not None and show_problems:
        st.error(f"The model could not be loaded. {slot.error}", icon=":material/error:")
        if st.button("Retry loading", key="retry_load"):
            retry_loading()
            st.rerun()
    return loaded

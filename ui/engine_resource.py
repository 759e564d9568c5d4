"""The shared engine for a page, with a progress bar while it loads and a retry button when it failed."""
from __future__ import annotations

import threading
import time

import streamlit as st

from server.slot import LoadedEngine, LoadProgress, engine_slot, ensure_loaded, retry_loading

LOAD_POLL_S = 0.5  # how often a page redraws the load's progress


def load_text(progress: LoadProgress) -> str:
    """The progress bar's words: what the load is doing and how long it has run."""
    return f"Loading the model, {progress.elapsed_s:.0f} s so far: {progress.message}"


def get_engine(show_problems: bool = True) -> LoadedEngine | None:
    """The shared engine for a page: loads it with a progress bar if needed; on failure a message and a retry.

    The router shows load problems; pages pass show_problems=False so the message and its button appear once."""
    slot = engine_slot()
    if slot.ready:
        return slot.loaded
    if slot.error is None:
        # The load runs on a thread of its own: the page redraws its progress and elapsed time while it runs, a page
        # that opens meanwhile shows the same, and leaving the page does not stop it.
        if not slot.loading:
            threading.Thread(target=ensure_loaded, name="vlscope-load", daemon=True).start()
        bar = st.empty()
        while not slot.ready and slot.error is None:
            progress = slot.progress or LoadProgress()
            bar.progress(min(max(progress.fraction, 0.0), 1.0), text=load_text(progress))
            time.sleep(LOAD_POLL_S)
        bar.empty()
    loaded = slot.loaded if slot.ready else None
    if loaded is None and slot.error is not None and show_problems:
        st.error(f"The model could not be loaded. {slot.error}", icon=":material/error:")
        if st.button("Retry loading", key="retry_load"):
            retry_loading()
            st.rerun()
    return loaded

"""One engine per server process, shared by every session, with a progress bar while it loads.

The current settings live in a shared holder: a change on the settings page swaps the engine for everyone.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import threading
from dataclasses import dataclass

import streamlit as st

from engine import Engine, EngineConfig, MetricsStore, ModelUnavailable, SKELETON_DIR

from .settings import configured_settings

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    engine: Engine
    fallback_reason: str | None  # why the synthetic skeleton stands in for the configured model


class SharedSettings:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.lock = threading.Lock()


@st.cache_resource(show_spinner=False)
def shared_settings() -> SharedSettings:
    return SharedSettings(configured_settings())


def _key(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def _release(loaded: LoadedEngine) -> None:
    loaded.engine.close()


@st.cache_resource(show_spinner=False, max_entries=1, on_release=_release)
def _load(config_key: str, _config: EngineConfig, _progress) -> LoadedEngine:
    try:
        return LoadedEngine(Engine(_config, progress=_progress), None)
    except ModelUnavailable as exc:
        if _config.model == str(SKELETON_DIR):
            raise
        # No weights reachable: start on the bundled skeleton and say so, rather than failing.
        fallback = _config.replace(model=str(SKELETON_DIR))
        return LoadedEngine(Engine(fallback, progress=_progress), exc.message)


def get_engine() -> LoadedEngine | None:
    """The shared engine, loading it with a progress bar if needed. On failure: a message, a retry, and None."""
    config = shared_settings().config
    bar = st.empty()

    def progress(fraction: float, message: str) -> None:
        bar.progress(min(max(fraction, 0.0), 1.0), text=f"Loading model: {message}")

    try:
        loaded = _load(_key(config), config, progress)
    except Exception as exc:  # any load failure is shown on the page; the server keeps serving
        log.exception("model load failed")
        bar.empty()
        message = exc.message if hasattr(exc, "message") else f"{type(exc).__name__}: {exc}"
        st.error(f"The model could not be loaded. {message}")
        if st.button("Retry loading", key="retry_load"):
            _load.clear()
            st.rerun()
        return None
    bar.empty()
    return loaded


def apply_settings(config: EngineConfig) -> None:
    """Swap in new settings; the old engine is released first so two models never sit in memory together."""
    holder = shared_settings()
    with holder.lock:
        if config == holder.config:
            return
        holder.config = config
        _load.clear()
        gc.collect()


@st.cache_resource(show_spinner=False)
def _store(path: str) -> MetricsStore:
    return MetricsStore(path)


def get_store() -> MetricsStore:
    """The metrics database alone: the profiling page works even when the model failed to load."""
    return _store(shared_settings().config.db_path)

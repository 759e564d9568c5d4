"""One engine per server process, shared by every session, with a progress bar while it loads.

The engine sits in a process-wide slot (st.cache_resource holds the slot, not the load: a cached function must not
draw, and the load draws its progress). The current settings live beside it; a change swaps the engine for everyone.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st

from engine import SKELETON_DIR, Engine, EngineConfig, MetricsStore, ModelUnavailable
from engine.model_loading import looks_like_hub_id

from .settings import configured_settings

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    engine: Engine
    fallback_reason: str | None  # why the synthetic skeleton stands in for the configured model


@dataclass
class EngineSlot:
    config: EngineConfig  # the settings in force for every session
    loaded: LoadedEngine | None = None
    loaded_config: EngineConfig | None = None
    error: str | None = None  # the last load failure for `config`; cleared by a retry
    lock: threading.Lock = field(default_factory=threading.Lock)


@st.cache_resource(show_spinner=False)
def engine_slot() -> EngineSlot:
    return EngineSlot(configured_settings())


def fallback_model() -> str:
    return os.environ.get("VLSCOPE_FALLBACK_MODEL") or str(SKELETON_DIR)


def build_engine(config: EngineConfig, progress) -> LoadedEngine:
    try:
        return LoadedEngine(Engine(config, progress=progress), None)
    except ModelUnavailable as exc:
        # A hub id whose weights cannot be reached: start on the bundled skeleton and say so, rather than failing.
        # A local folder that is wrong is the operator's mistake to see and fix, so that error is shown instead.
        if Path(config.model).expanduser().exists() or not looks_like_hub_id(config.model):
            raise
        return LoadedEngine(Engine(config.replace(model=fallback_model()), progress=progress), exc.message)


def _release(slot: EngineSlot) -> None:
    if slot.loaded is not None:
        slot.loaded.engine.close()
        slot.loaded = slot.loaded_config = None
        gc.collect()  # free the old weights before the new ones are allocated


def get_engine(show_problems: bool = True) -> LoadedEngine | None:
    """The shared engine, loading it with a progress bar if needed. On failure: a message, a retry, and None.

    The router shows load problems; pages pass show_problems=False so the message and its button appear once."""
    slot = engine_slot()
    if slot.loaded is not None and slot.loaded_config == slot.config:
        return slot.loaded
    if slot.error is None:
        bar = st.empty()
        if not slot.lock.acquire(blocking=False):
            with st.spinner("The model is loading (started by another session)…"):
                slot.lock.acquire()
        try:
            if slot.loaded_config != slot.config and slot.error is None:
                _release(slot)
                config = slot.config

                def progress(fraction: float, message: str) -> None:
                    bar.progress(min(max(fraction, 0.0), 1.0), text=f"Loading model: {message}")

                try:
                    slot.loaded, slot.loaded_config = build_engine(config, progress), config
                except Exception as exc:  # any load failure is shown on the page; the server keeps serving
                    log.exception("model load failed")
                    slot.error = exc.message if hasattr(exc, "message") else f"{type(exc).__name__}: {exc}"
        finally:
            slot.lock.release()
            bar.empty()
    if slot.error is not None:
        if not show_problems:
            return None
        st.error(f"The model could not be loaded. {slot.error}", icon=":material/error:")
        if st.button("Retry loading", key="retry_load"):
            slot.error = None
            st.rerun()
        return None
    return slot.loaded


def current_settings() -> EngineConfig:
    return engine_slot().config


def apply_settings(config: EngineConfig) -> None:
    """New settings for everyone; the next run of any page loads the engine for them."""
    slot = engine_slot()
    with slot.lock:
        if config != slot.config:
            slot.config, slot.error = config, None


@st.cache_resource(show_spinner=False)
def _store(path: str) -> MetricsStore:
    return MetricsStore(path)


def get_store() -> MetricsStore:
    """The metrics database alone: the profiling page works even when the model failed to load."""
    return _store(current_settings().db_path)

"""One engine per server process, shared by every user of the UI and by the HTTP API.

The engine sits in a process-wide slot; the current settings live beside it, and a change swaps the engine for
everyone. Nothing here draws: the UI's progress bar (ui/engine_resource.py) and the API both load through
`ensure_loaded`.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import Callable, Mapping

from engine import SKELETON_DIR, Engine, EngineConfig, MetricsStore, ModelUnavailable, open_store
from engine.config import looks_like_hub_id, secrets_table
from engine.remote import RemoteEngine

from .settings import ServerSettings, Settings, load_settings


log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    engine: Engine
    fallback_reason: str | None  # why the synthetic skeleton stands in for the configured model
    configured_model: str | None = None  # the model the settings name, when the skeleton stands in for it


@dataclass
class LoadProgress:
    """How far the load in progress is, for every page that waits on it (whoever started it)."""

    started_at: float = field(default_factory=time.monotonic)
    fraction: float = 0.0
    message: str = "starting"

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at


@dataclass
class EngineSlot:
    config: EngineConfig  # the engine settings in force for every session (the Settings page may change them)
    server: ServerSettings  # read at start; fixed for the process
    loaded: LoadedEngine | None = None
    loaded_config: EngineConfig | None = None
    error: str | None = None  # the last load failure for `config`; cleared by a retry
    loading: bool = False
    progress: LoadProgress | None = None  # the load in progress, else None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ready(self) -> bool:
        return self.loaded is not None and self.loaded_config == self.config


# Where the `[vlscope]` table of secrets comes from: the secrets files, read with tomllib, unless the process runs
# Streamlit, whose st.secrets (its locations, AppTest's secrets) the app then hands over (read_secrets_from).
_secrets: Callable[[], Mapping] = secrets_table


def read_secrets_from(source: Callable[[], Mapping]) -> None:
    global _secrets
    _secrets = source


def configured_settings() -> Settings:
    return load_settings(secrets=_secrets())


_slot: EngineSlot | None = None
_slot_lock = threading.Lock()


def engine_slot() -> EngineSlot:
    global _slot
    with _slot_lock:
        if _slot is None:
            settings = configured_settings()
            _slot = EngineSlot(settings.engine, settings.server)
        return _slot


def build_engine(config: EngineConfig, progress, fallback_model: str = str(SKELETON_DIR)) -> LoadedEngine:
    if config.remote_url:
        return LoadedEngine(RemoteEngine(config, progress=progress, store=get_store(config)), None)
    try:
        return LoadedEngine(Engine(config, progress=progress, store=get_store(config)), None)
    except ModelUnavailable as exc:
        # A hub id whose weights cannot be reached: start on the bundled skeleton and say so, rather than failing.
        # A local folder that is wrong is the operator's mistake to see and fix, so that error is shown instead.
        if Path(config.model).expanduser().exists() or not looks_like_hub_id(config.model):
            raise
        return LoadedEngine(Engine(config.replace(model=fallback_model), progress=progress, store=get_store(config)),
                            exc.cause, config.model)


def _release(slot: EngineSlot) -> None:
    if slot.loaded is not None:
        slot.loaded.engine.close()
        slot.loaded = slot.loaded_config = None
        gc.unfreeze()
        gc.collect()  # free the old weights before the new ones are allocated


def ensure_loaded(progress=None) -> LoadedEngine | None:
    """Load the engine for the current settings if needed (one loader at a time; others wait). None on failure,
    with the reason in engine_slot().error; a failed load is not retried until retry_loading()."""
    slot = engine_slot()
    if slot.ready or slot.error is not None:
        return slot.loaded if slot.ready else None
    with slot.lock:
        if not slot.ready and slot.error is None:
            _release(slot)
            config = slot.config
            slot.progress = LoadProgress()

            def report(fraction: float, message: str) -> None:
                slot.progress.fraction, slot.progress.message = fraction, message
                if progress is not None:
                    progress(fraction, message)

            slot.loading = True
            try:
                slot.loaded = build_engine(config, report, slot.server.fallback_model)
                slot.loaded_config = config
                # What the load made lives as long as the engine: a full collection no longer walks it, holding
                # the interpreter (and every connection) for a fifth of a second (docs/decisions.md).
                gc.freeze()
            except Exception as exc:  # any load failure is reported; the server keeps serving
                log.exception("model load failed")
                slot.error = exc.message if hasattr(exc, "message") else f"{type(exc).__name__}: {exc}"
            finally:
                slot.loading, slot.progress = False, None
    return slot.loaded if slot.ready else None


def retry_loading() -> None:
    engine_slot().error = None


def current_settings() -> EngineConfig:
    return engine_slot().config


def server_settings() -> ServerSettings:
    return engine_slot().server


def apply_settings(config: EngineConfig) -> None:
    """New settings for everyone; the next run of any page (or API call) loads the engine for them."""
    slot = engine_slot()
    with slot.lock:
        if config != slot.config:
            slot.config, slot.error = config, None


_stores: dict[str, MetricsStore] = {}
# Its own lock: the loader asks for the store while it holds the slot's, and shutdown takes _slot_lock before that.
_stores_lock = threading.Lock()


def use_store(store: MetricsStore) -> None:
    """Records of the configured database go to `store` instead (a cluster's replica: scale/records.py)."""
    path = current_settings().db_path
    with _stores_lock:
        _stores[path] = store


def get_store(config: EngineConfig | None = None) -> MetricsStore:
    """The metrics database the settings (or `config`) name, one for the process: the profiling page works even
    when the model failed to load."""
    settings = config or current_settings()
    with _stores_lock:
        if settings.db_path not in _stores:
            _stores[settings.db_path] = open_store(settings)
        return _stores[settings.db_path]


def shutdown() -> None:
    """Close the engine and forget the settings (server shutdown; tests start each case afresh)."""
    global _slot
    with _slot_lock:
        if _slot is not None:
            with _slot.lock:
                _release(_slot)
            _slot = None

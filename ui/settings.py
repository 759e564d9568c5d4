"""The app's settings: engine/config.py's, with the `[vlscope]` table from `st.secrets` (so Streamlit's secrets
locations and `st.App(secrets=...)` count) in place of the secrets files it reads on its own."""
from __future__ import annotations

import streamlit as st

from engine.config import Settings, load_settings


def _secrets() -> dict:
    try:
        return dict(st.secrets.get("vlscope", {}))
    except Exception:  # no secrets file, or an unreadable one: the defaults and environment still apply
        return {}


def configured_settings() -> Settings:
    return load_settings(secrets=_secrets())

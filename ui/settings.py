"""The app's engine settings: defaults, then .streamlit/secrets.toml ([vlscope] table), then VLSCOPE_* variables."""
from __future__ import annotations

import dataclasses
import os

import streamlit as st

from engine import EngineConfig


def _secrets() -> dict:
    try:
        return dict(st.secrets.get("vlscope", {}))
    except Exception:  # no secrets file, or an unreadable one: the defaults and environment still apply
        return {}


def configured_settings() -> EngineConfig:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    from_secrets = {k: v for k, v in _secrets().items() if k in fields}
    # Environment variables override secrets: the usual order for a server started by systemd or a container.
    env = {f"VLSCOPE_{k.upper()}": str(v) for k, v in from_secrets.items()}
    env.update({k: v for k, v in os.environ.items() if k.startswith("VLSCOPE_")})
    return EngineConfig.from_env(env)

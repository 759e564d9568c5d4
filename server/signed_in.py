"""Whether this server asks who is calling, and which app sessions have signed in: read by the UI's sign-in, by
the server guard (uploads wait for sign-in) and at start-up (a warning when the server is open)."""
from __future__ import annotations

import streamlit as st

from .slot import server_settings

_signed_in_sessions: set[str] = set()


def secret(section: str, key: str | None = None):
    """A value from Streamlit's secrets (the [auth] table, for one); None when there is none."""
    try:
        value = st.secrets.get(section)
        return value.get(key) if key and value is not None else value
    except Exception:  # no secrets file: nothing configured there
        return None


def sign_in_configured() -> bool:
    return bool(secret("auth")) or bool(server_settings().app_password)


def mark_signed_in(session_id: str) -> None:
    _signed_in_sessions.add(session_id)


def session_signed_in(session_id: str) -> bool | None:
    """For the upload guard: None when the app has no sign-in; else whether that session has signed in."""
    return session_id in _signed_in_sessions if sign_in_configured() else None


def exposed_without_sign_in() -> bool:
    """The server listens beyond loopback and neither the API nor the app asks who is calling."""
    address = st.get_option("server.address") or ""
    beyond_loopback = address not in ("127.0.0.1", "localhost", "::1")
    return beyond_loopback and not server_settings().api_keys and not sign_in_configured()

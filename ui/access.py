"""Who may use the app and who may change it.

Sign-in: Streamlit's OIDC (`st.login`) when an [auth] table is in secrets, else the shared app_password setting,
else none (open). Failed passwords are slowed down and counted per browser session and per client address; when
they pile up, that session or address (only) is locked out for a while, and the lockout is logged. Admins (who may change the Settings page): with sign-in off, everyone; with it on, the emails in
the admins setting, or whoever enters admin_password.
"""
from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque

import streamlit as st

from server.signed_in import mark_signed_in, secret, sign_in_configured
from server.slot import server_settings

log = logging.getLogger(__name__)

FAILURE_WINDOW_S = 300.0
_failures: dict[str, deque[float]] = {}  # "session:<id>" or "address:<ip>" -> times of its failed attempts
_failures_lock = threading.Lock()


def _session_id() -> str | None:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    context = get_script_run_ctx()
    return context.session_id if context else None


def _mark_signed_in() -> None:
    session_id = _session_id()
    if session_id:
        mark_signed_in(session_id)


def _who() -> list[str]:
    """The keys a failed attempt counts under: this browser session and the client's address, where known."""
    keys = []
    session_id = _session_id()
    if session_id:
        keys.append(f"session:{session_id}")
    try:
        address = st.context.ip_address
    except Exception:  # no request context (AppTest): the session alone
        address = None
    if isinstance(address, str) and address:
        keys.append(f"address:{address}")
    return keys or ["session:unknown"]


def _recent(key: str, now: float) -> deque[float]:
    times = _failures.setdefault(key, deque())
    while times and now - times[0] > FAILURE_WINDOW_S:
        times.popleft()
    return times


def _locked_for(keys: list[str]) -> float:
    """Seconds until these keys may try again; 0 when none is locked out."""
    now = time.monotonic()
    with _failures_lock:
        waits = [FAILURE_WINDOW_S - (now - times[0]) for times in (_recent(key, now) for key in keys)
                 if len(times) >= server_settings().sign_in_attempts]
    return max(waits, default=0.0)


def _record_failure(keys: list[str]) -> dict[str, int]:
    """Count a failed attempt under each key; returns each key's failures within the window."""
    now = time.monotonic()
    with _failures_lock:
        counts = {}
        for key in keys:
            times = _recent(key, now)
            times.append(now)
            counts[key] = len(times)
    return counts


def _check_password(entered: str, expected: str, what: str) -> bool:
    """Constant-time compare; a failure waits longer the more failures this session or address had lately, and is
    logged; at sign_in_attempts within the window that session or address is locked out, nobody else."""
    keys = _who()
    wait = _locked_for(keys)
    if wait:
        st.error(f"Too many failed attempts from this browser or address. Try again in {max(1, int(wait))} seconds.")
        return False
    if hmac.compare_digest(entered.encode(), expected.encode()):
        return True
    counts = _record_failure(keys)
    count = max(counts.values())
    log.warning("failed %s attempt (%d in the last %d s from %s)", what, count, int(FAILURE_WINDOW_S),
                ", ".join(keys))
    for key, seen in counts.items():
        if seen == server_settings().sign_in_attempts:
            log.warning("%s locked out of %s for %d s after %d failed attempts", key, what, int(FAILURE_WINDOW_S), seen)
    time.sleep(min(5.0, 0.5 * count))
    st.error("Wrong password.")
    return False


def require_sign_in() -> bool:
    """True when this session may see the app; otherwise draws the sign-in and returns False."""
    if secret("auth"):
        if st.user.is_logged_in:
            _mark_signed_in()
            return True
        st.title("vlscope")
        st.button("Log in", key="oidc_login", on_click=st.login, type="primary")
        return False
    password = server_settings().app_password
    if not password:
        return True
    if st.session_state.get("signed_in"):
        _mark_signed_in()
        return True
    st.title("vlscope")
    with st.form("sign_in"):
        entered = st.text_input("Password", type="password", key="sign_in_password")
        if st.form_submit_button("Sign in", key="sign_in_submit"):
            if _check_password(entered, password, "sign-in"):
                st.session_state["signed_in"] = True
                _mark_signed_in()
                st.rerun()
    return False


def is_admin() -> bool:
    """Whether this session may change the server's settings."""
    if not sign_in_configured() or st.session_state.get("admin"):
        return True
    settings = server_settings()
    email = st.user.get("email") if secret("auth") and st.user.is_logged_in else None
    return bool(email) and email.lower() in {admin.lower() for admin in settings.admins}


def admin_sign_in() -> None:
    """The admin password form, when one is configured; else how to become an admin."""
    password = server_settings().admin_password
    if not password:
        st.info("Only admins change settings. Set VLSCOPE_ADMINS (emails, with OIDC sign-in) or "
                "VLSCOPE_ADMIN_PASSWORD to name them.", icon=":material/lock:")
        return
    with st.form("admin_sign_in"):
        entered = st.text_input("Admin password", type="password", key="admin_password")
        if st.form_submit_button("Unlock settings", key="admin_submit"):
            if _check_password(entered, password, "admin sign-in"):
                st.session_state["admin"] = True
                st.rerun()

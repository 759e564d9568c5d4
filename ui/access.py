"""Who may use the app: Streamlit's OIDC sign-in when [auth] is configured in secrets, else an optional shared
password (the app_password setting), else open."""
from __future__ import annotations

import hmac

import streamlit as st

from .engine_resource import server_settings


def _secret(section: str, key: str | None = None):
    try:
        value = st.secrets.get(section)
        return value.get(key) if key and value is not None else value
    except Exception:  # no secrets file: nothing configured there
        return None


def require_sign_in() -> bool:
    """True when this session may see the app; otherwise draws the sign-in and returns False."""
    if _secret("auth"):
        if st.user.is_logged_in:
            return True
        st.title("vlscope")
        st.button("Log in", key="oidc_login", on_click=st.login, type="primary")
        return False
    password = server_settings().app_password
    if not password or st.session_state.get("signed_in"):
        return True
    st.title("vlscope")
    with st.form("sign_in"):
        entered = st.text_input("Password", type="password", key="sign_in_password")
        if st.form_submit_button("Sign in", key="sign_in_submit"):
            if hmac.compare_digest(entered.encode(), password.encode()):
                st.session_state["signed_in"] = True
                st.rerun()
            st.error("Wrong password.")
    return False

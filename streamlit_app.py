"""vlscope: chat with Qwen3-VL on a CPU and see what every request costs. The one file to run:

    streamlit run streamlit_app.py                   # the UI and the OpenAI-compatible API, one process, one model
    uvicorn streamlit_app:app --port 8501            # the same under uvicorn's own flags
"""
import logging

import streamlit as st

from server.slot import read_secrets_from


def streamlit_secrets() -> dict:
    """The `[vlscope]` table of st.secrets: Streamlit's secrets locations, and those AppTest sets."""
    try:
        return dict(st.secrets.get("vlscope", {}))
    except Exception:  # no secrets file, or an unreadable one: the defaults and environment still apply
        return {}


read_secrets_from(streamlit_secrets)

if __name__ == "__main__":
    # Streamlit runs this file as the page script, on every rerun of every session.
    from ui.access import require_sign_in
    from ui.engine_resource import get_engine
    from ui.sidebar import render_status

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    st.set_page_config(page_title="vlscope", page_icon=":material/visibility:", layout="wide")
    if not require_sign_in():
        st.stop()

    page = st.navigation([
        st.Page("pages/chat.py", title="Chat", icon=":material/chat:", default=True),
        st.Page("pages/profiling.py", title="Profiling", icon=":material/monitoring:"),
        st.Page("pages/benchmark.py", title="Benchmark", icon=":material/speed:"),
        st.Page("pages/settings.py", title="Settings", icon=":material/tune:"),
    ])
    render_status(get_engine())
    page.run()
else:
    # Imported by `streamlit run` (which finds this App and serves it) or by uvicorn: the server itself, with the
    # API's routes beside the UI and the model loading at start-up.
    from contextlib import asynccontextmanager

    from starlette.middleware import Middleware

    from api.connections import guard_connections
    from api.guard import ServerGuard
    from api.routes import lifespan as api_lifespan
    from api.routes import refuse, routes
    from server.signed_in import exposed_without_sign_in, session_signed_in
    from server.slot import server_settings

    @asynccontextmanager
    async def lifespan(app):
        if exposed_without_sign_in():
            logging.getLogger("vlscope").warning(
                "vlscope is open: it may listen beyond loopback and neither API keys nor an app sign-in are set. "
                "Anyone who reaches this port can use the model. See docs/hosting.md.")
        async with api_lifespan(app):
            yield

    guard_connections(server_settings)
    app = st.App(__file__, routes=routes, lifespan=lifespan, middleware=[
        Middleware(ServerGuard, settings=server_settings, signed_in=session_signed_in, refuse=refuse)])

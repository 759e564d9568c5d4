"""vlscope with its HTTP API: the Streamlit UI and OpenAI-compatible routes in one process, over one model.

    uvicorn app:app --host 0.0.0.0 --port 8501        # or: streamlit run app.py
"""
import threading
from contextlib import asynccontextmanager

import streamlit as st

from api.routes import routes
from ui.engine_resource import ensure_loaded, shutdown


@asynccontextmanager
async def lifespan(app):
    # Load at start-up, in the background, so the API is ready without anyone opening the UI first.
    threading.Thread(target=ensure_loaded, name="vlscope-load", daemon=True).start()
    yield
    shutdown()


app = st.App("streamlit_app.py", routes=routes, lifespan=lifespan)

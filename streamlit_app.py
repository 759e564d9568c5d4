"""vlscope: chat with Qwen3-VL on a CPU and see what every request costs."""
import logging

import streamlit as st

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

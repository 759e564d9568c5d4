"""Settings page: change model, precision, threads or image budget; applying reloads the model for everyone."""
import json

import streamlit as st

from engine import DTYPES
from engine.config import COMPILE_MODES, COMPUTE_DTYPES, DRAFTS
from server.slot import apply_settings, current_settings, engine_slot
from speed.advice import agreement_line
from speed.record import reference_result
from ui.access import admin_sign_in, is_admin
from ui.sidebar import what_is_loaded

VISION_TOKEN_BUDGETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 4096)  # the slider's stops

st.title("Settings")
current = current_settings()
if not is_admin():
    admin_sign_in()
    st.subheader("In force")
    st.json({k: ("(set)" if k == "remote_api_key" and v else v) for k, v in vars(current).items()}, expanded=False)
    st.stop()
st.caption("Defaults come from `.streamlit/secrets.toml` ([vlscope] table) and `VLSCOPE_*` environment variables. "
           "Changes here apply to everyone using this server until it restarts.")



@st.cache_data(ttl=300)
def precision_agreement(dtype: str) -> str:
    found = reference_result()
    if found is None:
        return agreement_line(None, dtype)
    try:
        return agreement_line(json.loads(found.path.read_text()), dtype, found.same_kind)
    except (OSError, ValueError):
        return agreement_line(None, dtype)


# No form: a caption follows the value beside it (the precision's agreement), and nothing applies until the button.
with st.container(border=True):
    model = st.text_input("Model (hub id, folder with weights, or skeleton folder)", current.model, key="set_model")
    loaded = engine_slot().loaded
    if loaded is not None and loaded.engine.info.synthetic:
        st.caption(what_is_loaded(loaded))
    left, right = st.columns(2)
    dtype = left.selectbox("Precision", DTYPES, index=DTYPES.index(current.dtype), key="set_dtype")
    threads = right.number_input("Threads", 1, 512, current.threads, key="set_threads")
    left.caption(precision_agreement(dtype))
    compute_dtype = left.selectbox(
        "Compute (bfloat16, int8 and int4 weights)", COMPUTE_DTYPES, index=COMPUTE_DTYPES.index(current.compute_dtype),
        key="set_compute_dtype",
        help="auto: bfloat16 where this CPU's bfloat16 matmul measures faster than float32, else float32 with the "
             "weights kept compact. float32 weights always compute in float32.")
    compile_mode = right.selectbox(
        "Compiled decode step", COMPILE_MODES, index=COMPILE_MODES.index(current.compile), key="set_compile",
        help="auto: compile at load where it measures faster than eager decode with the same tokens (bfloat16 "
             "where PyTorch lacks fbgemm's float16 products, which decode as fast with no compile; 1-2 minutes at "
             "each load). on: always try (float32: a second copy of the weights in memory). off: eager decode. "
             "A failed compile falls back to eager.")
    max_tokens = left.select_slider("Max vision tokens per image", VISION_TOKEN_BUDGETS,
                                    value=current.max_vision_tokens if current.max_vision_tokens in
                                    VISION_TOKEN_BUDGETS else 1024, key="set_budget")
    max_new = right.number_input("Max new tokens", 1, 8192, current.max_new_tokens, key="set_max_new")
    synthetic_max_new = right.number_input(
        "Default answer length, synthetic weights (0: as above)", 0, 8192, current.synthetic_max_new_tokens,
        key="set_synthetic_max_new",
        help="Synthetic weights answer noise until the cap; their answers stop here unless a request asks for "
             "more (up to Max new tokens).")
    if loaded is not None and loaded.engine.info.synthetic and synthetic_max_new:
        right.caption(f"Synthetic weights are loaded: answers stop at {min(int(max_new), int(synthetic_max_new))} "
                      "tokens unless a request asks for more.")
    temperature = left.slider("Temperature (0 = greedy)", 0.0, 2.0, current.temperature, 0.05, key="set_temperature")
    top_p = right.slider("Top-p", 0.05, 1.0, current.top_p, 0.05, key="set_top_p")
    kv_cache = left.toggle("KV cache", current.kv_cache, key="set_kv_cache",
                           help="Off only for benchmarks: every token re-reads the whole sequence.")
    store_content = right.toggle("Store prompts, answers and images", current.store_content, key="set_store",
                                 help="Off: only metrics are kept.")
    max_batch = left.number_input("Answers at once (batch limit)", 1, 32, current.max_batch, key="set_max_batch",
                                  help="Requests that decode together, one token each per step; more wait in the "
                                       "queue. A step for four costs little more than a step for one. With "
                                       "AVX-512, float32 weights are laid out for up to four answers; 1 suits "
                                       "one person alone.")
    draft = right.selectbox(
        "Drafted decode (float32)", DRAFTS, index=DRAFTS.index(current.draft), key="set_draft",
        help="int8: an int8 copy of the language model drafts three tokens and the float32 weights check them in "
             "one pass; the answer is float32's own greedy tokens, faster, for the copy's memory. Greedy answers "
             "decoding alone, on CPUs with AVX-512. off: a token a step.")
    submitted = st.button("Apply and reload", type="primary", key="apply_settings")

if submitted:
    try:
        new = current.replace(model=model.strip(), dtype=dtype, compute_dtype=compute_dtype, compile=compile_mode,
                              draft=draft, threads=int(threads),
                              max_pixels=int(max_tokens) * 1024, min_pixels=min(current.min_pixels, int(max_tokens) * 1024),
                              max_new_tokens=int(max_new), synthetic_max_new_tokens=int(synthetic_max_new),
                              temperature=float(temperature), top_p=float(top_p),
                              kv_cache=kv_cache, store_content=store_content, max_batch=int(max_batch))
    except ValueError as exc:
        st.error(f"Not applied: {exc}")
    else:
        apply_settings(new)
        st.success("Applied. The model reloads now.")
        st.rerun()

st.subheader("In force")
st.json({k: ("(set)" if k == "remote_api_key" and v else v) for k, v in vars(current).items()}, expanded=False)

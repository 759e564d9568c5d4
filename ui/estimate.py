"""The chat page's estimate before sending: the seconds the next question will take, and where the rates come from."""
from __future__ import annotations

import json

import streamlit as st

from engine.request import default_answer_tokens
from speed.estimate import OWN_RECORDS_READ, from_answers, from_record
from speed.record import reference_result

TEXT_TOKENS = 24  # the chat template and a short question around the pictures


@st.cache_data(ttl=300, show_spinner=False)
def _record() -> dict | None:
    """This CPU kind's benchmark record, when there is one for it."""
    found = reference_result()
    if found is None or not found.same_kind:
        return None
    try:
        return json.loads(found.path.read_text())
    except (OSError, ValueError):
        return None


def estimate_line(engine, pieces: list[int]) -> str:
    """About how long the next question takes to its first word and to the end of the longest answer, at the loaded
    precision. `pieces`: the vision tokens of each picture, page or pair of frames going with it (none for a
    follow-up, whose pictures are in the conversation already)."""
    info = engine.info
    tokens = sum(pieces) + TEXT_TOKENS
    answer = default_answer_tokens(engine.config, info.synthetic)
    capped = " (synthetic weights: answers stop there by default)" if answer < engine.config.max_new_tokens else ""
    loaded = getattr(engine, "loaded", None)  # a remote engine has no model here to count the work of
    rates = None
    if loaded is not None:
        model_config = loaded.model.config
        rates = from_record(_record(), info.dtype, info.weight_bytes, model_config) or from_answers(
            engine.store.recent(OWN_RECORDS_READ), info.model, info.dtype, model_config)
    if rates is None:
        return f"Next question: about {tokens:,} prompt tokens, an answer of up to {answer} tokens{capped}."
    first = rates.first_token_s(pieces, tokens, loaded.model.config)
    return (f"Next question: about {tokens:,} prompt tokens, ~{_seconds(first)} to the first word, "
            f"~{_seconds(first + rates.answer_s(answer))} for an answer of {answer} tokens{capped} "
            f"({rates.source}).")


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"

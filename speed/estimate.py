"""Seconds a question will take before it is sent: prompt tokens to encode-and-prefill seconds and answer tokens to
decode seconds, at the loaded precision, from this CPU kind's benchmark record or this server's own answers."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from engine import RequestMetrics
from engine.records.stages import OK, PREFILL, VISION_ENCODE

SAME_MODEL_WEIGHTS = 0.15  # a record measured the loaded model when their weights in memory differ by less than this
OWN_RECORDS_READ = 20  # this server's newest answers the rates are read from, when no record fits


@dataclass(frozen=True)
class Rates:
    """How fast the loaded model turns a prompt into its first token and then decodes, and where that comes from."""

    seconds_per_prompt_token: float  # vision encode and prefill, over the prompt's tokens
    decode_tokens_per_s: float
    source: str  # in words, for the page

    def first_token_s(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.seconds_per_prompt_token

    def answer_s(self, answer_tokens: int) -> float:
        return answer_tokens / self.decode_tokens_per_s


def _per_prompt_token(stages: dict, prompt_tokens: int) -> float | None:
    seconds = sum(stages.get(stage, 0.0) for stage in (VISION_ENCODE, PREFILL))
    return seconds / prompt_tokens if seconds > 0 and prompt_tokens > 0 else None


def from_record(document: dict | None, dtype: str, weight_bytes: int) -> Rates | None:
    """The rates of the benchmark record's "tuned <dtype>" case, when it measured a model of the loaded size."""
    for case in (document or {}).get("cases", ()):
        if case["case"].get("dtype") != dtype or case["case"].get("group") != "precision":
            continue
        summary, runs = case["summary"], case.get("runs") or ()
        measured = runs[0].get("weight_bytes") if runs else None
        if not measured or abs(measured - weight_bytes) > SAME_MODEL_WEIGHTS * weight_bytes:
            return None
        stages = {name: value["median"] for name, value in summary.get("stages", {}).items()}
        per_token = _per_prompt_token(stages, summary.get("prompt_tokens", 0))
        decode = (summary.get("decode_tokens_per_s") or {}).get("median")
        if per_token and decode:
            return Rates(per_token, decode, f"{dtype} on this CPU kind's benchmark record")
    return None


def from_answers(records: list[RequestMetrics], model: str, dtype: str) -> Rates | None:
    """The median rates of this server's latest whole answers on the loaded model (its warm-up among them)."""
    fitting = [r for r in records if r.status == OK and r.model == model and r.dtype == dtype]
    per_token = [rate for r in fitting
                 if (rate := _per_prompt_token(r.stages, r.prompt_tokens - r.cached_prompt_tokens)) is not None]
    decode = [r.decode_tokens_per_s for r in fitting if r.decode_tokens_per_s]
    if not per_token or not decode:
        return None
    count = len(fitting)
    return Rates(statistics.median(per_token), statistics.median(decode),
                 f"{dtype}, this server's last {count} answer{'s' if count > 1 else ''}")

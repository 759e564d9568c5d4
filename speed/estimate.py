"""Seconds a question will take before it is sent, at the loaded precision: the work of its vision encode and prefill
counted in floating-point operations from the model's shape (attention grows with the square of a picture's and the
prompt's length), turned into seconds at the rate a measured request ran, from this CPU kind's benchmark record or
this server's own answers; the answer's tokens at the measured decode rate."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from engine import RequestMetrics
from engine.records.stages import OK, PREFILL, VISION_ENCODE

SAME_MODEL_WEIGHTS = 0.15  # a record measured the loaded model when their weights in memory differ by less than this
OWN_RECORDS_READ = 20  # this server's newest answers the rates are read from, when no record fits
PIXELS_PER_TOKEN = 32 * 32  # one vision token for 32x32 pixels (16-pixel patches, merged 2x2)
# Attention's operations count this many times a product's: they run on slower kernels than the weights' products
# (docs/decisions.md, "The estimate before sending").
ATTENTION_WEIGHT = 3


def vision_flops(tokens_per_picture: list[int], config) -> float:
    """The vision tower's work for pictures of these token counts (each picture attends within itself)."""
    merge = config.spatial_merge_size ** 2
    hidden, layers = config.hidden_size, config.depth
    per_patch = 2 * (4 * hidden * hidden + 2 * hidden * config.intermediate_size)
    patches = [tokens * merge for tokens in tokens_per_picture]
    return layers * sum(per_patch * count + ATTENTION_WEIGHT * 4 * count * count * hidden for count in patches)


def prefill_flops(prompt_tokens: int, config) -> float:
    """The language model's work over a prompt of this length (causal attention: half the square)."""
    hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    per_token = 2 * (2 * hidden * width + 2 * hidden * kv_width + 3 * hidden * config.intermediate_size)
    attention = ATTENTION_WEIGHT * 2 * prompt_tokens * prompt_tokens * width
    return config.num_hidden_layers * (per_token * prompt_tokens + attention)


@dataclass(frozen=True)
class Rates:
    """How fast the loaded model worked on a measured request, and where that comes from."""

    encode_flops_per_s: float
    prefill_flops_per_s: float
    decode_tokens_per_s: float
    source: str  # in words, for the page

    def first_token_s(self, tokens_per_picture: list[int], prompt_tokens: int, model_config) -> float:
        encode = vision_flops(tokens_per_picture, model_config.vision_config) if tokens_per_picture else 0.0
        return (encode / self.encode_flops_per_s
                + prefill_flops(prompt_tokens, model_config.text_config) / self.prefill_flops_per_s)

    def answer_s(self, answer_tokens: int) -> float:
        return answer_tokens / self.decode_tokens_per_s


def _rates(stages: dict, pictures: list[int], prompt_tokens: int, model_config) -> tuple[float, float] | None:
    encode, prefill = stages.get(VISION_ENCODE, 0.0), stages.get(PREFILL, 0.0)
    if encode <= 0 or prefill <= 0 or not pictures or prompt_tokens <= 0:
        return None
    return (vision_flops(pictures, model_config.vision_config) / encode,
            prefill_flops(prompt_tokens, model_config.text_config) / prefill)


def from_record(document: dict | None, dtype: str, weight_bytes: int, model_config) -> Rates | None:
    """The rates of the benchmark record's "tuned <dtype>" case (one picture), when it measured a model of the
    loaded size."""
    for case in (document or {}).get("cases", ()):
        if case["case"].get("dtype") != dtype or case["case"].get("group") != "precision":
            continue
        summary, runs = case["summary"], case.get("runs") or ()
        measured = runs[0].get("weight_bytes") if runs else None
        if not measured or abs(measured - weight_bytes) > SAME_MODEL_WEIGHTS * weight_bytes:
            return None
        stages = {name: value["median"] for name, value in summary.get("stages", {}).items()}
        rates = _rates(stages, [summary.get("vision_tokens", 0)], summary.get("prompt_tokens", 0), model_config)
        decode = (summary.get("decode_tokens_per_s") or {}).get("median")
        if rates and decode:
            return Rates(*rates, decode, f"{dtype} on this CPU kind's benchmark record")
    return None


def from_answers(records: list[RequestMetrics], model: str, dtype: str, model_config) -> Rates | None:
    """The median rates of this server's latest answers on the loaded model with pictures (its warm-up among them)
    that encoded and prefilled their whole prompt."""
    fitting = [r for r in records if r.status == OK and r.model == model and r.dtype == dtype
               and not r.cached_prompt_tokens and r.resized_sizes]
    rates = [rate for r in fitting if (rate := _rates(
        r.stages, [w * h // PIXELS_PER_TOKEN for w, h in r.resized_sizes], r.prompt_tokens, model_config))]
    decode = [r.decode_tokens_per_s for r in records if r.decode_tokens_per_s and r.model == model and r.dtype == dtype]
    if not rates or not decode:
        return None
    return Rates(statistics.median(rate[0] for rate in rates), statistics.median(rate[1] for rate in rates),
                 statistics.median(decode), f"{dtype}, this server's last answers")

"""The one place that chooses how decode runs and prepares its weights: the direct step (model/direct_step.py)
compiled by segment, the direct step eager on packed weights, or transformers' own forward (plain kernels, or no
KV cache).

Prefill stays eager (its shapes change with every prompt). Each of the direct step's segments is compiled with
inductor, weights frozen as constants, so it picks per Linear shape between its CPP GEMM templates and oneDNN's
prepacked product and fuses the small operations around them; attention stays eager over the used length.

`auto` compiles bfloat16 only where fbgemm's float16 products are missing (eager on the float16 copy is as fast);
float32 stays eager because freezing keeps a second copy of the weights, and int8 because its fbgemm products are
opaque to the compiler. The measurements behind each: docs/decisions.md, "Compile policy".
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from ..config import INTEGER_DTYPES
from .direct_step import DirectDecodeStep
from .draft import DRAFTED, draft_bytes, int8_copy
from ..kernels.decode_attention import best as best_attention
from ..kernels.packing import decode_rows, keeps_fp16_copy, pack_remaining_linears
from .generate import attach_step, decode_one_token, prefill
from .loading import decode_weight_bytes, weight_bytes
from .memory_pages import release_freed_memory
from ..inputs.preprocess import chat_messages, tokenize_prompt

log = logging.getLogger(__name__)

COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "triton.cudagraphs": False}


def compiles_when_auto(dtype: str, compute_dtype: str, kernels: str) -> bool:
    """Whether VLSCOPE_COMPILE=auto compiles the decode step: only bfloat16 computing in bfloat16, and only where
    packing leaves it without fbgemm's float16 copy (engine/kernels/packing.py, fp16_packed): one-row products on it read
    the weights faster than the compiled step's oneDNN products, with no compile at load."""
    return (dtype == "bfloat16" and compute_dtype == "bfloat16"
            and not (kernels == "packed" and keeps_fp16_copy(compute_dtype)))


def hidden_dtype(loaded) -> torch.dtype | None:
    """What the direct step keeps its hidden state in between operations. int8 and int4 products, and bfloat16 ones on
    fbgemm's float16 copy, take and give float32: rounding it to bfloat16 between them is work for nothing.
    Otherwise the model's own dtype, as
    transformers' layers keep it."""
    if loaded.dtype in INTEGER_DTYPES:
        return torch.float32
    return getattr(loaded.model.lm_head, "one_row_dtype", None)


def _steps_ms(model, prompt, step: DirectDecodeStep, count: int) -> tuple[float, list[int]]:
    """Prefill `prompt`, then `count` greedy steps through `step`; ms per step of the last half."""
    logits, state = prefill(model, prompt, None, None, True)
    attach_step(state, step)
    token, tokens, times = int(logits.argmax()), [], []
    for _ in range(count):
        started = time.perf_counter()
        token = int(decode_one_token(model, state, token).argmax())
        times.append(time.perf_counter() - started)
        tokens.append(token)
    state.kv = None  # the buffers go; the cache is not kept
    half = times[count // 2:]
    return 1000 * sum(half) / len(half), tokens


def compile_step(loaded, mode: str, kernels: str, cache_dir: Path, progress=None) -> tuple[DirectDecodeStep | None, str]:
    """Compile the decode step (mode "on"), or compile and keep it only where it measures faster ("auto").

    Returns the compiled step or None, and one line saying what was decided and why. A compiler failure falls back
    to eager decode with that line, never a failed load. Runs on the compute thread. Inductor keeps what it can
    reuse (compiled kernels, autotuning choices) in `cache_dir`, the app's data folder, unless
    TORCHINDUCTOR_CACHE_DIR says otherwise."""
    report = progress or (lambda fraction, message: None)
    if mode == "off":
        return None, "eager decode (compilation off)"
    if mode == "auto" and not compiles_when_auto(loaded.dtype, loaded.compute_dtype, kernels):
        if kernels == "packed" and keeps_fp16_copy(loaded.compute_dtype):  # packed below, after this choice
            return None, ("eager decode: bfloat16 decodes on fbgemm's float16 copy of the weights, as fast as "
                          "compiled with no compile (engine/kernels/packing.py, fp16_packed); VLSCOPE_COMPILE=on forces it")
        return None, (f"eager decode: {loaded.dtype} weights with {loaded.compute_dtype} compute decode no faster "
                      "compiled, or do not fit twice in memory (engine/model/decode_backend.py); VLSCOPE_COMPILE=on forces it")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    model = loaded.model
    messages = chat_messages([], "Describe what a compiled decode step is in a few words.", [0])
    prompt = tokenize_prompt(loaded.tokenizer, messages, [], loaded.image_token_id)
    started = time.perf_counter()
    segments = [0, 0]  # compiled so far, in all
    done = threading.Event()

    def tick() -> None:  # a segment compiles in one long call: the bar also shows the time taken so far
        while not done.wait(1.0):
            report(0.9 + 0.06 * segments[0] / max(segments[1], 1),
                   f"Compiling the decode step: {segments[0]} of {segments[1] or '?'} segments, "
                   f"{time.perf_counter() - started:.0f} s")

    def compiled_one(count: int, total: int) -> None:
        segments[:] = [count, total]

    ticker = threading.Thread(target=tick, name="vlscope-compile-clock", daemon=True)
    ticker.start()
    step = None
    try:
        with torch.inference_mode():
            step = DirectDecodeStep(model, hidden_dtype(loaded))
            step.compile(COMPILE_OPTIONS, compiled_one)
            compile_s = time.perf_counter() - started
            compiled_ms, compiled_tokens = _steps_ms(model, prompt, step, 8)
            eager_ms, eager_tokens = _steps_ms(model, prompt, DirectDecodeStep(model, hidden_dtype(loaded)), 8)
    except Exception as exc:  # an inductor or compiler failure: eager decode still works
        log.exception("compiling the decode step failed")
        if step is not None:
            step.release()
        return None, f"eager decode: compiling failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    finally:
        done.set()
        ticker.join()
    # eager here runs the plain kernels the compiler starts from; the engine packs them if it keeps eager decode
    figures = f"{compiled_ms:.0f} ms/token compiled, {eager_ms:.0f} eager, compiled in {compile_s:.0f} s"
    reason = None
    if compiled_tokens != eager_tokens:
        log.warning("compiled decode step disagrees with eager: %s vs %s", compiled_tokens, eager_tokens)
        reason = "the compiled step chose other tokens than eager decode"
    elif mode == "auto" and compiled_ms >= eager_ms:
        reason = f"measured faster here ({figures})"
    if reason is not None:
        step.release()
        return None, f"eager decode: {reason}"
    return step, f"compiled decode step ({figures})"


def prepare(loaded, config, progress=None) -> tuple[DirectDecodeStep | None, DirectDecodeStep | None, str,
                                                     tuple[str, ...]]:
    """How this engine decodes: the compiled direct step, the eager direct step on weights packed here, or None
    (transformers' forward: no KV cache, or plain kernels), and the draft step beside it or None. Returns them, the
    line that says which and why, and the lines of kernels this CPU cannot serve. Loading packed only the vision
    tower: the language model's weights are packed here, unless the compiled step keeps its own frozen copy."""
    step, note = None, "eager decode (no KV cache)"
    if config.kv_cache:
        step, note = compile_step(loaded, config.compile, config.kernels, Path(config.db_path).parent / "inductor",
                                  progress)
    notes: list[str] = []
    if step is None and config.kernels == "packed":
        notes = [line for line in pack_remaining_linears(loaded.model, loaded.compute_dtype, progress,
                                                         _layout_rows(loaded, config))
                 if line not in loaded.notes]
        release_freed_memory()
        loaded.weight_bytes, loaded.decode_weight_bytes = weight_bytes(loaded.model), decode_weight_bytes(loaded.model)
        if config.kv_cache:
            step = DirectDecodeStep(loaded.model, hidden_dtype(loaded))
            note = f"direct decode step; {note}"
    draft = None
    if step is not None:
        draft, why = _draft(loaded, config, step, progress)
        note = f"{note}; {why}"
    if config.kv_cache:
        note = f"{note}; {best_attention()[1]}"
    log.info("decode: %s", note)
    return step, draft, note, tuple(notes)


def _layout_rows(loaded, config) -> int:
    """The rows decode's products are laid out for: the batch's, and a check's where float32 drafts."""
    drafting = loaded.dtype == "float32" and config.draft != "off"
    return decode_rows(max(config.max_batch, DRAFTED + 1) if drafting else config.max_batch, config.kv_cache)


def _draft(loaded, config, step: DirectDecodeStep, progress) -> tuple[DirectDecodeStep | None, str]:
    """The int8 copy that drafts for a float32 step, where its check is exact: the step's products laid out for the
    check's rows, so each row is what a step of one computes (packing.decode_rows)."""
    if config.draft == "off":
        return None, "one token a step (drafting off)"
    if loaded.dtype != "float32" or step.compiled:
        return None, "one token a step"
    if _layout_rows(loaded, config) < DRAFTED + 1:
        return None, f"one token a step (a check of {DRAFTED + 1} rows is exact only on weights laid out for them)"
    if progress:
        progress(0.96, "An int8 copy of the language model to draft tokens")
    # Over the step's buffers: it drafts on the loaded model's own keys and values (float32, as the step keeps them).
    draft = DirectDecodeStep(int8_copy(loaded.model), hidden_dtype=torch.float32, attention=step.attention)
    loaded.draft_bytes = draft_bytes(draft)
    loaded.weight_bytes += loaded.draft_bytes
    release_freed_memory()
    return draft, f"{DRAFTED} tokens drafted by an int8 copy ({loaded.draft_bytes / 2**20:,.0f} MB), checked together"


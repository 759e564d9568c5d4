"""A compiled one-token decode step over one static KV cache, gpt-fast's way.

Prefill stays eager (its shapes change with every prompt) and fills the usual DynamicCache; its keys and values are
then copied into one StaticCache allocated once for the process, and each decode step is one call of a function
compiled with inductor: the language model for one token, then the LM head. Freezing lets inductor treat the
weights as constants and pick, per Linear shape, between its CPP GEMM templates and oneDNN's prepacked product.

Measured on the AVX-512 BF16 EPYC, 2 threads, full-size model, standard prompt: 24 greedy steps in one script,
bfloat16 plain eager 234 ms/token, packed eager 212, compiled 137 (1.55x packed), the same tokens. Through the
engine (448x448, 64 tokens, three requests per process): 4.84-5.61 tok/s compiled against 3.69-3.96 packed eager
(1.3x). Compiling took 134-209 s, and about as long with a warm inductor cache (freezing folds the weights into
the graph, which the FX cache does not keep); peak RSS went from 5.7 to 9.9 GB: the frozen copy of the language
model's weights sits beside the eager ones, which prefill still uses. int8 (fbgemm's packed int8 x int8 Linear
inside the compiled step) ran at 160 ms/token against 95 eager, with different tokens, and float32 with freezing
did not fit in 24 GB: both stay eager under `auto`.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from .generate import append_decoded, decode_one_token, prefill
from .preprocess import chat_messages, tokenize_prompt

log = logging.getLogger(__name__)

COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "triton.cudagraphs": False}
# Prompt plus answer a compiled step can hold. Every step attends over the whole static cache (masked), so a longer
# one costs each token time: 2,048 bfloat16 positions are 235 MB of keys and values read per step, against 3.4 GB
# of weights. A longer request decodes eagerly.
CONTEXT_TOKENS = 2048


class CompiledDecodeStep:
    def __init__(self, model, context_tokens: int = CONTEXT_TOKENS):
        self.model = model
        self.context_tokens = context_tokens
        self._cache = StaticCache(config=model.config.get_text_config(), max_cache_len=context_tokens)
        self._compiled = torch.compile(self._step, dynamic=False)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model.language_model(input_ids=input_ids, position_ids=position_ids, cache=self._cache,
                                                 use_cache=True).last_hidden_state
        return self.model.lm_head(hidden[:, -1])

    def fits(self, tokens: int) -> bool:
        return tokens <= self.context_tokens

    def take(self, cache: DynamicCache) -> None:
        """Start from a prefilled cache: its keys and values are copied in (positions past them are masked)."""
        for static, layer in zip(self._cache.layers, cache.layers):
            length = layer.keys.shape[2]
            if not static.is_initialized:
                static.lazy_initialization(layer.keys, layer.values)
            static.keys[:, :, :length].copy_(layer.keys)
            static.values[:, :, :length].copy_(layer.values)
            static.cumulative_length.fill_(length)

    def __call__(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._compiled(token, positions)

    def release(self) -> None:
        """Free the compiled code and what it holds. Dynamo keeps compiled graphs (with freezing, a copy of the
        language model's weights) in a cache of its own, keyed by the code of `_step`, not by this object: without
        this, a closed engine's frozen weights stay in memory (the quick bench was killed loading its fourth model).
        One engine is loaded at a time, so every compiled graph of the process goes."""
        self._compiled = self._cache = None
        torch._dynamo.reset()
        # Inductor's generated code is a Python module per graph, registered in sys.modules, whose globals hold the
        # frozen (and CPP GEMM-packed) weights: 4.4 GB of the full-size bfloat16 model stayed after close without
        # this, and an int8 engine loaded next decoded slower beside it.
        from torch._inductor.codecache import PyCodeCache

        for module in list(PyCodeCache.modules):
            if sys.modules.get(module.__name__) is module:
                del sys.modules[module.__name__]
        PyCodeCache.cache_clear()

    def give_back(self, cache: DynamicCache, length: int) -> None:
        """Append to `cache` the keys and values the steps added, up to `length` positions."""
        layers = self._cache.layers
        append_decoded(cache, [layer.keys for layer in layers], [layer.values for layer in layers], length)


def _steps_ms(model, prompt, step: CompiledDecodeStep | None, count: int) -> tuple[float, list[int]]:
    """Prefill `prompt`, then `count` greedy steps (eager, or through `step`); ms per step of the last half."""
    logits, state = prefill(model, prompt, None, None, True)
    if step is not None:
        step.take(state.cache)
        state.step = step
    token, tokens, times = int(logits.argmax()), [], []
    for _ in range(count):
        started = time.perf_counter()
        token = int(decode_one_token(model, state, token).argmax())
        times.append(time.perf_counter() - started)
        tokens.append(token)
    half = times[count // 2:]
    return 1000 * sum(half) / len(half), tokens


def prepare(loaded, mode: str, cache_dir: Path, progress=None) -> tuple[CompiledDecodeStep | None, str]:
    """Compile the decode step (mode "on"), or compile and keep it only where it measures faster ("auto").

    Returns the step or None, and one line saying what was decided and why. A compiler failure falls back to
    eager decode with that line, never a failed load. Runs on the compute thread. Inductor keeps what it can reuse
    (compiled kernels, autotuning choices) in `cache_dir`, the app's data folder, unless TORCHINDUCTOR_CACHE_DIR
    says otherwise."""
    report = progress or (lambda fraction, message: None)
    if mode == "off":
        return None, "eager decode (compilation off)"
    if mode == "auto" and not (loaded.dtype == "bfloat16" and loaded.compute_dtype == "bfloat16"):
        return None, (f"eager decode: {loaded.dtype} weights with {loaded.compute_dtype} compute decode no faster "
                      "compiled, or do not fit twice in memory (engine/decode_step.py); VLSCOPE_COMPILE=on forces it")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    model = loaded.model
    messages = chat_messages([], "Describe what a compiled decode step is in a few words.", [0])
    prompt = tokenize_prompt(loaded.tokenizer, messages, [], loaded.image_token_id)
    started = time.perf_counter()
    done = threading.Event()

    def tick() -> None:  # compilation is one long call: the caller's bar shows the time it has taken so far
        while not done.wait(1.0):
            report(0.96, f"Compiling the decode step: {time.perf_counter() - started:.0f} s "
                         "(2-3 minutes the first time on this machine)")

    ticker = threading.Thread(target=tick, name="vlscope-compile-clock", daemon=True)
    ticker.start()
    try:
        with torch.inference_mode():
            step = CompiledDecodeStep(model)
            # Compiled at its first call. Set globally, not as torch.compile's options: Dynamo reads `freezing`
            # while it traces, to keep the weights as constants instead of graph inputs. As options it went
            # unseen (no frozen copy in memory, 386 ms/token against 300 eager).
            with torch._inductor.config.patch(COMPILE_OPTIONS):
                _steps_ms(model, prompt, step, 8)
            compile_s = time.perf_counter() - started
            compiled_ms, compiled_tokens = _steps_ms(model, prompt, step, 8)
            eager_ms, eager_tokens = _steps_ms(model, prompt, None, 8)
    except Exception as exc:  # an inductor or compiler failure: eager decode still works
        log.exception("compiling the decode step failed")
        return None, f"eager decode: compiling failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    finally:
        done.set()
        ticker.join()
    if compiled_tokens != eager_tokens:
        log.warning("compiled decode step disagrees with eager: %s vs %s", compiled_tokens, eager_tokens)
        return None, "eager decode: the compiled step chose other tokens than eager decode"
    # eager here runs the plain kernels the compiler starts from; the engine packs them if it keeps eager decode
    figures = f"{compiled_ms:.0f} ms/token compiled, {eager_ms:.0f} eager, compiled in {compile_s:.0f} s"
    if mode == "auto" and compiled_ms >= eager_ms:
        return None, f"eager decode: measured faster here ({figures})"
    return step, f"compiled decode step ({figures})"

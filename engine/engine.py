"""The Engine: the model loaded once, a queue in front of it, and one streaming entry point.

    engine = Engine(EngineConfig(model="models/qwen3-vl-2b-skeleton"))
    for event in engine.stream(ChatRequest(prompt="Describe", images=("cat.png",))):
        ...  # Queued, StageStarted, TextChunk, and last the RequestMetrics
"""
from __future__ import annotations

import logging
import queue
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import psutil
import torch
from PIL import Image

from . import compute, decode_step
from .config import EngineConfig
from .errors import (
    Busy,
    GenerationFailed,
    InsufficientMemory,
    InvalidImage,
    PromptTooLong,
    VlscopeError,
)
from .direct_step import DirectDecodeStep
from .generate import Sampler, decode_n_tokens, encode_images, prefill, prefill_text
from .images import (
    enhance_for_ocr,
    fit_to_budget,
    load_request_images,
    vision_token_count,
)
from .memory import available_bytes, back_with_huge_pages, estimate_request_bytes
from .metrics import RequestMetrics, PeakRss
from .system import memory_read_gb_per_s
from .model_loading import LoadedModel, ProgressCallback, load_model, may_compile, pack_remaining_linears
from .prefix_cache import CachedSequence, PrefixCache, image_spans
from .preprocess import chat_messages, image_grids, patchify_images, tokenize_prompt
from .request import ChatRequest, Queued, StageStarted, TextChunk
from .scheduler import Job, RequestQueue
from .store import MetricsStore
from .trace import (
    CANCELLED,
    DECODE,
    DETOKENIZE,
    ERROR,
    LOAD_IMAGES,
    OCR_ENHANCE,
    OK,
    PREFILL,
    PREPROCESS,
    REFUSED,
    VISION_ENCODE,
    RequestTrace,
)

log = logging.getLogger(__name__)

Event = Union[Queued, StageStarted, TextChunk, RequestMetrics]


@dataclass(frozen=True)
class Answer:
    text: str
    metrics: RequestMetrics


@dataclass(frozen=True)
class EngineInfo:
    model: str
    synthetic: bool
    dtype: str
    threads: int
    weight_bytes: int
    load_seconds: float
    context_length: int
    compute_dtype: str | None = "float32"  # activations and KV cache (bfloat16 and int8 weights vary); None: unknown
    kv_cache: bool = True
    decode_weight_bytes: int = 0  # weights one decode step reads (language model and head); 0 when unknown
    decode: str = ""  # how decode steps run (compiled or eager) and why, with the load-time measurement
    notes: tuple[str, ...] = ()  # kernels this CPU cannot serve and what runs instead, one line each
    read_ceiling_gb_per_s: float | None = None  # memory read rate measured at load on the compute thread


class Detokenizer:
    """Turns token ids into text as they arrive, holding back a partial UTF-8 character until it is complete."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.text = text[len(self.text):], text
        return new


class StopStrings:
    """Cuts an answer before the first of its stop strings. Text that might be the start of one is held back until
    the next tokens tell, so a stop string split across tokens never reaches the client."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stop for stop in stops if stop)
        self.sent = 0  # characters of the answer released so far
        self.hit = False

    def release(self, text: str) -> str:
        """Given the whole answer so far, the part that may be shown now."""
        if self.hit:
            return ""
        if not self.stops:
            return self._advance(text, len(text))
        start = max(0, self.sent - max(len(stop) for stop in self.stops) + 1)
        found = [index for index in (text.find(stop, start) for stop in self.stops) if index >= 0]
        if found:
            self.hit = True
            return self._advance(text, min(found))
        held = 0
        for stop in self.stops:
            held = max(held, next((k for k in range(min(len(stop) - 1, len(text)), 0, -1)
                                   if text.endswith(stop[:k])), 0))
        return self._advance(text, max(self.sent, len(text) - held))

    def flush(self, text: str) -> str:
        """At the end of the answer: whatever was held back (none of it became a stop string)."""
        return "" if self.hit else self._advance(text, len(text))

    def _advance(self, text: str, until: int) -> str:
        new, self.sent = text[self.sent:until], until
        return new


class RequestHandle:
    """A submitted request: iterate `events()` for its stream; `cancel()` from any thread stops it."""

    def __init__(self, job: Job):
        self._job = job
        self.id = job.id

    def events(self) -> Iterator[Event]:
        while True:
            event = self.next_event()
            yield event
            if isinstance(event, RequestMetrics):
                return

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after `timeout` seconds without one. Raises the request's error, if any."""
        try:
            item = self._job.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._job.cancel()

    @property
    def cancelled(self) -> bool:
        return self._job.cancelled.is_set()


class StreamingMixin:
    """stream() and ask() for any engine with submit(): the local one and the remote one alike."""

    def stream(self, request: ChatRequest) -> Iterator[Event]:
        """Yield Queued, StageStarted and TextChunk events, then the RequestMetrics. Errors raise VlscopeError.

        Closing the generator early (a stop button, a rerun, a dropped connection) cancels the request."""
        handle = self.submit(request)
        try:
            yield from handle.events()
        finally:
            handle.cancel()

    def ask(self, request: ChatRequest) -> Answer:
        """The blocking form: the whole answer and its metrics."""
        parts: list[str] = []
        for event in self.stream(request):
            if isinstance(event, TextChunk):
                parts.append(event.text)
            elif isinstance(event, RequestMetrics):
                return Answer("".join(parts), event)
        raise GenerationFailed("the request ended without metrics")  # unreachable: events() ends with metrics


class Engine(StreamingMixin):
    def __init__(self, config: EngineConfig | None = None, progress: ProgressCallback | None = None,
                 store: MetricsStore | None = None):
        self.config = config or EngineConfig.from_env()
        report = progress or (lambda fraction, message: None)
        self.store = store if store is not None else MetricsStore(self.config.db_path)
        self.store.mark_interrupted(psutil.pid_exists)  # requests a killed server left running
        started = time.perf_counter()
        self.loaded: LoadedModel = compute.run(load_model, self.config, progress=report)
        self._decode_step, decode_note, step_notes = compute.run(self._prepare_decode_step, progress=report)
        report(0.965, "Moving the weights onto huge pages")
        log.info("weights: %.2f GB of the process on huge pages", back_with_huge_pages() / 1e9)
        # Beside the engine's own OpenMP team, as decode reads: another thread's figure mixes in a second team.
        read_ceiling = compute.run(memory_read_gb_per_s)
        text_config = self.loaded.model.config.get_text_config()
        self.info = EngineInfo(
            model=self.loaded.name,
            synthetic=self.loaded.synthetic,
            dtype=self.config.dtype,
            threads=self.config.threads,
            weight_bytes=self.loaded.weight_bytes,
            load_seconds=time.perf_counter() - started,  # compiling the decode step included
            context_length=int(text_config.max_position_embeddings),
            compute_dtype=self.loaded.compute_dtype,
            kv_cache=self.config.kv_cache,
            decode_weight_bytes=self.loaded.decode_weight_bytes,
            decode=decode_note,
            notes=self.loaded.notes + step_notes,
            read_ceiling_gb_per_s=read_ceiling,
        )
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._prefix_cache = PrefixCache(self.config.prefix_cache_entries if self.config.kv_cache else 0)
        self._queue = RequestQueue(lambda job: compute.run(self._run, job), max_waiting=self.config.max_queue)
        if self.config.warmup:
            report(0.97, "Warm-up request")
            self.warm_up()
        report(1.0, "Ready")

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    def submit(self, request: ChatRequest) -> RequestHandle:
        """Validate the images and queue the request. Raises InvalidImage or Busy (their metrics are recorded)."""
        job = Job(uuid.uuid4().hex, request)
        job.trace = trace = RequestTrace(job, self.info, self.config, self.store)
        try:
            with trace.stage(LOAD_IMAGES, announce=False):
                job.images = load_request_images(request, self.config, admit=self._queue.check_room)
            job.on_cancel = self._on_cancel
            self._queue.submit(job)
        except (InvalidImage, PromptTooLong, Busy) as exc:
            trace.finish(REFUSED, exc)
            raise
        return RequestHandle(job)

    def warm_up(self) -> RequestMetrics:
        """One short request at load, so the first user request does not pay for first-touch costs.

        A warm-up the settings refuse (say, an input limit below its size) is recorded and logged, not fatal."""
        image = Image.radial_gradient("L").convert("RGB").resize((256, 256))
        request = ChatRequest(prompt="Describe this image.", images=(image,), max_new_tokens=4, source="warmup",
                              warmup=True)
        try:
            return self.ask(request).metrics
        except VlscopeError as exc:
            log.warning("warm-up request did not run: %s", exc)
            return exc.metrics

    def close(self) -> None:
        self._queue.close()
        step, self._decode_step = self._decode_step, None
        if step is not None:
            compute.run(step.release)  # after any step still running: the compute thread takes one task at a time

    # ---- internals ----------------------------------------------------------------------------------------------

    def _prepare_decode_step(self, progress) -> tuple[DirectDecodeStep | None, str, tuple[str, ...]]:
        loaded, config, notes = self.loaded, self.config, []
        if config.kv_cache:
            step, note = decode_step.prepare(loaded, config.compile, config.kernels,
                                             Path(config.db_path).parent / "inductor", progress)
        else:
            step, note = None, "eager decode (no KV cache)"
        if step is None and config.kernels == "packed":
            if may_compile(config, loaded.compute_dtype):  # left plain for the compiler
                notes = [note for note in pack_remaining_linears(loaded.model, loaded.compute_dtype, progress)
                         if note not in loaded.notes]
            if config.kv_cache:
                step = DirectDecodeStep(loaded.model, decode_step.hidden_dtype(loaded))
                note = f"direct decode step; {note}"
        log.info("decode: %s", note)
        return step, note, tuple(notes)

    def _on_cancel(self, job: Job) -> None:
        if self._queue.withdraw(job):  # cancelled while waiting: the worker will never see it
            job.trace.finish(CANCELLED)

    def _run(self, job: Job) -> None:
        """Worker thread: one request from queue exit to metrics."""
        trace = job.trace
        trace.start()
        error: BaseException | None = None
        status = OK
        with torch.inference_mode(), PeakRss() as rss:
            try:
                status = CANCELLED if job.cancelled.is_set() else self._generate(job, trace)
            except VlscopeError as exc:
                status, error = (REFUSED if isinstance(exc, (PromptTooLong, InsufficientMemory)) else ERROR), exc
            except Exception as exc:
                log.exception("request %s failed", job.id)
                status, error = ERROR, GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
        trace.rss_bytes = (rss.before, rss.peak, rss.after)
        trace.finish(status, error)

    def _generate(self, job: Job, trace: RequestTrace) -> str:
        request, config, loaded = job.request, self.config, self.loaded
        model = loaded.model
        pictures = [image.image for image in job.images]
        if request.enhance_for_ocr and pictures:
            with trace.stage(OCR_ENHANCE):
                pictures = [enhance_for_ocr(picture) for picture in pictures]

        max_new_tokens = trace.max_new_tokens
        with trace.stage(PREPROCESS):
            sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels) for picture in pictures]
            image_counts = [len(turn.images) for turn in request.history if turn.role == "user"]
            messages = chat_messages(request.history, request.prompt, image_counts + [len(request.images)])
            prompt = tokenize_prompt(loaded.tokenizer, messages, sizes, loaded.image_token_id)
            prompt_tokens = prompt.input_ids.shape[1]
            trace.resized_sizes = tuple(sizes)
            trace.vision_tokens = sum(vision_token_count(size) for size in sizes)
            trace.prompt_tokens = prompt_tokens
            self._check_length(prompt_tokens, max_new_tokens)
            self._check_memory(sizes, prompt_tokens, max_new_tokens)
            keys = tuple(f"{image.sha256}/{int(request.enhance_for_ocr)}/{w}x{h}"
                         for image, (w, h) in zip(job.images, sizes))
            spans = image_spans(prompt.mm_token_type_ids)
            reuse = config.kv_cache and request.reuse_cache
            reused, start = self._prefix_cache.take(prompt.input_ids, keys, spans) if reuse else (None, 0)
            trace.cached_prompt_tokens = start
            # Only images after the reused prefix are encoded again.
            fresh = [index for index, (first, _) in enumerate(spans) if first >= start]
            patches = patchify_images(loaded.image_processor, [pictures[i] for i in fresh],
                                      [sizes[i] for i in fresh]) if fresh else None
            all_grids = image_grids(sizes)

        vision = None
        if patches is not None:
            with trace.stage(VISION_ENCODE):
                vision = encode_images(model, patches)
        if job.cancelled.is_set():
            return CANCELLED

        sampler = Sampler(
            temperature=trace.temperature,
            top_p=trace.top_p,
            generator=self._generator if request.seed is None else torch.Generator().manual_seed(request.seed),
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias, top_logprobs=request.top_logprobs,
        )
        step = self._decode_step  # none without a KV cache
        with trace.stage(PREFILL):
            if step is not None and vision is None:  # text only from `start`: the step prefills it too
                logits, state = prefill_text(model, prompt, all_grids, step,
                                             cache=reused.cache if reused else None, start=start)
            else:
                logits, state = prefill(model, prompt, vision, all_grids, config.kv_cache,
                                        cache=reused.cache if reused else None, start=start)
                if step is not None:  # its buffers grow: any length fits
                    step.take(state.cache)
                    state.step = step
            token = sampler(logits)
        status = self._decode(job, trace, state, token, sampler)
        if state.step is not None:
            state.step.give_back(state.cache, state.tokens.shape[1])
        if state.cache is not None:  # prompt and answer so far: the start of this conversation's next turn
            self._prefix_cache.put(CachedSequence(state.tokens, state.cache, keys, spans))
        return status

    def _decode(self, job: Job, trace: RequestTrace, state, token: int, sampler: Sampler) -> str:
        loaded, emit, model = self.loaded, job.events.put, self.loaded.model

        detokenizer = Detokenizer(loaded.tokenizer)
        stops = StopStrings(job.request.stop)
        stop_ids = set() if job.request.ignore_eos else set(loaded.eos_token_ids)
        latencies: list[float] = []
        output_tokens = 0
        shown_logprobs = 0  # sampler.logprobs already attached to a chunk

        def show(text: str) -> None:
            nonlocal shown_logprobs
            logprobs = tuple(sampler.logprobs[shown_logprobs:output_tokens])
            if text or logprobs:
                shown_logprobs += len(logprobs)
                emit(TextChunk(text, logprobs))

        def take(token: int) -> bool:
            """Count and show one answer token; True once a stop string has ended the answer."""
            nonlocal output_tokens
            output_tokens += 1
            with trace.stage(DETOKENIZE, announce=False):
                detokenizer.push(token)
                text = stops.release(detokenizer.text)
            trace.first_token()
            show(text)
            return stops.hit

        ended = token in stop_ids
        if not ended and not take(token):
            trace.announce(DECODE)
            steps = decode_n_tokens(model, state, token, trace.max_new_tokens - 1, sampler, stop_ids,
                                    job.cancelled.is_set)
            while True:
                started = time.perf_counter()
                token = next(steps, None)
                if token is None:
                    break
                step = time.perf_counter() - started
                latencies.append(step)
                trace.add(DECODE, step)
                if token in stop_ids:
                    ended = True
                    break
                if take(token):
                    break
        trace.first_token()
        show(stops.flush(detokenizer.text))

        decode_seconds = sum(latencies)
        cancelled = job.cancelled.is_set()
        trace.output_tokens = output_tokens
        trace.token_latencies_s = tuple(latencies)
        trace.decode_tokens_per_s = (len(latencies) / decode_seconds) if decode_seconds > 0 else None
        trace.answer = detokenizer.text[:stops.sent]
        trace.finish_reason = None if cancelled else "stop" if ended or stops.hit else "length"
        return CANCELLED if cancelled else OK

    def _check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens > self.config.max_input_tokens:
            raise PromptTooLong(
                f"The prompt is {prompt_tokens} tokens (text, earlier turns and images); the limit is "
                f"{self.config.max_input_tokens}. Shorten the conversation, use fewer or smaller images, "
                "or lower the image token budget."
            )
        if prompt_tokens + max_new_tokens > self.info.context_length:
            raise PromptTooLong(
                f"The prompt ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds the model's context "
                f"of {self.info.context_length} tokens."
            )

    def _check_memory(self, sizes, prompt_tokens: int, max_new_tokens: int) -> None:
        patches = sum(width * height // 256 for width, height in sizes)
        value_bytes = 4 if self.loaded.compute_dtype == "float32" else 2
        need = estimate_request_bytes(self.loaded.model.config, patches, prompt_tokens, max_new_tokens, value_bytes,
                                      float32_decode_cache=isinstance(self._decode_step, DirectDecodeStep))
        room = self.config.memory_limit_bytes or available_bytes()
        if need > room:
            raise InsufficientMemory(
                f"This request needs about {need / 2**30:.1f} GiB beyond the model's weights and "
                f"{room / 2**30:.1f} GiB is available. Use fewer or smaller images, a lower image token budget, "
                "fewer new tokens, or bfloat16."
            )

"""The engine as callers hold it, importing no torch: `submit` and `stream`, a request's handle and events, and the
intake the local and remote engines share. The local Engine starts its core (the model, torch) on the compute
thread and drives the engine loop: intake -> scheduler plan -> runner step -> output.

    engine = Engine(EngineConfig(model="models/qwen3-vl-2b-skeleton"))
    for event in engine.stream(ChatRequest(prompt="Describe", images=("cat.png",))):
        ...  # Queued, StageStarted, TextChunk, and last the RequestMetrics
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import psutil
from PIL import Image

from .config import EngineConfig
from .core import compute
from .core.request_state import RequestState
from .errors import (Busy, Cancelled, GenerationFailed, InvalidImage, InvalidPrompt, InvalidSchema, InvalidVideo,
                     PromptTooLong, VlscopeError)
from .inputs.documents import expand_documents
from .inputs.images import load_request_images
from .inputs.limits import check_size, check_text, control_tokens
from .inputs.video import decode_budget, decode_frames, plan_request_videos, request_videos
from .model.memory_pages import release_freed_memory
from .records.info import EngineInfo
from .records.metrics import RequestMetrics
from .records.stages import CANCELLED, FRAME_DECODE, GRAMMAR, REFUSED, VIDEO_PROBE
from .records.store import MetricsStore, open_store
from .request import ChatRequest, Queued, StageProgress, StageStarted, TextChunk
from .structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)

Event = Union[Queued, StageStarted, StageProgress, TextChunk, RequestMetrics]
ProgressCallback = Callable[[float, str], None]  # (fraction done 0..1, what is happening)


@dataclass(frozen=True)
class Answer:
    text: str
    metrics: RequestMetrics


class RequestHandle:
    """A submitted request: iterate `events()` for its stream; `cancel()` from any thread stops it."""

    def __init__(self, state: RequestState):
        self._state = state
        self.id = state.id

    def events(self) -> Iterator[Event]:
        while True:
            event = self.next_event()
            yield event
            if isinstance(event, RequestMetrics):
                return

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after `timeout` seconds without one. Raises the request's error, if any."""
        try:
            item = self._state.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._state.cancel()

    @property
    def cancelled(self) -> bool:
        return self._state.cancelled.is_set()


def take_in(state: RequestState, config: EngineConfig, admit: Callable[[], None],
            control: tuple[str, ...] = (), constrain: Callable | None = None) -> None:
    """Intake, the same for the local and the remote engine: the request's size and text checked from counts, its
    answer's grammar compiled (`constrain(request, config)`, local engine), its documents expanded into pages, its
    images read within every limit (`admit()` raising Busy before any is decoded). A refusal is recorded, then
    raised."""
    trace = state.trace
    try:
        check_size(state.request, config)
        check_text(state.request, control)
        check_structure(state.request)
        if constrain is not None and (state.request.json_schema is not None or state.request.tools):
            with trace.stage(GRAMMAR, announce=False):
                state.grammar = constrain(state.request, config)
        planned = []
        if request_videos(state.request):  # clips are checked from their headers before any image is decoded
            admit()  # and a full server opens none
            with trace.stage(VIDEO_PROBE, announce=False):
                planned = plan_request_videos(state.request, config)
        with trace.loading_images() as clock:
            # A document's pages are counted and sized first, then rendered as each request's images are decoded.
            state.request = expand_documents(state.request, config)
            state.images = load_request_images(state.request, config, admit=admit, clock=clock)
        if planned:
            with trace.stage(FRAME_DECODE, announce=False):
                try:
                    state.videos = [decode_frames(header, plan, **decode_budget(config),
                                                  cancelled=state.cancelled.is_set) for header, plan in planned]
                finally:
                    release_freed_memory()  # full-size frames come and go by the hundred megabytes
    except (InvalidImage, InvalidVideo, InvalidPrompt, InvalidSchema, PromptTooLong, Busy) as exc:
        trace.finish(REFUSED, exc)
        raise
    except Cancelled as exc:
        trace.finish(CANCELLED, exc)
        raise


def check_structure(request: ChatRequest) -> None:
    """What would break a structured answer's promise: an end token it must never ignore, a stop string that could
    cut it mid-document."""
    if request.json_schema is None and not request.calls_only:
        return
    if request.ignore_eos:
        raise InvalidPrompt("ignore_eos cannot be combined with a response format or forced tool calls: the answer "
                            "ends where its JSON does", about="ignore_eos")
    if request.stop:
        raise InvalidPrompt("stop strings cannot be combined with a response format or forced tool calls: they could "
                            "cut the JSON short; use max_tokens to bound the answer", about="stop")


class StreamingMixin:
    """stream() and ask() for any engine with submit(): the local one and the remote one alike."""

    def stream(self, request: ChatRequest) -> Iterator[Event]:
        """Yield Queued, StageStarted, StageProgress and TextChunk events, then the RequestMetrics. Errors raise
        VlscopeError.

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
    """The local engine: its core loaded on the compute thread, and the loop that steps it while there is work."""

    serves_logprobs = True

    def __init__(self, config: EngineConfig | None = None, progress: ProgressCallback | None = None,
                 store: MetricsStore | None = None):
        # The core imports torch and transformers (seconds): only an engine that runs a model pays for them.
        from .core.engine_core import EngineCore

        config = config or EngineConfig.from_env()
        report = progress or (lambda fraction, message: None)
        self.store = store if store is not None else open_store(config)
        self.store.mark_interrupted(psutil.pid_exists)  # requests a killed server left running
        self._core = compute.run(EngineCore, config, progress=report)
        self.info: EngineInfo = self._core.info
        self.loaded = self._core.runner.loaded
        self._scheduler = self._core.scheduler
        self._control_tokens = control_tokens(self.loaded.tokenizer)
        self._grammars = GrammarCompiler(self.loaded.tokenizer, self.loaded.vocab_size, self.loaded.eos_token_ids)
        if self.config.warmup:  # a serving engine: built beside the warm-up, so no first structured answer waits
            threading.Thread(target=self._grammars.warm_up, name="vlscope-grammar-tables",
                             daemon=True).start()
        self._loop = threading.Thread(target=self._run_loop, name="vlscope-engine-loop", daemon=True)
        self._loop.start()
        if self.config.warmup:
            report(0.97, "Warm-up request")
            self.warm_up()
        report(1.0, "Ready")

    def _run_loop(self) -> None:
        """Step the core on the compute thread while there is work; the loop must outlive any request."""
        while self._scheduler.wait_for_work():
            try:
                compute.run(self._core.step)
            except BaseException:
                log.exception("the engine loop's step failed outside its own error handling")
                self._scheduler.drop_all()

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The settings in force: the core's, which reads them at each admission."""
        return self._core.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._core.config = config

    @property
    def model_name(self) -> str:
        return self.info.model

    def token_text(self, token: int) -> str:
        return self.loaded.tokenizer.decode([token])

    @property
    def alive(self) -> bool:
        """Whether the engine loop still runs (a replica's health check asks)."""
        return self._loop.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._scheduler.depth

    @property
    def active_sequences(self) -> int:
        """Requests decoding now, together in each step."""
        return self._scheduler.running

    @property
    def decode_step(self):
        """The step that advances running requests a token each (None: transformers' forward, one at a time)."""
        return self._core.runner.decode_step

    def batch_limit(self) -> int:
        return self._core.batch_limit()

    def submit(self, request: ChatRequest, cancelled: threading.Event | None = None) -> RequestHandle:
        """Validate the text and images and queue the request. Raises InvalidPrompt, InvalidImage or Busy (their
        metrics are recorded). `cancelled`, set from another thread, stops it even before this returns (a clip's
        frames are decoded here): Cancelled."""
        state = RequestState(request, self.info, self.config, self.store, cancelled)
        take_in(state, self.config, self._scheduler.check_room, self._control_tokens, self._grammars.for_request)
        state.on_cancel = self._on_cancel
        try:
            self._scheduler.submit(state)
        except Busy as exc:
            state.trace.finish(REFUSED, exc)
            raise
        return RequestHandle(state)

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
        self._grammars.close()
        self._scheduler.close()
        if threading.current_thread() is not self._loop:
            self._loop.join(30.0)  # nothing keeps the engine (and its weights) alive after
        compute.run(self._core.release)  # after any step still running: the compute thread takes one task at a time

    def _on_cancel(self, state: RequestState) -> None:
        if self._scheduler.withdraw(state):  # cancelled while waiting: the loop will never see it
            state.trace.finish(CANCELLED)

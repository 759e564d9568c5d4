"""The Engine: the model loaded once, a scheduler in front of it that decodes the running requests together, and
one streaming entry point.

    engine = Engine(EngineConfig(model="models/qwen3-vl-2b-skeleton"))
    for event in engine.stream(ChatRequest(prompt="Describe", images=("cat.png",))):
        ...  # Queued, StageStarted, TextChunk, and last the RequestMetrics
"""
from __future__ import annotations

import logging
import queue
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Union

import psutil
import torch
from PIL import Image

from .core import compute
from .model import decode_backend as decode_step
from .config import EngineConfig
from .errors import (
    Busy,
    GenerationFailed,
    InsufficientMemory,
    InvalidImage,
    InvalidPrompt,
    PromptTooLong,
    VlscopeError,
)
from .kernels.decode_attention import best as best_attention
from .kernels.direct_step import DirectDecodeStep
from .model.generate import (DecodeState, Sampler, attach_step, decode_batch, decode_one_token, detach_step,
                       encode_images_in_pieces, prefill_in_pieces, prefill_text)
from .inputs.documents import expand_documents
from .inputs.images import load_request_images
from .inputs.limits import check_memory, check_size, check_text, control_tokens
from .inputs.preprocess import ocr_pictures, prepare_input
from .model.memory_pages import back_with_huge_pages, huge_pages_pay
from .records.metrics import RequestMetrics, PeakRss, current_rss
from .core.output import SequenceOutput
from .kernels.packing import decode_rows
from .kernels.system import memory_read_gb_per_s
from .model.loading import LoadedModel, ProgressCallback, load_model, may_compile, pack_remaining_linears
from .core.prefix_cache import CachedSequence, PrefixCache, image_spans
from .inputs.preprocess import image_grids, patchify_images
from .request import ChatRequest, Queued, StageStarted, TextChunk
from .core.scheduler import Job, Scheduler
from .records.store import MetricsStore, open_store
from .records.stages import CANCELLED, DECODE, DETOKENIZE, ERROR, OCR_ENHANCE, OK, PREFILL, PREPROCESS, REFUSED, VISION_ENCODE
from .records.trace import RequestTrace

log = logging.getLogger(__name__)

# An admission's vision encode yields to the running answers once a piece has run this long: their longest pause is
# about this plus one vision block.
ADMISSION_PIECE_SECONDS = 0.6
# Beside running answers a prefill goes in chunks sized to take about this long each, the first of FIRST_PREFILL_CHUNK
# tokens: a running stream's pause is then a chunk and a decode step (docs/decisions.md).
PREFILL_PIECE_SECONDS = 0.9
FIRST_PREFILL_CHUNK = 32


def chunk_for(tokens: int, seconds: float, target_s: float) -> int:
    """The next prefill chunk's tokens, from the last chunk's `tokens` taking `seconds`: about `target_s` at that
    rate, in multiples of 8, between 8 and 1,024."""
    rate = tokens / max(seconds, 1e-3)
    return max(8, min(1024, int(rate * target_s) // 8 * 8))

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


class Admission:
    """A job being admitted: its pieces run one at a time on the compute thread (`advance`), a decode step of the
    running sequences between each two; `sequence` is set once they are done (None: the request already ended)."""

    def __init__(self, job: Job, pieces):
        self.job, self._pieces = job, pieces
        self.sequence: "Sequence | None" = None
        self.done = False

    def advance(self) -> None:
        with torch.inference_mode():
            try:
                next(self._pieces)
            except StopIteration as finished:
                self.sequence, self.done = finished.value, True


@dataclass(eq=False)
class Sequence:
    """A request past its first token: its place in the model, its sampler, its output and its books."""

    job: Job
    trace: RequestTrace
    state: DecodeState
    sampler: Sampler
    output: SequenceOutput
    keys: tuple  # its images' cache keys and spans: the prefix cache keeps its conversation under them
    spans: tuple
    token: int  # the last sampled token: the next step's input
    latencies: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)  # before, peak


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
        self.store = store if store is not None else open_store(self.config)
        self.store.mark_interrupted(psutil.pid_exists)  # requests a killed server left running
        started = time.perf_counter()
        self.loaded: LoadedModel = compute.run(load_model, self.config, progress=report)
        self._decode_step, decode_note, step_notes = compute.run(self._prepare_decode_step, progress=report)
        if huge_pages_pay(self.loaded.weight_bytes):
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
        self._control_tokens = control_tokens(self.loaded.tokenizer)
        self._running: list[Sequence] = []  # the batch an admission runs beside, for its memory check
        self._prefix_cache = PrefixCache(self.config.prefix_cache_entries if self.config.kv_cache else 0)
        self._queue = Scheduler(self._begin, self._admit, self._step, max_waiting=self.config.max_queue,
                                batch_limit=self.batch_limit)
        if self.config.warmup:
            report(0.97, "Warm-up request")
            self.warm_up()
        report(1.0, "Ready")

    # ---- public API -------------------------------------------------------------------------------------------

    serves_logprobs = True

    @property
    def model_name(self) -> str:
        return self.info.model

    def token_text(self, token: int) -> str:
        return self.loaded.tokenizer.decode([token])

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    @property
    def active_sequences(self) -> int:
        """Requests decoding now, together in each step."""
        return self._queue.running

    @property
    def decode_step(self) -> DirectDecodeStep | None:
        """The step that advances running sequences a token each (None: transformers' forward, one at a time)."""
        return self._decode_step

    def batch_limit(self) -> int:
        """How many sequences decode together: the setting where the direct decode step runs, else one at a time
        (transformers' forward decodes one sequence)."""
        return self.config.max_batch if self._decode_step is not None else 1

    def submit(self, request: ChatRequest) -> RequestHandle:
        """Validate the text and images and queue the request. Raises InvalidPrompt, InvalidImage or Busy (their
        metrics are recorded)."""
        job = Job(uuid.uuid4().hex, request)
        job.trace = trace = RequestTrace(job, self.info, self.config, self.store)
        try:
            check_size(request, self.config)
            check_text(request, self._control_tokens)
            with trace.loading_images() as clock:
                # A document's pages are counted and sized first, then rendered as each request's images are decoded.
                job.request = request = expand_documents(request, self.config)
                job.images = load_request_images(request, self.config, admit=self._queue.check_room, clock=clock)
            job.on_cancel = self._on_cancel
            self._queue.submit(job)
        except (InvalidImage, InvalidPrompt, PromptTooLong, Busy) as exc:
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
                rows = decode_rows(config.max_batch, config.kv_cache)
                notes = [note for note in pack_remaining_linears(loaded.model, loaded.compute_dtype, progress, rows)
                         if note not in loaded.notes]
            if config.kv_cache:
                step = DirectDecodeStep(loaded.model, decode_step.hidden_dtype(loaded))
                note = f"direct decode step; {note}"
        if config.kv_cache:
            note = f"{note}; {best_attention()[1]}"
        log.info("decode: %s", note)
        return step, note, tuple(notes)

    def _on_cancel(self, job: Job) -> None:
        if self._queue.withdraw(job):  # cancelled while waiting: the worker will never see it
            job.trace.finish(CANCELLED)

    def _begin(self, job: Job) -> Admission:
        return Admission(job, self._admission(job))

    def _admit(self, admission: Admission, running: list["Sequence"]) -> None:
        """Worker thread: the next piece of an admission on the compute thread, between two decode steps of the
        `running` sequences, which wait for it: the time goes on their records as paused."""
        self._running = running
        started = time.perf_counter()
        try:
            compute.run(admission.advance)
        finally:
            paused = time.perf_counter() - started
            for sequence in running:
                sequence.trace.paused_s += paused

    def _admission(self, job: Job):
        """A request from queue exit to its first token, in pieces that each end at a `yield` (preprocess and
        encode; prefill and the first token), so running streams take a step between them. Returns the sequence
        that goes on decoding, or None once the request has ended (an error, a cancel, an answer of one token)."""
        trace = job.trace
        trace.start()
        rss = PeakRss()
        rss.__enter__()
        status, error, sequence = CANCELLED, None, None
        try:
            if not job.cancelled.is_set():
                sequence = yield from self._prefill(job, trace)
        except VlscopeError as exc:
            status, error = (REFUSED if isinstance(exc, (PromptTooLong, InsufficientMemory)) else ERROR), exc
        except Exception as exc:
            log.exception("request %s failed", job.id)
            status, error = ERROR, GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            rss.__exit__(None, None, None)
        if sequence is None:
            trace.rss_bytes = (rss.before, rss.peak, rss.after)
            trace.finish(status, error)
            return None
        sequence.rss = [rss.before, rss.peak]
        if sequence.output.stopped or sequence.output.tokens >= trace.max_new_tokens or job.cancelled.is_set():
            self._end(sequence)
            return None
        trace.announce(DECODE)
        return sequence

    def _wait_for_memory(self, job: Job, fits: Callable[[], None]):
        """Admission piece by piece while `fits()` refuses only for the room the running answers hold: the request
        waits a decode step at a time until they end. Refused (InsufficientMemory) when it would not fit even
        alone; False when it was cancelled while waiting."""
        while True:
            try:
                fits()
                return True
            except InsufficientMemory:
                if not self._running:
                    raise
            if not job.waiting_for_memory:
                job.waiting_for_memory = True
                log.info("request %s waits for the running answers' memory", job.id)
            yield
            if job.cancelled.is_set():
                return False

    def _reserved_bytes(self) -> int:
        """Keys and values the running answers will still add, up to their length limits."""
        step = self._decode_step
        if step is None:
            return 0
        return sum(max(0, step.kv_bytes(sequence.trace.prompt_tokens + sequence.trace.max_new_tokens)
                          - step.kv_bytes(sequence.state.tokens.shape[1]))
                   for sequence in self._running if sequence.state.kv is not None)

    def _prefill(self, job: Job, trace: RequestTrace) -> "Sequence | None":
        request, config, loaded = job.request, self.config, self.loaded
        model = loaded.model
        pictures = [image.image for image in job.images]
        if request.enhance_for_ocr and pictures:
            with trace.stage(OCR_ENHANCE):
                pictures = ocr_pictures(job)

        with trace.stage(PREPROCESS):
            prepared = prepare_input(job, pictures, loaded, config, self.info.context_length)
            prompt, sizes, keys = prepared.prompt, prepared.sizes, prepared.keys

        def fits() -> None:
            check_memory(model.config, sizes, trace.prompt_tokens, trace.max_new_tokens, loaded.compute_dtype,
                         isinstance(self._decode_step, DirectDecodeStep), self.config.memory_limit_bytes,
                         self._reserved_bytes())

        if not (yield from self._wait_for_memory(job, fits)):
            return None
        with trace.stage(PREPROCESS):
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
            yield  # preprocessing done: the running streams take a step
            trace.announce(VISION_ENCODE)
            pieces = encode_images_in_pieces(model, patches, ADMISSION_PIECE_SECONDS)
            while True:  # timed piece by piece: the steps between them are other requests' time
                started = time.perf_counter()
                try:
                    next(pieces)
                except StopIteration as encoded:
                    trace.add(VISION_ENCODE, time.perf_counter() - started)
                    vision = encoded.value
                    break
                trace.add(VISION_ENCODE, time.perf_counter() - started)
                yield
                if job.cancelled.is_set():
                    return None
        yield  # encoding done: another step before the prefill
        if job.cancelled.is_set():
            return None

        sampler = Sampler(
            temperature=trace.temperature,
            top_p=trace.top_p,
            generator=self._generator if request.seed is None else torch.Generator().manual_seed(request.seed),
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias, top_logprobs=request.top_logprobs,
        )
        step = self._decode_step  # none without a KV cache
        if step is not None and vision is None:  # text only from `start`: the step prefills it too
            with trace.stage(PREFILL):
                logits, state = prefill_text(model, prompt, all_grids, step,
                                             cache=reused.cache if reused else None, start=start)
        else:
            # Beside running answers the prompt goes in chunks, each followed by their next step, each sized from
            # the last one's rate to take about PREFILL_PIECE_SECONDS; alone it goes in one (chunks cost a lone
            # request time: docs/decisions.md).
            trace.announce(PREFILL)
            chunk = [FIRST_PREFILL_CHUNK]
            pieces = prefill_in_pieces(model, prompt, vision, all_grids, config.kv_cache,
                                       cache=reused.cache if reused else None, start=start,
                                       chunk=(lambda: chunk[0]) if self._running else None)
            while True:
                started = time.perf_counter()
                try:
                    next(pieces)
                except StopIteration as prefilled:
                    logits, state = prefilled.value
                    break
                took = time.perf_counter() - started
                trace.add(PREFILL, took)
                chunk[0] = chunk_for(chunk[0], took, PREFILL_PIECE_SECONDS)
                yield
                if job.cancelled.is_set():
                    return None
            if step is not None:  # its buffers grow: any length fits
                attach_step(state, step)
            trace.add(PREFILL, time.perf_counter() - started)
        with trace.stage(PREFILL, announce=False):
            token = sampler(logits)
        stop_ids = set() if request.ignore_eos else set(loaded.eos_token_ids)
        output = SequenceOutput(loaded.tokenizer, request.stop, stop_ids, job.events.put, sampler.logprobs)
        sequence = Sequence(job, trace, state, sampler, output, keys, spans, token)
        with trace.stage(DETOKENIZE, announce=False):
            output.take(token)
        trace.first_token()
        return sequence

    def _step(self, sequences: list["Sequence"]) -> list["Sequence"]:
        """Worker thread: every running sequence one token further, in one step on the compute thread. Returns the
        sequences that ended (answered, stopped, cancelled or failed); each has its record."""
        return compute.run(self._advance, sequences)

    def _advance(self, sequences: list["Sequence"]) -> list["Sequence"]:
        ended = [sequence for sequence in sequences if sequence.job.cancelled.is_set()]
        live = [sequence for sequence in sequences if sequence not in ended]
        if live:
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    logits = self._decode_logits(live)
            except Exception as exc:
                log.exception("a decode step of %d sequence(s) failed", len(live))
                error = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
                for sequence in live:
                    self._end(sequence, error)
                return sequences
            elapsed, rss = time.perf_counter() - started, current_rss()
            for row, sequence in enumerate(live):
                trace, output = sequence.trace, sequence.output
                sequence.latencies.append(elapsed)
                sequence.batch_sizes.append(len(live))
                sequence.rss[1] = max(sequence.rss[1], rss)
                trace.add(DECODE, elapsed)
                sequence.token = sequence.sampler(logits[row:row + 1])
                with trace.stage(DETOKENIZE, announce=False):
                    output.take(sequence.token)
                if output.stopped or output.tokens >= trace.max_new_tokens:
                    ended.append(sequence)
        for sequence in ended:
            self._end(sequence)
        return ended

    def _decode_logits(self, sequences: list["Sequence"]) -> torch.Tensor:
        """The next logits of each sequence, row by row: one batched step of the direct decode step, or (plain
        kernels, no KV cache: batches of one) transformers' forward."""
        if sequences[0].state.step is None:
            (sequence,) = sequences
            return decode_one_token(self.loaded.model, sequence.state, sequence.token)
        return decode_batch(self._decode_step, [sequence.state for sequence in sequences],
                            [sequence.token for sequence in sequences])

    def _end(self, sequence: "Sequence", error: BaseException | None = None) -> None:
        """Close a sequence's books: its keys and values back to the prefix cache, the held-back text out, its
        record stored and posted."""
        job, trace, state, output = sequence.job, sequence.trace, sequence.state, sequence.output
        cancelled = job.cancelled.is_set()
        try:
            detach_step(state)
            if state.cache is not None and error is None:  # prompt and answer so far: the next turn's start
                self._prefix_cache.put(CachedSequence(state.tokens, state.cache, sequence.keys, sequence.spans))
        except Exception:
            log.exception("request %s: its cache could not be kept", job.id)
        output.finish()
        decode_seconds = sum(sequence.latencies)
        trace.output_tokens = output.tokens
        trace.token_latencies_s = tuple(sequence.latencies)
        trace.decode_batch_sizes = tuple(sequence.batch_sizes)
        trace.decode_tokens_per_s = (len(sequence.latencies) / decode_seconds) if decode_seconds > 0 else None
        trace.answer = output.answer
        trace.finish_reason = None if cancelled or error else "stop" if output.stopped else "length"
        after = current_rss()
        trace.rss_bytes = (sequence.rss[0], max(sequence.rss[1], after), after)
        status = ERROR if error is not None else CANCELLED if cancelled else OK
        trace.finish(status, error)

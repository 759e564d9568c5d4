"""A request's bookkeeping, owned in one place: the settings the request resolved to, what it processed and how long
each stage took, and the record it leaves behind. It is one part of the request's state (core/request_state.py),
which makes it:

    trace = state.trace
    with trace.stage(PREFILL):        # tells the stream the stage began, and times it
        ...
    trace.finish(OK)                  # builds the RequestMetrics, stores it, posts it to the request's stream

Both engines (local and remote) keep their books through it; the stage and status names are records/stages.py's.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..config import EngineConfig
from ..inputs.documents import RenderClock
from ..inputs.limits import fit_to_budget, vision_token_count
from .metrics import RequestMetrics, current_rss
from .stages import DECODE, LOAD_IMAGES, REFUSED, RENDER_PAGES, RUNNING
from ..request import StageProgress, StageStarted

log = logging.getLogger(__name__)


class RequestTrace:
    """One request's books, from submission to its stored record. Written by one thread at a time: the caller's
    until the request is queued, then the worker's."""

    def __init__(self, state, info, config: EngineConfig, store):
        """`state`: the request's state (core/request_state.py), whose part these books are; its sampling
        parameters were settled there, and are written down here as they are."""
        self.state, self.info, self.config, self.store = state, info, config, store
        # What it processed and what it cost; filled as stages end.
        self.seconds: dict[str, float] = {}
        self.started_at: float | None = None
        self.queue_wait_s = 0.0
        self.resized_sizes: tuple[tuple[int, int], ...] | None = None  # None: as the image budget fits them
        self.vision_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.output_tokens = 0
        self.token_latencies_s: list[float] = []  # a decode step's time, once per token after the first
        self.decode_batch_sizes: list[int] = []  # how many requests shared that step
        self.drafted_tokens = self.drafts_kept = 0
        self.forced_tokens = 0
        self.paused_s = 0.0
        self.ttft_s: float | None = None
        self.decode_tokens_per_s: float | None = None
        self.finish_reason: str | None = None
        self.schema_loosened: tuple[str, ...] = ()
        self.schema_violations: tuple[str, ...] = ()
        self.answer: str | None = None
        self.server_metrics: dict | None = None
        self.rss_bytes: tuple[int, int, int] | None = None  # before, peak, after; None: one reading at the end
        self.document_pages: tuple[dict, ...] = ()

    @contextmanager
    def loading_images(self):
        """The load_images stage, with the pages of any document rendered inside it told apart as render_pages:
        yields the clock that times them."""
        clock = RenderClock()
        started = time.perf_counter()
        try:
            yield clock
        finally:
            self.add(LOAD_IMAGES, time.perf_counter() - started - clock.seconds)
            if clock.pages:
                self.add(RENDER_PAGES, clock.seconds)
                self.document_pages = tuple(
                    {"document": image.document, "page": image.page, "rendered": list(image.original_size),
                     "vision_tokens": vision_token_count(fit_to_budget(*image.original_size, self.config.min_pixels,
                                                                       self.config.max_pixels))}
                    for image in self.state.images if image.page is not None)

    # ---- stages ---------------------------------------------------------------------------------------------------

    @contextmanager
    def stage(self, name: str, announce: bool = True):
        """Time one stage boundary to boundary; `announce` first tells the request's stream that it began."""
        if announce:
            self.announce(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def announce(self, name: str) -> None:
        self.state.events.put(StageStarted(name))

    def progress(self, name: str, done: int, total: int, unit: str) -> None:
        self.state.events.put(StageProgress(name, done, total, unit))

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def decoded(self, seconds: float, batch_size: int) -> None:
        """One decode step gave this request a token: the step took `seconds`, shared by `batch_size` requests."""
        self.token_latencies_s.append(seconds)
        self.decode_batch_sizes.append(batch_size)

    def drafted(self, proposed: int, kept: int) -> None:
        """How many tokens were drafted for this request so far, and how many of them the model kept."""
        self.drafted_tokens, self.drafts_kept = proposed, kept

    def first_token(self) -> None:
        """The first answer text exists now (only the first call counts)."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.state.submitted_perf

    # ---- the record -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """The worker took the request. It goes on record before any compute: if the process dies now, the next
        start relabels it interrupted."""
        self.started_at = time.time()
        self.queue_wait_s = time.perf_counter() - self.state.enqueued_perf
        self.store.add(self.record(RUNNING))

    def finish(self, status: str, error: BaseException | None = None) -> RequestMetrics:
        """Build the final record, store it, and post it to the request's stream: the error (carrying the record as
        its `metrics`) if there is one, else the record."""
        metrics = self.record(status, error)
        if self.config.store_content:
            self._save_images()
        self.store.add(metrics)
        self.state.finished.set()
        if error is not None:
            error.metrics = metrics
            self.state.events.put(error)
        else:
            self.state.events.put(metrics)
        return metrics

    def record(self, status: str, error: BaseException | None = None) -> RequestMetrics:
        state, config, info, request = self.state, self.config, self.info, self.state.request
        rss = self.rss_bytes or (current_rss(),) * 3
        store_content = config.store_content
        return RequestMetrics(
            id=state.id,
            status=status,
            source=request.source,
            warmup=request.warmup,
            submitted_at=state.submitted_at,
            finished_at=time.time(),
            model=info.model,
            synthetic=info.synthetic or bool((self.server_metrics or {}).get("synthetic", False)),
            dtype=info.dtype,
            compute_dtype=info.compute_dtype,
            threads=info.threads,
            kv_cache=info.kv_cache,
            weight_bytes=info.weight_bytes,
            decode_weight_bytes=info.decode_weight_bytes,
            min_pixels=config.min_pixels,
            max_pixels=config.max_pixels,
            max_new_tokens=state.params.max_new_tokens,
            temperature=state.params.temperature,
            top_p=state.params.top_p,
            image_sizes=tuple(image.original_size for image in state.images),
            resized_sizes=self.resized_sizes if self.resized_sizes is not None else self._budget_sizes(),
            vision_tokens=self.vision_tokens,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            output_tokens=self.output_tokens,
            started_at=self.started_at,
            queue_wait_s=self.queue_wait_s,
            stages=self._stages(),
            token_latencies_s=tuple(self.token_latencies_s),
            decode_batch_sizes=tuple(self.decode_batch_sizes),
            drafted_tokens=self.drafted_tokens,
            drafts_kept=self.drafts_kept,
            forced_tokens=self.forced_tokens,
            paused_s=self.paused_s,
            document_pages=self.document_pages,
            ttft_s=self.ttft_s,
            decode_tokens_per_s=self._decode_tokens_per_s(),
            finish_reason=self.finish_reason,
            schema_loosened=self.schema_loosened,
            schema_violations=self.schema_violations,
            e2e_s=time.perf_counter() - state.submitted_perf,
            rss_before_bytes=rss[0],
            rss_peak_bytes=rss[1],
            rss_after_bytes=rss[2],
            error_type=getattr(error, "kind", None) if error is not None else None,
            error=_capped(str(error), MAX_RECORDED_ERROR) if error is not None else None,
            server_metrics=self.server_metrics,
            pid=os.getpid(),
            prompt=_capped(request.prompt, MAX_STORED_TEXT) if store_content else None,
            answer=_capped(self.answer, MAX_STORED_TEXT) if store_content and status != RUNNING else None,
        )

    def _stages(self) -> dict[str, float]:
        """Each stage's seconds; decode's are the sum of its steps (a remote engine times its decode as a whole)."""
        stages = dict(self.seconds)
        if self.token_latencies_s:
            stages[DECODE] = stages.get(DECODE, 0.0) + sum(self.token_latencies_s)
        return stages

    def _decode_tokens_per_s(self) -> float | None:
        seconds = sum(self.token_latencies_s)
        if self.decode_tokens_per_s is None and seconds > 0:
            return len(self.token_latencies_s) / seconds
        return self.decode_tokens_per_s

    def _budget_sizes(self) -> tuple[tuple[int, int], ...]:
        config = self.config
        return tuple(fit_to_budget(*image.image.size, config.min_pixels, config.max_pixels)
                     for image in self.state.images)

    def _save_images(self) -> None:
        """With content storage on, the request's pictures go beside the database, owner-only like it."""
        folder = Path(self.config.db_path).parent / "images"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.chmod(0o700)
            for image in self.state.images:
                target = folder / f"{image.sha256}.png"
                if not target.exists():
                    with os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                        image.image.save(file, format="PNG")
        except OSError as exc:
            log.error("could not save request images: %s", exc)


MAX_RECORDED_NAME = 100  # characters of a model name or error kind a record keeps
MAX_RECORDED_ERROR = 1_000  # characters of an error message a record keeps
MAX_STORED_TEXT = 64_000  # characters of a prompt or an answer a record keeps when content storing is on


def _capped(text: str | None, limit: int) -> str | None:
    """The text, or its first `limit` characters with a marker saying how much was left out."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit:,} more characters not recorded]"


def refusal_record(config: "EngineConfig", model: str, source: str, kind: str, message: str) -> RequestMetrics:
    """The record of a request turned away before it reached an engine (a bad key, a malformed body, a wrong Host):
    what it was refused for, never the body or the key."""
    now = time.time()
    return RequestMetrics(
        id=uuid.uuid4().hex, status=REFUSED, source=source, warmup=False, submitted_at=now, finished_at=now,
        model=model[:MAX_RECORDED_NAME], synthetic=False, dtype=config.dtype, threads=config.threads, kv_cache=config.kv_cache,
        min_pixels=config.min_pixels, max_pixels=config.max_pixels, max_new_tokens=config.max_new_tokens,
        temperature=config.temperature, top_p=config.top_p, error_type=kind[:MAX_RECORDED_NAME],
        error=_capped(message, MAX_RECORDED_ERROR), pid=os.getpid(),
        rss_before_bytes=0, rss_peak_bytes=0, rss_after_bytes=0,
    )

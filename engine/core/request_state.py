"""One request's state, owned here from submission to its record: what it asked, the events its caller reads, its
cancel flag, its pictures, its progress through admission and decode, and its books (a RequestTrace)."""
from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..request import ChatRequest, Queued, SamplingParams
from ..records.trace import RequestTrace

WAITING, DECODING, FINISHED = "waiting", "decoding", "finished"  # admitting: `admission` is set


@dataclass(eq=False)
class Decoding:
    """What a request decodes with once its first token exists: its sequence in the model (a DecodeState), its sampler,
    its output processing, and the keys under which the prefix cache keeps its conversation."""

    sequence: object  # model.generate.DecodeState: its tokens, positions and keys and values in the model
    sampler: object  # core.sampling.Sampler
    output: object  # core.output.SequenceOutput
    keys: tuple  # its images' cache keys and token spans
    spans: tuple
    token: int  # the last sampled token: the next step's input
    rss: list[int] = field(default_factory=list)  # before, peak
    drafted: int = 0  # tokens drafted for it and checked (model/draft.py), and those kept
    kept: int = 0
    # Tokens after it that its grammar forced, already in the answer: fed with it in the next step (jump-forward)
    ahead: list[int] = field(default_factory=list)


class RequestState:
    """A request on its way through the engine. The caller's thread writes it until it is queued; after that the
    engine core alone, on the compute thread. `events` and `cancel()` are for any thread."""

    def __init__(self, request: ChatRequest, info, config, store, cancelled: threading.Event | None = None):
        self.id = uuid.uuid4().hex
        self.request = request
        # Settled once, here; read by everything after.
        self.params = SamplingParams.settle(request, config, info is not None and info.synthetic)
        self.submitted_at = time.time()
        self.submitted_perf = time.perf_counter()
        self.enqueued_perf = self.submitted_perf  # set again when it enters the queue, after its images are checked
        self.images: list = []  # LoadedImage, in conversation order, once intake has read them
        self.videos: list = []  # LoadedVideo, in conversation order, once intake has decoded their frames
        self.events: queue.Queue = queue.Queue()
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.finished = threading.Event()  # its final record is posted: it no longer counts as running
        self.status = WAITING
        self.grammar = None  # structured.compiler.CompiledGrammar its answer must follow, set at submit
        self.admission = None  # core.admission.Admission while its pieces run
        self.decoding: Decoding | None = None  # once its first token exists
        self.waiting_for_memory = False  # admitted, waiting for the running answers to leave it room
        self.on_cancel = None  # called once by cancel(): the owner takes a waiting request out of its queue
        self._last_position: int | None = None
        self.trace = RequestTrace(self, info, config, store)

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel(self)

    def tell_position(self, position: int) -> None:
        if position != self._last_position:
            self._last_position = position
            self.events.put(Queued(position))

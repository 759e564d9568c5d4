"""Which requests run: a bounded FIFO of waiting jobs and a batch of running sequences, served by one worker thread
that alternates between admitting a newcomer and advancing the batch by one decode step.

Decode reads every weight once per step whatever the number of rows, so a step for four sequences costs little more
than a step for one: running requests share steps instead of waiting for each other's whole answers. A newcomer is
admitted between two steps, one at a time, so a running stream pauses for one prefill at most.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

from ..errors import Busy
from ..request import ChatRequest, Queued

log = logging.getLogger(__name__)


class Job:
    """A request on its way through the queue. The worker writes events to `events`; the caller reads them."""

    def __init__(self, request_id: str, request: ChatRequest):
        self.id = request_id
        self.request = request
        self.submitted_at = time.time()
        self.submitted_perf = time.perf_counter()
        self.enqueued_perf = self.submitted_perf  # set again when it enters the queue, after its images are checked
        self.trace = None  # its RequestTrace, set by the engine that takes it
        self.images: list = []  # LoadedImage, in conversation order
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.finished = threading.Event()  # its final record is posted: it no longer counts as running
        self.on_cancel: Callable[["Job"], None] | None = None
        self._last_position: int | None = None
        self.waiting_for_memory = False  # admitted, waiting for the running answers to leave it room

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel(self)

    def tell_position(self, position: int) -> None:
        if position != self._last_position:
            self._last_position = position
            self.events.put(Queued(position))


S = TypeVar("S")  # a running sequence, as the engine keeps it


class Scheduler(Generic[S]):
    """begin(job) starts a job's admission; admit(admission, running) runs its next piece (preprocess and encode,
    prefill and first token) while the running sequences wait, after which `admission.done` tells whether it is over
    and `admission.sequence` holds the sequence that goes on decoding (None when the job already ended);
    step(sequences) advances every running sequence by one token and returns those that ended. All three are the
    engine's, called from this scheduler's worker thread, which alternates one admission piece and one step.
    `batch_limit()` is read before each admission."""

    def __init__(self, begin: Callable[[Job], object], admit: Callable[[object, list[S]], None],
                 step: Callable[[list[S]], list[S]], max_waiting: int, batch_limit: Callable[[], int]):
        self._begin, self._admit, self._step, self.batch_limit = begin, admit, step, batch_limit
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._running: list[S] = []
        self._admitting = None  # the admission under way: its pieces alternate with decode steps
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="vlscope-worker", daemon=True)
        self._worker.start()

    @property
    def depth(self) -> int:
        """Requests waiting plus those running (a request whose record is posted no longer counts)."""
        with self._condition:
            admitting = self._admitting is not None and not self._admitting.job.finished.is_set()
            return len(self._waiting) + self.running + admitting

    @property
    def running(self) -> int:
        """Sequences decoding (each has a `job`)."""
        return sum(not sequence.job.finished.is_set() for sequence in list(self._running))

    def _busy_slots(self) -> int:
        return len(self._running) + (self._admitting is not None)

    def _full(self) -> bool:
        return self._busy_slots() >= self.batch_limit()

    def check_room(self) -> None:
        """Raise Busy if a request submitted now would be turned away (before its images are decoded)."""
        with self._condition:
            if self._closed:
                raise Busy("the engine is shutting down")
            free = max(0, self.batch_limit() - self._busy_slots())
            if len(self._waiting) >= free + self.max_waiting:
                raise Busy(
                    f"The server is busy: {len(self._waiting) + self._busy_slots()} requests are ahead and the "
                    f"queue holds {self.max_waiting}. Try again in a moment."
                )

    def submit(self, job: Job) -> None:
        with self._condition:
            self.check_room()  # again: another request may have taken the room while this one's images decoded
            job.enqueued_perf = time.perf_counter()
            self._waiting.append(job)
            self._tell_positions()
            self._condition.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take a job out before it runs. False if it already started (the worker then sees job.cancelled)."""
        with self._condition:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            self._tell_positions()
            return True

    def _tell_positions(self) -> None:
        """Position 0 is admitted next, as soon as the batch has room; 1 and more count those ahead in the line,
        plus one when the batch is full (a running answer must end first)."""
        ahead = int(self._full())
        for index, job in enumerate(self._waiting):
            job.tell_position(ahead + index)

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not self._closed and not self._running and not self._waiting and self._admitting is None:
                    self._condition.wait()
                if self._closed and not self._running and self._admitting is None:
                    return
                if self._admitting is None and self._waiting and not self._full() and not self._closed:
                    _, self._admitting = self._guarded(self._begin, self._waiting.popleft())
                    self._tell_positions()
                admission, running = self._admitting, list(self._running)
            if admission is not None:
                ok, _ = self._guarded(self._admit, admission, running)
                with self._condition:
                    if admission.done or not ok:
                        self._admitting = None
                        if admission.sequence is not None and ok:
                            self._running.append(admission.sequence)
                        self._tell_positions()
            if running:
                # A step that failed outside the engine's own handling drops its sequences rather than retry forever.
                ok, ended = self._guarded(self._step, running)
                with self._condition:
                    ended = ended if ok else running
                    self._running = [sequence for sequence in self._running if sequence not in ended]
                    self._tell_positions()

    def _guarded(self, call, *arguments) -> tuple[bool, object]:
        """(True, what call returned), or (False, None) when it raised: the worker must outlive any request."""
        try:
            return True, call(*arguments)
        except BaseException:
            log.exception("the scheduler's %s failed outside its own error handling", getattr(call, "__name__", call))
            return False, None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests; waiting ones are left to their callers' cancel, running ones are cancelled (their
        records end within a step). Joins the worker so that nothing keeps the engine (and its weights) alive."""
        with self._condition:
            self._closed = True
            for sequence in self._running:
                sequence.job.cancel()
            if self._admitting is not None:
                self._admitting.job.cancel()
            self._condition.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

"""One generation at a time: a bounded FIFO of jobs served by a single worker thread.

The CPU is the bottleneck, so running two requests at once only makes both slower. Waiters learn their position.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

from .errors import Busy
from .request import ChatRequest, Queued

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

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel(self)

    def tell_position(self, position: int) -> None:
        if position != self._last_position:
            self._last_position = position
            self.events.put(Queued(position))


class RequestQueue:
    def __init__(self, run: Callable[[Job], None], max_waiting: int):
        self._run = run
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="vlscope-worker", daemon=True)
        self._worker.start()

    @property
    def depth(self) -> int:
        """Requests waiting plus the one running."""
        with self._condition:
            running = self._running is not None and not self._running.finished.is_set()
            return len(self._waiting) + running

    def check_room(self) -> None:
        """Raise Busy if a request submitted now would be turned away (before its images are decoded)."""
        with self._condition:
            if self._closed:
                raise Busy("the engine is shutting down")
            busy = self._running is not None or self._waiting
            if busy and len(self._waiting) >= self.max_waiting:
                raise Busy(
                    f"The server is busy: {len(self._waiting) + 1} requests are ahead and the queue holds "
                    f"{self.max_waiting}. Try again in a moment."
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
        ahead = 1 if self._running is not None else 0
        for index, job in enumerate(self._waiting):
            job.tell_position(ahead + index)

    def _serve(self) -> None:
        while True:
            with self._condition:
                while not self._waiting and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._running = job
                self._tell_positions()
            try:
                self._run(job)
            except BaseException:  # the worker must outlive any request
                log.exception("request %s failed outside its own error handling", job.id)
            finally:
                with self._condition:
                    self._running = None
                    self._tell_positions()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests; waiting ones are left to their callers' cancel. Joins the worker so that
        nothing keeps the engine (and its weights) alive."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

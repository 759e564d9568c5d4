"""Which requests run: a bounded FIFO of waiting requests and a batch of decoding ones. The scheduler only plans;
the engine core carries each plan out and reports back what it admitted and what ended.

Decode reads every weight once per step whatever the number of rows, so a step for four sequences costs little more
than a step for one: running requests share steps instead of waiting for each other's whole answers. A newcomer is
admitted between two steps, a piece at a time, so a running stream pauses for one piece at most.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import Busy
from .request_state import RequestState


@dataclass(frozen=True)
class Plan:
    """One turn of the engine loop: the next piece of `admit`'s admission (if any), then one decode step of `step`."""

    admit: RequestState | None
    step: tuple[RequestState, ...]

    @property
    def empty(self) -> bool:
        return self.admit is None and not self.step


class Scheduler:
    """Written by callers' threads (submit, withdraw) and by the engine loop (plan, update); `batch_limit()` is read
    before each admission."""

    def __init__(self, max_waiting: int, batch_limit: Callable[[], int]):
        self.max_waiting, self.batch_limit = max_waiting, batch_limit
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._admitting: RequestState | None = None  # its pieces alternate with decode steps
        self._condition = threading.Condition()
        self._closed = False

    @property
    def depth(self) -> int:
        """Requests waiting plus those running (a request whose record is posted no longer counts)."""
        with self._condition:
            admitting = self._admitting is not None and not self._admitting.finished.is_set()
            return len(self._waiting) + self.running + admitting

    @property
    def running(self) -> int:
        """Requests decoding."""
        return sum(not state.finished.is_set() for state in list(self._running))

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

    def submit(self, state: RequestState) -> None:
        with self._condition:
            self.check_room()  # again: another request may have taken the room while this one's images decoded
            self._waiting.append(state)
            self._tell_positions()
            self._condition.notify_all()

    def withdraw(self, state: RequestState) -> bool:
        """Take a request out before it runs. False if it already started (the core then sees it cancelled)."""
        with self._condition:
            try:
                self._waiting.remove(state)
            except ValueError:
                return False
            self._tell_positions()
            return True

    def wait_for_work(self) -> bool:
        """Block until there is something to plan; False once closed with nothing left running."""
        with self._condition:
            while not self._closed and not self._running and not self._waiting and self._admitting is None:
                self._condition.wait()
            return not (self._closed and not self._running and self._admitting is None)

    def plan(self) -> Plan:
        """The next turn: a waiting request starts its admission when the batch has room, one at a time."""
        with self._condition:
            if self._admitting is None and self._waiting and not self._full() and not self._closed:
                self._admitting = self._waiting.popleft()
                self._tell_positions()
            return Plan(self._admitting, tuple(self._running))

    def update(self, plan: Plan, admitted: bool, ended: list[RequestState]) -> None:
        """What the core did with `plan`: whether its admission is over (the request then decodes, unless it already
        ended), and which requests ended."""
        with self._condition:
            if plan.admit is not None and admitted:
                self._admitting = None
                if plan.admit not in ended:
                    self._running.append(plan.admit)
            self._running = [state for state in self._running if state not in ended]
            self._tell_positions()

    def drop_all(self) -> None:
        """Forget the admission and the batch after a step failed outside the core's own handling: the loop goes
        on with the waiting requests rather than retry the failing ones forever."""
        with self._condition:
            self._admitting, self._running = None, []
            self._tell_positions()

    def _tell_positions(self) -> None:
        """Position 0 is admitted next, as soon as the batch has room; 1 and more count those ahead in the line,
        plus one when the batch is full (a running answer must end first)."""
        ahead = int(self._full())
        for index, state in enumerate(self._waiting):
            state.tell_position(ahead + index)

    def close(self) -> None:
        """Stop taking requests; waiting ones are left to their callers' cancel, running ones are cancelled (their
        records end within a step)."""
        with self._condition:
            self._closed = True
            for state in self._running:
                state.cancel()
            if self._admitting is not None:
                self._admitting.cancel()
            self._condition.notify_all()

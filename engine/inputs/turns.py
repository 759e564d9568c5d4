"""A lock taken in the order it was asked for: threads that each take it for a short step, again and again, share
it step by step, where a plain lock lets the thread that just let go take it again at once."""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager


class TakingTurns:
    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: deque[threading.Event] = deque()
        self._held = False

    @contextmanager
    def turn(self):
        with self._lock:
            if not self._held:
                self._held = True
                mine = None
            else:
                mine = threading.Event()
                self._waiting.append(mine)
        if mine is not None:
            try:
                mine.wait()
            except BaseException:  # gone before its turn: its turn passes on, or is given back if it came already
                with self._lock:
                    if mine in self._waiting:
                        self._waiting.remove(mine)
                        mine = None
                if mine is not None:
                    self._pass_on()
                raise
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()  # held on: the next in line has it now
            else:
                self._held = False

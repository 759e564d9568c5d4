"""Refusals the server guard turns away before any route runs (bad keys, foreign hosts and origins), recorded so a
flood of them cannot fill the metrics database: the first of a kind in a minute gets a record, the rest are counted
and named by the next record of that kind. Every one is counted for /metrics."""
from __future__ import annotations

import threading
import time
from collections import Counter

WINDOW_S = 60.0
TALLIED = {"invalid_api_key", "host_not_allowed", "origin_not_allowed", "sign_in_required"}


class RefusalTally:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.total: Counter[str] = Counter()  # every refusal of a tallied kind, since start
        self._recorded_at: dict[str, float] = {}
        self._unrecorded: Counter[str] = Counter()
        self._lock = threading.Lock()

    def admit(self, kind: str, message: str) -> str | None:
        """The message to record for this refusal, or None when it is only counted."""
        if kind not in TALLIED:
            return message
        now = time.monotonic()
        with self._lock:
            self.total[kind] += 1
            if now - self._recorded_at.get(kind, -self.window_s) < self.window_s:
                self._unrecorded[kind] += 1
                return None
            self._recorded_at[kind] = now
            skipped, self._unrecorded[kind] = self._unrecorded[kind], 0
        return f"{message} ({skipped} more of this kind in the minute before, counted, not recorded)" if skipped \
            else message

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.total)


tally = RefusalTally()

"""Every request's metrics in an embedded SQLite database: WAL, versioned schema, safe across threads and processes."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .metrics import RequestMetrics
from .stages import INTERRUPTED, RUNNING, STAGES

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    submitted_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    status TEXT NOT NULL,
    source TEXT NOT NULL,
    warmup INTEGER NOT NULL,
    model TEXT NOT NULL,
    synthetic INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    threads INTEGER NOT NULL,
    ttft_s REAL,
    decode_tokens_per_s REAL,
    e2e_s REAL NOT NULL,
    rss_peak_bytes INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (submitted_at);
"""
PRUNE_EVERY = 200  # records added between two background prunes

CSV_COLUMNS = (
    "id", "status", "source", "warmup", "submitted_at", "model", "synthetic", "dtype", "threads", "kv_cache",
    "vision_tokens", "prompt_tokens", "output_tokens", "queue_wait_s", "ttft_s", "decode_tokens_per_s", "e2e_s",
    "rss_before_bytes", "rss_peak_bytes", "rss_after_bytes", "weight_bytes", "error_type", "error", "replica",
)


class MetricsStore:
    """One connection per thread; writers wait on each other through SQLite's busy timeout, readers never block."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 2.0, keep_days: float = 0, max_rows: int = 0):
        """keep_days, max_rows: retention, pruned in the background as records are added (0: keep)."""
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.keep_days, self.max_rows = keep_days, max_rows
        self._adds_since_prune = PRUNE_EVERY  # the first add prunes what an earlier run left
        self._pruning = threading.Lock()
        self.last_error: str | None = None  # the latest write failure, for the UI to show
        self._pending: list[RequestMetrics] = []  # records a failed write kept, retried with the next one
        self._pending_lock = threading.Lock()
        self._local = threading.local()
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                # Owner-only from the first byte: records can hold prompts and answers when content storing is on.
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        connection = self._connection()
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {version}; this vlscope reads up to {SCHEMA_VERSION}. Upgrade vlscope."
            )
        with connection:
            connection.executescript(SCHEMA)
            connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _connection(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            # A short busy timeout: a locked database delays bookkeeping briefly, never an answer for long.
            connection = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                         check_same_thread=True)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            self._local.connection = connection
        return connection

    def add(self, metrics: RequestMetrics) -> bool:
        """Write one record (or replace it, by id). A failure is logged and kept in last_error, never raised, and
        the record is kept in memory and written with the next successful add: nothing is lost to a lock."""
        return self.add_many([metrics])

    def add_many(self, records: list[RequestMetrics]) -> bool:
        """Write records in one transaction (imports, tests); as add() otherwise."""
        with self._pending_lock:
            ids = {m.id for m in records}
            batch = [m for m in self._pending if m.id not in ids] + list(records)
            try:
                connection = self._connection()
                with connection:
                    connection.execute("BEGIN IMMEDIATE")
                    connection.executemany("INSERT OR REPLACE INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                           [_row(m) for m in batch])
            except sqlite3.Error as exc:
                self._pending = batch[-1000:]
                self.last_error = f"could not write metrics to {self.path}: {exc} ({len(self._pending)} kept to retry)"
                log.error(self.last_error)
                return False
            self._pending = []
            self.last_error = None
            self._adds_since_prune += len(batch)
        if (self.keep_days or self.max_rows) and self._adds_since_prune >= PRUNE_EVERY and self._pruning.acquire(False):
            self._adds_since_prune = 0
            threading.Thread(target=self._prune_in_background, name="vlscope-prune", daemon=True).start()
        return True

    def _prune_in_background(self) -> None:
        try:
            removed = self.prune(self.keep_days, self.max_rows)
            if removed:
                log.info("pruned %d records from %s (retention: %s days, %s rows)", removed, self.path,
                         self.keep_days or "any", self.max_rows or "any")
        except sqlite3.Error as exc:
            log.warning("could not prune %s: %s", self.path, exc)
        finally:
            self._pruning.release()

    def prune(self, keep_days: float = 0, max_rows: int = 0) -> int:
        """Delete finished records older than keep_days, then the oldest beyond max_rows (0: no bound); returns how
        many went. Running records stay: they are relabelled or finished, never lost."""
        connection = self._connection()
        removed = 0
        with connection:
            if keep_days:
                removed += connection.execute("DELETE FROM requests WHERE submitted_at < ? AND status != ?",
                                              (time.time() - keep_days * 86400, RUNNING)).rowcount
            if max_rows:
                removed += connection.execute(
                    "DELETE FROM requests WHERE status != ? AND rowid IN (SELECT rowid FROM requests ORDER BY "
                    "submitted_at DESC LIMIT -1 OFFSET ?)", (RUNNING, int(max_rows))).rowcount
        return removed

    def mark_interrupted(self, alive: Callable[[int], bool]) -> int:
        """Relabel 'running' records whose serving process is gone: the server died mid-request."""
        return self.relabel_running(lambda m: m.pid != os.getpid() and not alive(m.pid), INTERRUPTED,
                                    "the server stopped before this request finished")

    def relabel_running(self, which: Callable[[RequestMetrics], bool], status: str, error: str) -> int:
        """Give the 'running' records `which` picks a final status and error; returns how many."""
        stale = [m for m in self._select("WHERE status = ?", (RUNNING,)) if which(m)]
        if stale:
            self.add_many([dataclasses.replace(record, status=status, error=error) for record in stale])
        return len(stale)

    def _select(self, where: str = "", params: tuple = (), limit: int | None = None) -> list[RequestMetrics]:
        sql = f"SELECT record FROM requests {where} ORDER BY submitted_at DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = self._connection().execute(sql, params).fetchall()
        return [RequestMetrics.from_dict(json.loads(row[0])) for row in rows]

    def get(self, request_id: str) -> RequestMetrics | None:
        found = self._select("WHERE id = ?", (request_id,))
        return found[0] if found else None

    def recent(self, n: int = 100, include_warmup: bool = True) -> list[RequestMetrics]:
        """The newest n records, newest first."""
        return self._select("" if include_warmup else "WHERE warmup = 0", limit=n)

    def between(self, since: float, until: float | None = None, include_warmup: bool = True,
                limit: int | None = None) -> list[RequestMetrics]:
        """Records submitted in [since, until] (unix seconds), newest first; with `limit`, the newest that many."""
        until = time.time() if until is None else until
        where = "WHERE submitted_at BETWEEN ? AND ?" + ("" if include_warmup else " AND warmup = 0")
        return self._select(where, (since, until), limit)

    def count_since(self, since: float) -> int:
        return self._connection().execute("SELECT COUNT(*) FROM requests WHERE submitted_at >= ?",
                                          (since,)).fetchone()[0]

    def finished_since(self, row: int) -> tuple[list[RequestMetrics], int]:
        """Final records (not 'running') written after row number `row`, oldest first, and the row number to ask
        from next time. A record is rewritten under a row number above every final one when it changes (SQLite
        numbers a new row one past the largest), so each final state is read once."""
        rows = self._connection().execute(
            "SELECT rowid, record FROM requests WHERE rowid > ? AND status != ? ORDER BY rowid", (row, RUNNING),
        ).fetchall()
        return [RequestMetrics.from_dict(json.loads(record)) for _, record in rows], rows[-1][0] if rows else row

    def count(self) -> int:
        return self._connection().execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def close(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None


def _row(metrics: RequestMetrics) -> tuple:
    return (
        metrics.id, metrics.submitted_at, metrics.finished_at, metrics.status, metrics.source, int(metrics.warmup),
        metrics.model, int(metrics.synthetic), metrics.dtype, metrics.threads, metrics.ttft_s,
        metrics.decode_tokens_per_s, metrics.e2e_s, metrics.rss_peak_bytes, json.dumps(metrics.to_dict()),
    )


def stage_percentiles(records: list[RequestMetrics], percentiles=(50, 95)) -> dict[str, dict[int, float]]:
    """Per stage (plus ttft and e2e): the requested percentiles over the records where the stage ran."""
    series: dict[str, list[float]] = {}
    for record in records:
        for name, seconds in record.stages.items():
            series.setdefault(name, []).append(seconds)
        if record.ttft_s is not None:
            series.setdefault("ttft", []).append(record.ttft_s)
        series.setdefault("e2e", []).append(record.e2e_s)
    order = {name: i for i, name in enumerate(STAGES + ("ttft", "e2e"))}
    return {
        name: {p: float(np.percentile(values, p)) for p in percentiles}
        for name, values in sorted(series.items(), key=lambda item: order.get(item[0], len(order)))
    }


def to_csv(records: list[RequestMetrics]) -> str:
    """One row per request: the main figures plus one column per stage."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS + tuple(f"stage_{name}_s" for name in STAGES))
    for record in records:
        data = record.to_dict()
        writer.writerow([_inert(data[c]) for c in CSV_COLUMNS] + [record.stages.get(name, "") for name in STAGES])
    return buffer.getvalue()


def _inert(value):
    """A text cell a spreadsheet would run as a formula (=, +, -, @, tab or CR first) is quoted as text."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def open_store(config) -> MetricsStore:
    """The metrics database an EngineConfig names, with its retention."""
    return MetricsStore(config.db_path, keep_days=config.records_keep_days, max_rows=config.records_max_rows)

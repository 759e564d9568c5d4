"""A grammar tried in a process of its own before the server builds it: a schema whose grammar takes too long or too
much memory to build costs that process, which is killed at the time limit, and never the server's threads or
memory. The trial builds the matcher as the server would, computes its first mask, and takes the tokens the grammar
forces at its start (where llguidance finds a grammar that explodes), and reports the seconds and bytes it took.

    python -m engine.structured.compile_check   # the worker's own entry: the server starts it, nobody else
"""
from __future__ import annotations

import os
import pickle
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import GenerationFailed

# The most tokens a grammar may force before the answer's first free choice: more is a schema no answer could finish
# (a required property that contains itself, say).
MAX_FORCED_TOKENS = 4096
# Address space the worker may take: a grammar that needs more fails there, not in the server.
WORKER_MEMORY_BYTES = 4 * 1024**3
START_SECONDS = 60.0  # the worker's start: Python, llguidance and the tokenizer's tables
# What a built grammar is counted as at the least: a small one's growth hides in memory the allocator had already.
MIN_GRAMMAR_BYTES = 64 * 1024
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the engine package
TOOK_TOO_LONG = "took too long"  # a trial's error when the worker was killed at the time limit


@dataclass(frozen=True)
class Trial:
    """What building one grammar took, or why it could not be built."""

    error: str | None  # llguidance's error, or a reason of this module's; None: it builds
    seconds: float = 0.0
    bytes: int = 0  # the worker's memory growth while the matcher was held: what keeping it costs


def _send(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream, deadline: float | None = None):
    """The next message, or TimeoutError once `deadline` (time.monotonic) passes with none; EOFError: the peer ended."""
    if deadline is not None:
        ready, _, _ = select.select([stream], [], [], max(deadline - time.monotonic(), 0.0))
        if not ready:
            raise TimeoutError
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


class GrammarTrials:
    """The server's side: one worker process, started on first use (or by `start()`), tried one grammar at a time,
    killed and started again when a trial runs past its time."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...], limits: dict):
        self._setup = (tokenizer_json, vocab_size, list(eos_ids), limits)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            # Started where `engine` imports from, whatever the caller's working directory.
            process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       env=dict(os.environ, RAYON_NUM_THREADS="1"), cwd=PACKAGE_ROOT)
            try:
                _send(process.stdin, self._setup)
                _receive(process.stdout, time.monotonic() + START_SECONDS)
            except (TimeoutError, EOFError, BrokenPipeError):
                process.kill()
                process.wait()
                raise GenerationFailed("structured answers are unavailable: the grammar worker did not start") \
                    from None
            self._process = process
        return self._process

    def trial(self, grammar: str, limit_s: float) -> Trial:
        """Build `grammar` in the worker; past `limit_s` seconds the worker is killed and the trial says so."""
        with self._lock:
            process = self._ensure_started()
            try:
                _send(process.stdin, grammar)
                return Trial(**_receive(process.stdout, time.monotonic() + limit_s))
            except TimeoutError:
                self._restart()
                return Trial(TOOK_TOO_LONG, limit_s)
            except (EOFError, BrokenPipeError):  # the worker died: out of memory, most likely
                self._restart()
                return Trial("too large to build (the grammar worker ran out of memory)")

    def _restart(self) -> None:
        """The worker killed, and a new one started in the background, so the next trial does not wait for it."""
        self._stop()
        threading.Thread(target=self.start, name="vlscope-grammar-worker", daemon=True).start()

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()


def _worker_limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    os.nice(5)  # behind the server's own work on a shared CPU


def _try(tokenizer, grammar: str, limits: dict) -> dict:
    import llguidance
    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                   limits=llguidance.LLParserLimits(**limits, verbose_errors=False))
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        forced = matcher.compute_ff_tokens()
        if len(forced) > MAX_FORCED_TOKENS:
            return dict(error=f"it forces over {MAX_FORCED_TOKENS} tokens before any choice (a required property "
                              "that contains itself?): no answer could finish it",
                        seconds=time.perf_counter() - started)
        if forced:
            trial = matcher.deep_copy()  # stepping through them is where a grammar too large to step says so
            trial.consume_tokens(forced)
            if trial.is_error():
                return dict(error=trial.get_error(), seconds=time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if matcher.is_error():
        return dict(error=matcher.get_error(), seconds=seconds)
    return dict(error=None, seconds=seconds, bytes=max(process.memory_info().rss - before, MIN_GRAMMAR_BYTES))


def main() -> None:
    # Set here, not in a preexec_fn: code run between fork and exec in a threaded server can deadlock the child on a
    # lock another thread held at the fork, and the server with it, waiting for the exec.
    _worker_limits()
    import llguidance

    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    tokenizer_json, vocab_size, eos_ids, limits = _receive(inbox)
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)
    _send(outbox, "ready")
    while True:
        try:
            grammar = _receive(inbox)
        except EOFError:
            return
        try:
            _send(outbox, _try(tokenizer, grammar, limits))
        except MemoryError:
            _send(outbox, dict(error="too large to build (over the grammar worker's memory)"))


if __name__ == "__main__":
    main()

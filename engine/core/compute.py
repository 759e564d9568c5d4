"""The one thread that runs PyTorch in this process: loading, warm-up, every request and the bench's measurements.

libgomp (PyTorch's OpenMP) gives every thread that starts a parallel region its own team of worker threads, and
once it manages more threads than there are CPUs, every team's workers stop spinning between regions and sleep
(its "throttled" spin count). A decode step has hundreds of parallel regions, and each then waits for its workers
to be woken (docs/decisions.md, "One compute thread", has the figures). So all of it runs here, on one long-lived
thread, and callers wait for the result.
"""
from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")
Progress = Callable[[float, str], None]

_tasks: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def _serve() -> None:
    while True:
        fn, future = _tasks.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller, who re-raises it on its own thread
            future.set_exception(exc)
        # Held until the next task otherwise: the last task's closure and result (an engine, a whole model) would
        # outlive its caller, and a reload would hold two models at once.
        del fn, future


def _ensure_started() -> None:
    global _thread
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="vlscope-compute", daemon=True)
            _thread.start()


def on_compute_thread() -> bool:
    return threading.current_thread() is _thread


def run(fn: Callable[..., T], *args, progress: Progress | None = None, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread; blocks until it returns, and returns or raises what it did.

    With `progress`, fn is also given `progress=` and its reports are passed on to `progress` on the calling thread
    (a Streamlit progress bar must be drawn by the script's own thread, never by this one)."""
    if on_compute_thread():
        return fn(*args, **kwargs) if progress is None else fn(*args, progress=progress, **kwargs)
    _ensure_started()
    reports: queue.SimpleQueue = queue.SimpleQueue()
    if progress is not None:
        kwargs["progress"] = lambda fraction, message: reports.put((fraction, message))
    future: Future = Future()
    _tasks.put((lambda: fn(*args, **kwargs), future))
    if progress is None:
        return future.result()
    while True:
        try:
            fraction, message = reports.get(timeout=0.05)
        except queue.Empty:
            if future.done():
                break
            continue
        progress(fraction, message)
    while not reports.empty():  # reports made just before fn returned
        progress(*reports.get())
    return future.result()


def runs_on_compute_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Make `fn` (a function that runs PyTorch) run on the compute thread whoever calls it. A measurement run on a
    caller's thread instead left an OpenMP team there, which slowed every decode step after it."""

    @functools.wraps(fn)
    def on_compute_thread_(*args, **kwargs):
        return run(fn, *args, **kwargs)

    return on_compute_thread_

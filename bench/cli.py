"""What the measuring tools' command lines share: progress on stderr with elapsed time, and a one-line failure."""
from __future__ import annotations

import sys
import time


def progress_printer():
    """A progress callback printing `[elapsed  percent] message` on stderr."""
    started = time.perf_counter()

    def report(fraction: float, message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s {fraction * 100:3.0f}%] {message}", file=sys.stderr,
              flush=True)

    return report


def fail(exc: BaseException) -> int:
    """Print the error's first line and return the exit status for bad input (2)."""
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return 2

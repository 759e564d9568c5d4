"""What the measuring tools' command lines share: progress on stderr with elapsed time, a one-line failure, the
line naming this CPU that heads each report, and results written as JSON with their markdown beside them."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


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


def machine_line() -> str:
    """`CPU <model>, <n> cores, ISA <flags>`: what every run names first."""
    from engine.machine import system_report

    machine = system_report()
    return f"CPU {machine.cpu_model}, {machine.physical_cores} cores, ISA {', '.join(machine.isa_flags)}"


def write_results(out: str, rows: list, text: str) -> None:
    """`rows` as JSON at `out`, and the markdown `text` beside it (same name, .md)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    path.with_suffix(".md").write_text(text)

"""A CPU kind's benchmark record: where it is kept, which one a page shows, which code it measured."""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from engine.config import PROJECT_DIR
from engine.machine import cpu_kind, system_report

# Paths whose changes can move a benchmark's figures.
MEASURED_PATHS = ("engine",)
# The one command that measures this CPU kind's record from the current code.
REFRESH = "python -m bench --quick --record"


def _git(*args: str, cwd: Path = PROJECT_DIR) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def code_commit(cwd: Path = PROJECT_DIR) -> dict | None:
    """The commit this checkout is at and whether the measured paths have edits not yet committed (None outside a
    git checkout)."""
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    if not commit:
        return None
    edited = bool(_git("status", "--porcelain", "--", *MEASURED_PATHS, cwd=cwd))
    return {"commit": commit, "edited": edited}


def engine_changed_since(record: dict | None, cwd: Path = PROJECT_DIR) -> bool | None:
    """True when the engine changed after the record's commit (or the record ran on uncommitted engine edits), False
    when it did not, None when it cannot be told (no commit in the record, no git, a commit this clone lacks)."""
    if not record or not record.get("commit"):
        return None
    last_change = _git("rev-list", "-1", "HEAD", "--", *MEASURED_PATHS, cwd=cwd)
    if last_change is None or _git("cat-file", "-e", f"{record['commit']}^{{commit}}", cwd=cwd) is None:
        return None
    if record.get("edited") or code_commit(cwd).get("edited"):
        return True
    return _git("merge-base", "--is-ancestor", last_change, record["commit"], cwd=cwd) is None


def describe(document: dict, cwd: Path = PROJECT_DIR) -> str:
    """One line for a page: when and on which commit the record was measured, and whether the code moved on."""
    record = document.get("code")
    when = document.get("created", "an unknown time").replace("T", " ")
    if not record:
        return (f"Measured {when}; its commit was not recorded, so it may be older than this code: "
                f"`{REFRESH}` refreshes it.")
    changed = engine_changed_since(record, cwd)
    line = f"Measured {when} on commit {record['commit'][:10]}{' with uncommitted engine edits' if record.get('edited') else ''}."
    if changed is None:
        return line + " Whether the engine changed since cannot be told here."
    return line + (f" Older than this code: the engine changed since; `{REFRESH}` refreshes it."
                   if changed else " The engine has not changed since.")


RECORDS = Path("docs") / "bench"  # one record per CPU kind: docs/bench/<kind>/bench.json
LOCAL_RUNS = Path("bench-results")  # this server's own runs, one folder each


def record_dir(kind: str, project_dir: Path = PROJECT_DIR) -> Path:
    """Where `python -m bench --record` writes the record of CPUs of this kind."""
    return project_dir / RECORDS / kind


def measured_kind(document: dict) -> str:
    machine = document.get("machine") or {}
    return machine.get("cpu_kind") or cpu_kind(machine.get("isa_flags", ()))


@dataclass(frozen=True)
class Reference:
    """The benchmark a page shows: its file, the CPU kind it was measured on, and whether this CPU is of that kind."""

    path: Path
    kind: str
    same_kind: bool


def reference_result(project_dir: Path = PROJECT_DIR) -> Reference | None:
    """The newest run from a CPU of this one's kind, this server's own (bench-results/) or the record
    (docs/bench/<kind>/); else the newest record of another kind."""
    here = system_report().cpu_kind
    found = []
    for path in [*(project_dir / LOCAL_RUNS).glob("*/bench.json"), *(project_dir / RECORDS).glob("*/bench.json")]:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        kind = measured_kind(document)
        found.append((kind == here, document.get("created", ""), str(path), kind))
    if not found:
        return None
    same_kind, _, path, kind = max(found)
    return Reference(Path(path), kind, same_kind)

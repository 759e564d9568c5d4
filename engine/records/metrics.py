"""What one request cost: a frozen record, filled at stage boundaries, plus the peak of the process's memory around it."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import psutil



@dataclass(frozen=True)
class RequestMetrics:
    id: str
    status: str  # one of trace.STATUSES
    source: str
    warmup: bool
    submitted_at: float  # unix time
    finished_at: float
    # settings snapshot
    model: str
    synthetic: bool
    dtype: str
    threads: int
    kv_cache: bool
    min_pixels: int
    max_pixels: int
    max_new_tokens: int
    temperature: float
    top_p: float
    # what was processed
    image_sizes: tuple[tuple[int, int], ...] = ()
    resized_sizes: tuple[tuple[int, int], ...] = ()
    vision_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # leading prompt tokens served from an earlier request's KV cache
    output_tokens: int = 0
    # time, seconds
    started_at: float | None = None  # unix time the worker took it; None if it never ran
    queue_wait_s: float = 0.0
    stages: dict = field(default_factory=dict)  # stage name (trace.STAGES) -> seconds, only stages that ran
    token_latencies_s: tuple[float, ...] = ()  # every decode step after the first token
    decode_batch_sizes: tuple[int, ...] = ()  # how many sequences each of those steps advanced together
    # float32's drafted decode (engine/model/draft.py): tokens an int8 copy proposed, and those the model kept
    drafted_tokens: int = 0
    drafts_kept: int = 0
    # Tokens a grammar forced that rode along in a decode step beside the step's own token (jump-forward)
    forced_tokens: int = 0
    paused_s: float = 0.0  # time its decode waited while other requests were admitted (their encode and prefill)
    document_pages: tuple[dict, ...] = ()  # each document page read: document, page, rendered size, vision tokens
    ttft_s: float | None = None  # submission to first token text
    decode_tokens_per_s: float | None = None
    finish_reason: str | None = None  # stop (an end token or stop string) or length (max_new_tokens reached)
    # A schema without `strict`: what of it the grammar did not hold, and what the finished answer breaks of that
    schema_loosened: tuple[str, ...] = ()
    schema_violations: tuple[str, ...] = ()
    e2e_s: float = 0.0
    # memory, bytes
    rss_before_bytes: int = 0
    rss_peak_bytes: int = 0
    rss_after_bytes: int = 0
    weight_bytes: int = 0
    decode_weight_bytes: int = 0  # weights one decode step reads (language model and head); 0 when unknown
    compute_dtype: str | None = None  # float32 or bfloat16; None when unknown (older records, remote servers)
    error_type: str | None = None
    error: str | None = None
    server_metrics: dict | None = None  # a remote server's own timings, when it reports them
    pid: int = 0  # the serving process, to tell a dead server's unfinished records from a live one's
    replica: str | None = None  # on a cluster (python -m scale), the replica that served it
    prompt: str | None = None  # only when storing content is on
    answer: str | None = None

    @property
    def decode_gb_per_s(self) -> float | None:
        """Weights read per second while decoding: how close decode runs to the memory's read rate. Drafted decode and
        forced tokens count each token as a step of its own would read it, so the figure can pass the read rate: their
        gain."""
        if not self.decode_tokens_per_s or not self.decode_weight_bytes:
            return None
        return self.decode_weight_bytes * self.decode_tokens_per_s / 1e9

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RequestMetrics":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for key in ("image_sizes", "resized_sizes"):
            values[key] = tuple(tuple(size) for size in values.get(key, ()))
        values["token_latencies_s"] = tuple(values.get("token_latencies_s", ()))
        values["decode_batch_sizes"] = tuple(values.get("decode_batch_sizes", ()))
        for key in ("document_pages", "schema_loosened", "schema_violations"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


def current_rss() -> int:
    return psutil.Process().memory_info().rss


class PeakRss:
    """This process's resident memory before, at its highest during, and after a block (a request, a load).

    On Linux the kernel keeps the high-water mark itself (VmHWM in /proc/self/status; writing 5 to
    /proc/self/clear_refs restarts it): exact, and nothing runs beside the block. Elsewhere a thread polls every
    `interval_s`. The poller costs decode time: its wake-ups preempt one of the compute threads, and a decode
    step waits for its slowest thread (docs/decisions.md). One request runs at a time, so restarting the process-wide mark is this block's to
    do; blocks do not nest."""

    def __init__(self, interval_s: float = 0.005, kernel_mark: bool = True):
        self.interval_s, self.use_kernel_mark = interval_s, kernel_mark
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kernel_mark = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRss":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "PeakRss":
        """Begin the block (a request's admission, say, which runs in pieces)."""
        self._kernel_mark = self.use_kernel_mark and _restart_high_water_mark()
        self.before = self.process.memory_info().rss
        self.peak = self.before
        if not self._kernel_mark:
            self._thread = threading.Thread(target=self._run, name="vlscope-rss", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.after = self.process.memory_info().rss
        mark = _high_water_mark() if self._kernel_mark else None
        self.peak = max(self.peak, self.after, mark or 0)


def _restart_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return _high_water_mark() is not None
    except OSError:
        return False


def _high_water_mark() -> int | None:
    return proc_bytes("/proc/self/status", "VmHWM")


def proc_bytes(path: str, field: str) -> int | None:
    """A "Field:  N kB" line of a /proc file (status, smaps_rollup) in bytes; None where the kernel has no such
    file or line."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

"""What one request cost: a frozen record, filled at stage boundaries, plus the RSS sampler that watches memory."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field

import psutil

# Stage names in the order a request meets them. Every stage is timed apart; their sum never exceeds e2e_s.
STAGES = ("load_images", "ocr_enhance", "preprocess", "vision_encode", "prefill", "decode", "detokenize")
# running: written when the worker starts, replaced when it ends; interrupted: a running record whose server
# process died (found and relabelled at the next start).
STATUSES = ("ok", "cancelled", "error", "refused", "running", "interrupted")


@dataclass(frozen=True)
class RequestMetrics:
    id: str
    status: str  # ok | cancelled | error | refused (bad input or busy, before any model compute)
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
    stages: dict = field(default_factory=dict)  # stage name -> seconds, only stages that ran
    token_latencies_s: tuple[float, ...] = ()  # every decode step after the first token
    ttft_s: float | None = None  # submission to first token text
    decode_tokens_per_s: float | None = None
    finish_reason: str | None = None  # stop (an end token or stop string) or length (max_new_tokens reached)
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
    prompt: str | None = None  # only when storing content is on
    answer: str | None = None

    @property
    def decode_gb_per_s(self) -> float | None:
        """Weights read per second while decoding: how close decode runs to the memory's read rate."""
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
        return cls(**values)


def request_record(job, config, status: str, error: BaseException | None = None, **fields) -> RequestMetrics:
    """The parts of a request's record every engine fills the same way (identity, sampling settings, images,
    stages, end-to-end time, error, memory defaults); the engine passes what it alone knows in `fields`."""
    request = job.request
    if "rss_before_bytes" not in fields:
        rss = current_rss()
        fields.update(rss_before_bytes=rss, rss_peak_bytes=rss, rss_after_bytes=rss)
    return RequestMetrics(
        id=job.id,
        status=status,
        source=request.source,
        warmup=request.warmup,
        submitted_at=job.submitted_at,
        finished_at=time.time(),
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        max_new_tokens=request.max_new_tokens or config.max_new_tokens,
        temperature=config.temperature if request.temperature is None else request.temperature,
        top_p=config.top_p if request.top_p is None else request.top_p,
        image_sizes=tuple(image.original_size for image in job.images),
        stages=dict(job.clock.seconds),
        e2e_s=time.perf_counter() - job.submitted_perf,
        error_type=getattr(error, "kind", None) if error is not None else None,
        error=str(error) if error is not None else None,
        pid=os.getpid(),
        **fields,
    )


def current_rss() -> int:
    return psutil.Process().memory_info().rss


class RssSampler:
    """Samples this process's RSS in a background thread while a request runs, to catch the peak between stages."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlscope-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.process.memory_info().rss
        self.peak = max(self.peak, self.after)


class StageClock:
    """Accumulates seconds per stage; `with clock.stage("prefill"):` times one stage boundary to boundary."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def stage(self, name: str):
        return _Timing(self, name)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


class _Timing:
    def __init__(self, clock: StageClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.clock.add(self.name, time.perf_counter() - self.start)

"""Turning an untrusted video clip into the frames the model reads: the container's header checked before any frame
is decoded, frames sampled at the requested rate within the token budget, each decoded by seeking to its time.

Qwen3-VL's rules (qwen-vl-utils): 2 frames a second by default, an even count of 4 to 768 frames, each pair of frames
one temporal patch of 128 to 768 vision tokens (32-pixel units), timestamped by the mean time of its two frames.
PyAV decodes (FFmpeg's libraries in its wheel); docs/decisions.md says why.
"""
from __future__ import annotations

import hashlib
import io
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image

from ..config import PIXELS_PER_VISION_TOKEN
from ..errors import Cancelled, InvalidImage, InvalidVideo
from .turns import TakingTurns
from .images import MAX_ASPECT_RATIO
from .limits import MERGED_PATCH, fit_to_budget, read_source

# What a file's name says is a clip (check-images and the chat page; the API is told by the part's type).
VIDEO_SUFFIXES = (".mp4", ".m4v", ".webm", ".mov", ".mkv", ".avi")

FRAMES_PER_PATCH = 2  # the vision tower's temporal patch: two frames, one set of tokens
MIN_FRAMES, MAX_FRAMES = 4, 768
MIN_TOKENS_PER_PATCH, MAX_TOKENS_PER_PATCH = 128, 768
# Seek again when the next sampled frame is further ahead than this; nearer ones are decoded on the way.
SEEK_AHEAD_S = 2.0
# The decoding one clip may cost by default (EngineConfig.max_video_decode_megapixels).
DECODE_MEGAPIXELS = 12_000.0
DECODE_SECONDS = 10.0  # and the seconds (EngineConfig.max_video_decode_seconds)

# Clips decode a frame at a time, taking turns in the order they asked: one at a time, as one image decodes, and
# none waits behind another's whole clip.
_turns = TakingTurns()


@dataclass(frozen=True)
class VideoHeader:
    """What a clip's container says before any frame is decoded."""

    name: str
    data: bytes
    container: str
    codec: str
    size: tuple[int, int]  # (width, height)
    duration_s: float
    fps: float  # the stream's average frame rate
    frames: int  # frames in the stream, counted by the container or estimated from duration and rate
    sha256: str
    demuxer: str  # the FFmpeg demuxer its first bytes named, the only one it is opened with
    max_pixels: int  # the frame size limit it was checked against, which every decoded frame is held to


@dataclass(frozen=True)
class VideoPlan:
    """Which frames a clip gives the model and at what size: frame times, and each temporal patch's timestamp."""

    frame_times: tuple[float, ...]  # seconds, an even count
    size: tuple[int, int]  # (width, height) every frame is resized to, multiples of 32
    fps: float  # the sampling rate asked for

    @property
    def patch_times(self) -> tuple[float, ...]:
        """The mean time of each pair of frames: what the prompt writes before the pair as `<t seconds>`."""
        times = self.frame_times
        return tuple((times[i] + times[i + 1]) / 2 for i in range(0, len(times), FRAMES_PER_PATCH))

    @property
    def tokens_per_patch(self) -> int:
        width, height = self.size
        return width * height // PIXELS_PER_VISION_TOKEN

    @property
    def tokens(self) -> int:
        return self.tokens_per_patch * len(self.patch_times)


@dataclass(frozen=True)
class LoadedVideo:
    """A clip as the model reads it: its sampled frames at the planned size, and where they came from."""

    name: str
    frames: tuple[Image.Image, ...]  # RGB, plan.size each
    plan: VideoPlan
    header: VideoHeader
    frames_decoded: int = 0  # frames decoded to reach the sampled ones

    @property
    def key(self) -> str:
        """Its identity for the prefix cache: content, frames and size."""
        width, height = self.plan.size
        times = ",".join(f"{t:.3f}" for t in self.plan.frame_times)
        return f"{self.header.sha256}/{hashlib.sha256(times.encode()).hexdigest()[:16]}/{width}x{height}"


def _av():
    import av  # imported on first use: the engine starts without it for a server that never sees a clip

    return av


def sniff_container(data: bytes) -> str | None:
    """The demuxer a clip's first bytes name, from the containers this server reads (FFmpeg's names), or None.
    Only these are opened: FFmpeg would otherwise guess among its hundreds of formats, image decoders among them."""
    head = data[:16]
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"\x1aE\xdf\xa3":  # EBML: Matroska and WebM
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[4:8] in MP4_BOXES:
        return "mov"
    return None


# The boxes an MP4 or QuickTime file may start with.
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot")
# Streams a file may declare; FFmpeg's demuxer refuses to make more (its max_streams), before decoding any.
MAX_STREAMS = 16
# Bytes of packets the probe reads past the header to fill in what the header left out (FFmpeg's probesize).
PROBE_BYTES = 1 << 20


def open_clip(data: bytes, demuxer: str, max_pixels: int):
    """The clip opened for reading: only its sniffed demuxer, at most MAX_STREAMS streams, PROBE_BYTES of packets
    read to probe, and every decoder (the probe's too) refusing a picture far over `max_pixels`."""
    return _av().open(io.BytesIO(data), mode="r", format=demuxer, metadata_errors="ignore",
                      container_options={"probesize": str(PROBE_BYTES), "max_streams": str(MAX_STREAMS)},
                      options=decoder_options(max_pixels))


def decoder_options(max_pixels: int) -> dict[str, str]:
    """FFmpeg's decoders refuse a picture over max_pixels before allocating it, counting its rows at their aligned
    width: the bound has that slack, and each frame is held to the exact limit as it comes out."""
    return {"max_pixels": str(max_pixels * 9 // 8), "threads": "1"}


def read_video_header(source, *, max_bytes: int, max_seconds: float, max_pixels: int,
                      name: str | None = None) -> VideoHeader:
    """Open a clip and check what its container declares (streams, size, duration, frame rate), within bounds
    (opening probes a few packets of each stream, each decoder held to `max_pixels`). Raises InvalidVideo with a
    reason meant for users, naming the clip."""
    try:
        data, image, source_name = read_source(source, max_bytes)
    except InvalidImage as exc:  # read_source speaks of images: say the same of a clip
        raise InvalidVideo(exc.message.replace("image", "video")) from None
    if image is not None:
        raise InvalidVideo("a picture was handed in as a video: send it as an image")
    name = name or source_name
    demuxer = sniff_container(data)
    if demuxer is None:
        raise InvalidVideo(f"{name}: " + ("a picture was handed in as a video: send it as an image" if _is_picture(data)
                                          else "not a video this server can read (MP4, MOV, WebM, MKV, AVI or GIF)"))
    av = _av()
    try:
        with _turns.turn(), open_clip(data, demuxer, max_pixels) as container:
            if not container.streams.video:
                kinds = sorted({stream.type for stream in container.streams})
                has = f" (it holds {', '.join(kinds)})" if kinds else ""
                raise InvalidVideo(f"{name}: the file has no video stream{has}")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            duration = _duration(container, stream)
            frames = int(stream.frames or 0) or (round(duration * rate) if rate and duration else 0)
            format_name = container.format.name
            codec = stream.codec_context.name
    except InvalidVideo:
        raise
    except EOFError:
        raise InvalidVideo(f"{name}: the file ends before its first frame (empty or cut short)") from None
    except av.error.MemoryError:  # the demuxer's refusal past max_streams
        raise InvalidVideo(f"{name}: the file declares more than {MAX_STREAMS} streams, or a header this server "
                           "cannot read") from None
    except Exception as exc:  # PyAV raises FFmpeg's errors by their own names: each means an unreadable clip
        raise InvalidVideo(f"{name}: not a video this server can read ({type(exc).__name__})") from None
    if width <= 0 or height <= 0:
        raise InvalidVideo(f"{name}: the video stream has no picture size (or its first frame is over the "
                           f"{max_pixels / 1e6:.0f} megapixel limit)")
    if width * height > max_pixels:
        raise InvalidVideo(f"{name}: {width}x{height} frames are {width * height / 1e6:.0f} megapixels, over the "
                           f"{max_pixels / 1e6:.0f} megapixel limit")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InvalidVideo(f"{name}: aspect ratio {width}x{height} is too extreme (over {MAX_ASPECT_RATIO}:1)")
    if not rate or not duration or frames < 1:
        raise InvalidVideo(f"{name}: the clip holds no frames (or does not say how long it is)")
    if duration > max_seconds:
        raise InvalidVideo(f"{name}: the clip is {_clock(duration)} long, over the {_clock(max_seconds)} limit; "
                           "send a shorter part")
    return VideoHeader(name, data, format_name, codec, (width, height), duration, rate, frames,
                       hashlib.sha256(data).hexdigest(), demuxer, max_pixels)


def _is_picture(data: bytes) -> bool:
    """Whether Pillow reads the bytes as a picture, from its header alone."""
    try:
        with Image.open(io.BytesIO(data)):
            return True
    except Exception:
        return False


def _duration(container, stream) -> float:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return 0.0


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"


def plan_frames(header: VideoHeader, fps: float, max_tokens: int, max_frames: int = MAX_FRAMES) -> VideoPlan:
    """The frames to sample at `fps` and their size, so the clip's vision tokens stay within `max_tokens`: qwen-vl-utils'
    count (the clip's frames at `fps`, an even number of 4 to `max_frames`), fewer where even 128 tokens a patch would
    not fit, and each frame as large as the budget left per patch allows (128-768 tokens)."""
    patches_budget = max_tokens // MIN_TOKENS_PER_PATCH
    if patches_budget * FRAMES_PER_PATCH < MIN_FRAMES:
        raise InvalidVideo(f"a clip needs {MIN_FRAMES // FRAMES_PER_PATCH * MIN_TOKENS_PER_PATCH} vision tokens at "
                           f"least; the video token budget is {max_tokens}")
    wanted = header.frames / header.fps * fps
    upper = _even_down(min(max_frames, MAX_FRAMES, header.frames if header.frames >= MIN_FRAMES else MIN_FRAMES,
                           patches_budget * FRAMES_PER_PATCH))
    count = max(MIN_FRAMES, min(_even_down(max(wanted, MIN_FRAMES)), upper))
    last = max(header.frames - 1, 0)
    indices = np.round(np.linspace(0, last, count)).astype(int)
    times = tuple(float(index / header.fps) for index in indices)
    per_patch = min(MAX_TOKENS_PER_PATCH, max_tokens // (count // FRAMES_PER_PATCH))
    width, height = header.size
    fitted_width, fitted_height = fit_to_budget(width, height, MIN_TOKENS_PER_PATCH * PIXELS_PER_VISION_TOKEN,
                                                per_patch * PIXELS_PER_VISION_TOKEN)
    # Scaled up to the least tokens a pair takes, rounding up can pass a tight budget: the budget wins, a side at a
    # time, keeping the clip's shape.
    while fitted_width * fitted_height > per_patch * PIXELS_PER_VISION_TOKEN:
        if fitted_width / fitted_height > width / height:
            fitted_width -= MERGED_PATCH
        else:
            fitted_height -= MERGED_PATCH
    return VideoPlan(times, (fitted_width, fitted_height), fps)


def _even_down(value: float) -> int:
    return int(math.floor(value / FRAMES_PER_PATCH) * FRAMES_PER_PATCH)


class DecodeBudget:
    """The decoding one clip may cost, counted frame by frame: megapixels decoded (a frame counts at least
    MIN_FRAME_MEGAPIXELS, its fixed cost), and seconds spent decoding. A clip whose keyframes are too sparse for its
    length, or whose frames are slow to decode, is refused when it runs past either, whatever its duration says."""

    MIN_FRAME_MEGAPIXELS = 0.05

    def __init__(self, name: str, megapixels: float, seconds: float):
        self.name, self.megapixels, self.seconds = name, megapixels, seconds
        self.frames, self.spent_megapixels, self.spent_seconds = 0, 0.0, 0.0

    def spend(self, frame, seconds: float) -> None:
        self.frames += 1
        self.spent_megapixels += max(frame.width * frame.height / 1e6, self.MIN_FRAME_MEGAPIXELS)
        self.spent_seconds += seconds
        if self.spent_megapixels > self.megapixels or self.spent_seconds > self.seconds:
            over = (f"{self.megapixels:,.0f} megapixels" if self.spent_megapixels > self.megapixels
                    else f"{self.seconds:g} s")
            raise InvalidVideo(f"{self.name}: reaching its sampled frames takes more decoding than the {over} a "
                               "clip may (its keyframes are too far apart for its length, or its frames are slow to "
                               "decode); send a shorter part, or re-encode it smaller or with keyframes every few "
                               "seconds")


def decode_frames(header: VideoHeader, plan: VideoPlan, *, max_decode_megapixels: float = DECODE_MEGAPIXELS,
                  max_decode_seconds: float = DECODE_SECONDS, cancelled: Callable[[], bool] | None = None
                  ) -> LoadedVideo:
    """Each planned frame, found by seeking to its time (a keyframe before it, then decoding forward; where seeks
    do not land ahead, by decoding forward once) and resized to the plan's size as it is decoded, so no full-size
    frame outlives its turn; a frame missing from a clip cut short is the last one decoded before it.
    Every frame is held to the header's pixel limit and the decode budget; between frames the clip yields to other
    clips' frames and stops (Cancelled) once `cancelled()` says so."""
    budget = DecodeBudget(header.name, max_decode_megapixels, max_decode_seconds)
    frames: list[Image.Image | None] = [None] * len(plan.frame_times)
    try:
        with open_clip(header.data, header.demuxer, header.max_pixels) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            stream.codec_context.options = decoder_options(header.max_pixels) | {"threads": "0"}
            for index, frame in _frames_at(container, stream, plan.frame_times, budget, cancelled or _never):
                if frame.width * frame.height > header.max_pixels:
                    raise InvalidVideo(f"{header.name}: a frame of {frame.width}x{frame.height} is over the "
                                       f"{header.max_pixels / 1e6:.0f} megapixel limit")
                frames[index] = _resized(frame, plan.size)
    except (InvalidVideo, Cancelled):
        raise
    except Exception as exc:
        raise InvalidVideo(f"{header.name}: a frame could not be decoded ({type(exc).__name__}; a damaged clip, or "
                           f"a frame over the {header.max_pixels / 1e6:.0f} megapixel limit)") from None
    if all(frame is None for frame in frames):
        raise InvalidVideo(f"{header.name}: no frame could be decoded")
    # A frame the stream ended before is the last one decoded before it (at the start, the first decoded).
    filled, previous = [], next(frame for frame in frames if frame is not None)
    for frame in frames:
        previous = frame if frame is not None else previous
        filled.append(previous)
    return LoadedVideo(header.name, tuple(filled), plan, header, budget.frames)


def _never() -> bool:
    return False


def _resized(frame, size: tuple[int, int]) -> Image.Image:
    """The frame at `size` in 8-bit RGB, scaled from its decoded format in one pass (no full-size copy)."""
    width, height = size
    return frame.reformat(width=width, height=height, format="rgb24", interpolation="BICUBIC").to_image()


def _frames_at(container, stream, times, budget: DecodeBudget, cancelled: Callable[[], bool]):
    """(index, frame) for each time: the first frame shown at or after it (at the stream's end, the last one).
    Rising times are reached by decoding forward, or by seeking (to a keyframe before the time) where a seek is
    expected to land past the frames already decoded: further ahead than the distance the last seek landed before
    its time. A seek that lands no further on widens that distance, so a clip whose keyframes are sparse (a GIF, a
    stream with one keyframe) is decoded forward once, never from its start again at each sampled time."""
    base = stream.time_base
    tolerance = 0.5 / max(float(stream.average_rate or 25), 1)
    iterator, position, last = None, -math.inf, None  # position: the time of the last frame decoded
    keyframe_gap = SEEK_AHEAD_S  # how far before its time a seek is expected to land
    pending = list(enumerate(times))
    while pending:
        index, target = pending[0]
        if iterator is None or target - position > keyframe_gap:
            container.seek(int(target / base) if base else 0, stream=stream, backward=True, any_frame=False)
            iterator, reached = container.decode(stream), position
            frame = _next(iterator, budget, cancelled)
            if frame is None:
                break
            position, last = _time(frame, base), frame
            keyframe_gap = (max(target - position, 0.0) if position > reached
                            else max(keyframe_gap, target - position + SEEK_AHEAD_S))
        # Times rise: a frame already decoded at or after this time is the first one there (a slow clip's frame
        # serves several times).
        while position < target - tolerance:
            frame = _next(iterator, budget, cancelled)
            if frame is None:
                break
            position, last = _time(frame, base), frame
        if position < target - tolerance:  # the stream ended before this time: the last frame serves the rest
            for index, _ in pending:
                yield index, last
            return
        yield index, last
        pending.pop(0)


def _next(iterator, budget: DecodeBudget, cancelled: Callable[[], bool]):
    """The next decoded frame (None at the stream's end), in this clip's turn among the clips being decoded."""
    if cancelled():
        raise Cancelled("cancelled while its clip was decoded")
    with _turns.turn():
        started = time.perf_counter()
        frame = next(iterator, None)
        seconds = time.perf_counter() - started
    if frame is not None:
        budget.spend(frame, seconds)
    return frame


def _time(frame, base) -> float:
    return float(frame.pts * base) if frame.pts is not None and base else float(frame.time or 0.0)


def read_clip_header(source, config, name: str | None = None) -> VideoHeader:
    """read_video_header within the configured limits: what a request, check-images and the chat page all check."""
    return read_video_header(source, max_bytes=config.max_video_bytes, max_seconds=config.max_video_seconds,
                             max_pixels=config.max_video_pixels, name=name)


def decode_budget(config) -> dict:
    """decode_frames' bounds as configured."""
    return dict(max_decode_megapixels=config.max_video_decode_megapixels,
                max_decode_seconds=config.max_video_decode_seconds)


def request_videos(request) -> list:
    """Every clip of a conversation, earlier turns first."""
    return [source for turn in request.history for source in turn.videos] + list(request.videos)


def plan_request_videos(request, config) -> list[tuple[VideoHeader, VideoPlan]]:
    """Each clip's header checked and its frames planned, nothing decoded: the request is refused here, before any
    work, for a clip beyond a limit or too many clips."""
    sources = request_videos(request)
    if len(sources) > config.max_videos:
        raise InvalidVideo(f"The request carries {len(sources)} video clips; at most {config.max_videos} are read "
                           "per request.")
    fps = request.video_fps if request.video_fps is not None else config.video_fps
    if not 0 < fps <= 30:
        raise InvalidVideo(f"fps must be between 0 and 30 frames a second, not {fps}")
    max_frames = request.video_max_frames if request.video_max_frames is not None else MAX_FRAMES
    if max_frames < MIN_FRAMES:
        raise InvalidVideo(f"max_frames must be {MIN_FRAMES} or more (frames go in pairs), not {max_frames}")
    planned = []
    for source in sources:
        header = read_clip_header(source, config)
        planned.append((header, plan_frames(header, fps, config.video_max_tokens, max_frames)))
    return planned


def check_video(source, config) -> dict:
    """The verdict `check-images` prints for a clip: what its header says and what the model would read of it, or
    the reason it is refused."""
    name = str(source) if not isinstance(source, (bytes, bytearray)) else "upload"
    try:
        header = read_clip_header(source, config)
        plan = plan_frames(header, config.video_fps, config.video_max_tokens)
    except InvalidVideo as exc:
        return {"file": name, "ok": False, "kind": "video", "error": exc.message}
    return {"file": name, "ok": True, "kind": "video", "container": header.container, "codec": header.codec,
            "size": list(header.size), "seconds": round(header.duration_s, 3), "fps": round(header.fps, 3),
            "frames_sampled": len(plan.frame_times), "frame_size": list(plan.size),
            "vision_tokens": plan.tokens}

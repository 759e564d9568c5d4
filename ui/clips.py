"""The chat page's video clips: the frames a question would read, with their times, and what they cost, before it
is sent; and a sample clip made at first use."""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from engine import EngineConfig, InvalidVideo
from engine.inputs.video import VIDEO_SUFFIXES, decode_budget, decode_frames, plan_frames, read_clip_header

from .documents import png_thumbnail

SAMPLE_CLIP = "moving-square.mp4 (made here)"
STRIP_FRAMES = 8  # frames shown in the strip, spread over the plan


@dataclass(frozen=True)
class Clip:
    """A video file picked for the next question, told apart from a picture's bytes."""

    data: bytes

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.data).digest()


def is_clip(name: str) -> bool:
    return Path(name).suffix.lower() in VIDEO_SUFFIXES


@st.cache_data(max_entries=16, show_spinner="Sampling the clip's frames…")
def _strip(data: bytes, name: str, fps: float, config: EngineConfig) -> tuple[list, str, list[int]] | str:
    """The frames a question at `fps` reads, as (PNG thumbnail, time) pairs spread over the clip, a line of what
    they cost and the vision tokens of each pair of frames; or the reason the clip is refused."""
    try:
        header = read_clip_header(data, config, name)
        plan = plan_frames(header, fps, config.video_max_tokens)
        clip = decode_frames(header, plan, **decode_budget(config))
    except InvalidVideo as exc:
        return exc.message
    spread = sorted({round(index * (len(clip.frames) - 1) / max(1, STRIP_FRAMES - 1))
                     for index in range(min(STRIP_FRAMES, len(clip.frames)))})
    shown = [(png_thumbnail(clip.frames[index].copy(), 160), plan.frame_times[index]) for index in spread]
    width, height = plan.size
    cost = (f"{name}: {header.duration_s:.1f} s at {fps:g} frames a second: {len(plan.frame_times)} frames in "
            f"{len(plan.patch_times)} pairs of {width}x{height}, {plan.tokens:,} vision tokens")
    pairs = len(plan.patch_times)
    return shown, cost, [plan.tokens // pairs] * pairs


def clip_strip(column, name: str, data: bytes, fps: float, config: EngineConfig) -> tuple[Clip, list[int]] | None:
    """Shows the clip's sampled frames with their times and its cost; the Clip to send and the vision tokens of each
    pair of frames, or None (with the reason shown) when it is refused."""
    strip = _strip(data, name, fps, config)
    if isinstance(strip, str):
        column.error(f"Not used: {strip}", icon=":material/videocam_off:")
        return None
    shown, cost, tokens = strip
    column.caption(cost)
    cells = column.columns(min(len(shown), 4))
    for index, (picture, time) in enumerate(shown):
        cells[index % len(cells)].image(picture, caption=f"{time:.1f} s")
    return Clip(data), tokens


def clip_preview(clip: Clip, config: EngineConfig) -> bytes | None:
    """The clip's first frame as the conversation shows it (None for a clip no longer readable)."""
    strip = _strip(clip.data, "clip", config.video_fps, config)
    return strip[0][0][0] if not isinstance(strip, str) and strip[0] else None


@st.cache_resource(show_spinner="Making a sample clip…")
def sample_clip() -> bytes:
    """A 6-second clip of a square crossing the frame with a changing colour, made with PyAV at first use: the
    repository carries no video file."""
    from samples.clip import make_clip

    with tempfile.TemporaryDirectory() as folder:
        return make_clip(Path(folder) / "sample.mp4", seconds=6.0, fps=12, size=(480, 360)).read_bytes()

"""Photographed pages made from a scan: the page on a textured desk, seen at a known tilt and turn, a shadow across
it. The OCR tests and `python -m bench.ocr` share them, so what is timed is what is tested."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
from PIL import Image

DESK = (1400, 1000)


def desk(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A wood-like texture: grain that waves, and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    swirl = cv2.GaussianBlur(rng.normal(0, 1, (height, width)).astype(np.float32), (0, 0), 25) * 60
    return 95 + 25 * np.sin((x + 0.3 * y) / 9 + swirl) + rng.normal(0, 10, (height, width))


def the_page(scan: Path, scale: float = 2.0) -> np.ndarray:
    """The scan enlarged as a phone sees a page, with a margin of its edge's paper round it (greyscale)."""
    page = np.asarray(Image.open(scan).convert("L"))
    page = cv2.resize(page, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
    ring = np.concatenate([page[:5].ravel(), page[-5:].ravel(), page[:, :5].ravel(), page[:, -5:].ravel()])
    return cv2.copyMakeBorder(page, 20, 20, 20, 20, cv2.BORDER_CONSTANT, value=int(np.median(ring)))


def photographed(page: np.ndarray, tilt: float = 0.0, turn: float = 0.0, shadow: bool = False,
                 size: tuple[int, int] = DESK) -> tuple[Image.Image, np.ndarray]:
    """The page on the desk: its far edge shortened as a camera tilted by `tilt` degrees sees it, turned by `turn`
    degrees, and, with `shadow`, darkened towards the right to a third. Returns the picture and the page's corners
    (top-left, top-right, bottom-right, bottom-left)."""
    height, width = page.shape
    frame_width, frame_height = size
    corners = np.float32([[0, 0], [width, 0], [width, height], [0, height]])
    centred = corners - np.float32([width / 2, height / 2])
    lean = np.tan(np.radians(tilt)) * 0.5
    centred = centred * np.float32([[1 - lean, 1], [1 - lean, 1], [1 + lean, 1], [1 + lean, 1]])
    angle = np.radians(turn)
    rotation = np.float32([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    placed = (centred @ rotation.T + np.float32([frame_width / 2, frame_height / 2])).astype(np.float32)
    homography = cv2.getPerspectiveTransform(corners, placed)
    seen = cv2.warpPerspective(page, homography, size, flags=cv2.INTER_CUBIC)
    inside = cv2.warpPerspective(np.full_like(page, 255), homography, size)
    picture = np.where(inside > 0, seen, desk(frame_width, frame_height)).astype(np.float32)
    if shadow:
        picture *= np.linspace(1.0, 0.35, frame_width, dtype=np.float32)[None, :]
    return Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8)).convert("RGB"), placed


# Containers and the codec each is made with; GIF is its own container.
CLIP_FORMATS = {"mp4": "libx264", "mp4-h265": "libx265", "webm": "libvpx-vp9", "webm-vp8": "libvpx",
                "webm-av1": "libsvtav1", "mov": "libx264", "mkv": "libx264", "gif": "gif"}


def make_clip(path: Path, kind: str = "mp4", seconds: float = 4.0, fps: int = 10, size: tuple[int, int] = (320, 240),
              audio: bool = False) -> Path:
    """A clip of a square crossing the frame left to right with the time written in it, so each frame differs and
    says when it is: made here with PyAV (FFmpeg's libraries in its wheel), nothing from disk."""
    import av

    width, height = size
    container_format = {"mp4-h265": "mp4", "webm-vp8": "webm", "webm-av1": "webm"}.get(kind, kind)
    codec = CLIP_FORMATS[kind]
    with av.open(str(path), mode="w", format={"mkv": "matroska"}.get(container_format, container_format)) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if audio:
            sound = output.add_stream("aac" if container_format in ("mp4", "mov") else "libopus", rate=48000)
        for index in range(max(1, round(seconds * fps))):
            frame = np.full((height, width, 3), 30, np.uint8)
            side = max(8, height // 4)
            left = int((width - side) * index / max(1, seconds * fps - 1))
            frame[height // 3: height // 3 + side, left: left + side] = (230, 200, 40)
            frame[:, :, 2] = np.uint8(index * 5 % 250)  # a blue level that climbs frame by frame (for 50 frames)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
        if audio:
            samples = np.zeros((1, 1024), np.float32)
            for _ in range(int(seconds * 48000 / 1024)):
                audio_frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
                audio_frame.sample_rate = 48000
                for packet in sound.encode(audio_frame):
                    output.mux(packet)
            for packet in sound.encode():
                output.mux(packet)
    return path

"""The sample clip: drawn with PyAV at use, since the repository carries no video file."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# Containers and the codec each is made with; GIF is its own container.
CLIP_FORMATS = {"mp4": "libx264", "mp4-h265": "libx265", "webm": "libvpx-vp9", "webm-vp8": "libvpx",
                "webm-av1": "libsvtav1", "mov": "libx264", "mkv": "libx264", "gif": "gif"}


def make_clip(path: Path, kind: str = "mp4", seconds: float = 4.0, fps: int = 10, size: tuple[int, int] = (320, 240),
              audio: bool = False) -> Path:
    """A clip of a square crossing the frame left to right, its blue level climbing frame by frame, so each frame
    differs and says where in the clip it is: made with PyAV (FFmpeg's libraries in its wheel), nothing from disk."""
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

"""Clips a hostile client sends, made at run time with PyAV: a picture posing as a clip, a file of many video
streams, frames that grow past the limit after a small first one, deep-colour frames at the limit, a GIF of tens of
thousands of frames, and a long clip with one keyframe. The hostile tests and `python -m bench.soak --hostile`
share them."""
from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def _av():
    import av

    return av


def picture_as_clip(size: tuple[int, int] = (8000, 8000)) -> bytes:
    """A 16-bit RGBA PNG of `size`: about a megabyte of file that decodes to 8 bytes a pixel."""
    width, height = size
    pixels = np.zeros((height, width, 4), np.uint16)
    pixels[::97, :, 0] = 65535
    av = _av()  # Pillow writes no 16-bit RGBA PNG; FFmpeg's PNG encoder does
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "rgba64be"
    frame = av.VideoFrame.from_ndarray(pixels, format="rgba64le").reformat(format="rgba64be")
    return b"".join(bytes(packet) for packet in codec.encode(frame))


def _encode(output, stream, frames) -> None:
    av = _av()
    for pixels in frames:
        for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
            output.mux(packet)
    for packet in stream.encode():
        output.mux(packet)


def many_streams(streams: int = 50, size: tuple[int, int] = (3840, 2160), frames: int = 2) -> bytes:
    """An MP4 of `streams` H.264 video streams of `size`, each a few flat frames (kilobytes each)."""
    av = _av()
    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as output:
        made = []
        for _ in range(streams):
            stream = output.add_stream("libx264", rate=1, options={"preset": "ultrafast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            made.append(stream)
        pixels = np.zeros((height, width, 3), np.uint8)
        for index in range(frames):
            pixels[:8, :8] = index * 40
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for stream in made:
                for packet in stream.encode(frame):
                    output.mux(packet)
        for stream in made:
            for packet in stream.encode():
                output.mux(packet)
    return buffer.getvalue()


def growing_frames(first: tuple[int, int] = (64, 64), then: tuple[int, int] = (1600, 1600), count: int = 4) -> bytes:
    """A WebM whose header and first two frames say `first`, and whose next `count` frames are `then` (VP8 starts
    a new size at a keyframe)."""
    av = _av()
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as output:
        stream = output.add_stream("libvpx", rate=1)
        stream.width, stream.height, stream.pix_fmt = *first, "yuv420p"
        pts = 0
        for size, frames in ((first, 2), (then, count)):
            codec = av.CodecContext.create("libvpx", "w")
            codec.width, codec.height, codec.pix_fmt = *size, "yuv420p"
            codec.time_base, codec.framerate = Fraction(1, 1), 1
            codec.options = {"deadline": "realtime", "cpu-used": "16"}
            packets = []
            for index in range(frames):
                frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), index * 50, np.uint8),
                                                   format="rgb24").reformat(format="yuv420p")
                frame.pts = index
                packets += codec.encode(frame)
            packets += codec.encode(None)
            for packet in packets:
                packet.stream, packet.time_base = stream, Fraction(1, 1)
                packet.pts = packet.dts = pts
                pts += 1
                output.mux(packet)
    return buffer.getvalue()


def deep_frames(size: tuple[int, int] = (4072, 4072), count: int = 40, fps: int = 10) -> bytes:
    """A QuickTime clip of `count` 16-bit RGBA PNG frames of `size` (one picture, stored `count` times): within the
    frame limit, 8 bytes a pixel."""
    av = _av()
    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mov") as output:
        stream = output.add_stream("png", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "rgba64be"
        pixels = np.zeros((height, width, 4), np.uint16)
        pixels[::64, :, 1] = 40000
        frame = av.VideoFrame.from_ndarray(pixels, format="rgba64le").reformat(format="rgba64be")
        (picture,) = stream.encode(frame)
        for index in range(count):
            packet = av.Packet(bytes(picture))
            packet.stream, packet.time_base = stream, Fraction(1, fps)
            packet.pts = packet.dts = index
            packet.is_keyframe = True
            output.mux(packet)
    return buffer.getvalue()


def long_gif(frames: int = 20_000, size: tuple[int, int] = (32, 32), fps: int = 50) -> bytes:
    """A GIF of `frames` small frames: GIF has no keyframe index, so each seek lands on its first frame."""
    return _encoded("gif", "gif", fps, size, "rgb8", _marked_frames(frames, size, 4))


def one_keyframe(seconds: int = 1200, fps: int = 1, size: tuple[int, int] = (3840, 2160)) -> bytes:
    """An H.264 MP4 of `seconds` at `fps` whose only keyframe is its first: a seek anywhere lands at the start."""
    count = seconds * fps
    return _encoded("mp4", "libx264", fps, size, "yuv420p", _marked_frames(count, size, 16), {
        "preset": "ultrafast", "x264-params": f"keyint={count + 1}:min-keyint={count + 1}:scenecut=0"})


def _marked_frames(count: int, size: tuple[int, int], mark: int):
    """`count` black frames of `size`, each told apart by a small square of its own shade in a corner."""
    width, height = size
    pixels = np.zeros((height, width, 3), np.uint8)
    for index in range(count):
        pixels[:mark, :mark] = index % 200
        yield pixels


def _encoded(container: str, codec: str, fps: int, size: tuple[int, int], pix_fmt: str, frames,
             options: dict | None = None) -> bytes:
    """`frames` (RGB arrays) encoded as one stream of a new `container` file, in memory."""
    av = _av()
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps, options=options or {})
        stream.width, stream.height, stream.pix_fmt = *size, pix_fmt
        _encode(output, stream, frames)
    return buffer.getvalue()

"""The third hostile set's clips, made here with PyAV and sent as an attacker would: each ends in a clear 400 (or a
correct answer) within 15 s, the server's memory within bounds, the server healthy after, nothing of the request in
its records, and another user's clip not held up behind it."""
from __future__ import annotations

import base64
import threading
import time

import httpx
import psutil
import pytest

from engine import Cancelled, ChatRequest, InvalidVideo, MetricsStore
from engine.config import EngineConfig
from engine.inputs.video import decode_frames, plan_frames, read_clip_header
from fixtures.hostile_clips import deep_frames, growing_frames, long_gif, many_streams, one_keyframe, picture_as_clip
from samples.clip import make_clip

from .test_api import start_server

MB = 1024 * 1024
CONFIG = EngineConfig()


class PeakMemory:
    """A process's resident memory sampled every few milliseconds while a block runs: its growth at the peak."""

    def __init__(self, pid: int):
        self.process, self.growth = psutil.Process(pid), 0

    def __enter__(self):
        self.base, self.stop = self.process.memory_info().rss, threading.Event()
        self.thread = threading.Thread(target=self._watch)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.is_set():
            self.growth = max(self.growth, self.process.memory_info().rss - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.fixture(scope="module")
def clip_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-clips")
    process, url = start_server(tiny_model, folder / "api.db", folder / "server.log", VLSCOPE_STORE_CONTENT="off")
    yield process, url, folder / "api.db"
    process.terminate()
    process.wait(20)


def ask_about(url: str, data: bytes, text: str = "What happens?", timeout: float = 60) -> tuple[httpx.Response, float]:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "max_tokens": 2, "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}]})
    return response, time.perf_counter() - started


def attack(server, data: bytes, secret: str) -> tuple[httpx.Response, float, int]:
    """One hostile clip: the answer, its seconds and the server's memory growth at the peak; the server is healthy
    after it and its record holds nothing of the request."""
    process, url, db = server
    with PeakMemory(process.pid) as memory:
        response, seconds = ask_about(url, data, secret)
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    records = MetricsStore(db).recent(200, include_warmup=False)
    assert not any(secret in " ".join(str(value) for value in vars(record).values()) for record in records)
    return response, seconds, memory.growth


def test_a_picture_sent_as_a_clip_is_refused_before_anything_decodes_it(clip_server):
    response, seconds, growth = attack(clip_server, picture_as_clip((6000, 6000)), "secret-picture")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_video", response.text
    assert "send it as an image" in response.json()["error"]["message"]
    assert seconds < 15 and growth < 200 * MB  # decoded, its 6000x6000 16-bit RGBA costs 288 MB


def test_a_file_of_fifty_video_streams_is_refused_from_its_header(clip_server):
    response, seconds, growth = attack(clip_server, many_streams(50, (640, 360)), "secret-streams")
    assert response.status_code == 400 and "more than 16 streams" in response.json()["error"]["message"]
    assert seconds < 15 and growth < 200 * MB


def test_a_frame_over_the_limit_after_a_small_first_one_is_refused_as_it_decodes(clip_server):
    clip = growing_frames((64, 64), (4400, 4400), count=3)  # 19 megapixels, over the 16.6 allowed
    header = read_clip_header(clip, CONFIG)
    assert header.size == (64, 64)  # what the header says
    response, seconds, growth = attack(clip_server, clip, "secret-growing")
    assert response.status_code == 400 and "megapixel limit" in response.json()["error"]["message"], response.text
    assert seconds < 15 and growth < 300 * MB


def test_deep_colour_frames_at_the_limit_are_resized_as_each_decodes(clip_server):
    # 20 sampled frames of 3000x3000 16-bit RGBA, 72 MB each decoded: held at full size until resized, 1.4 GB
    clip = deep_frames((3000, 3000), count=20, fps=2)
    response, seconds, growth = attack(clip_server, clip, "secret-deep")
    assert response.status_code == 200, response.text
    assert response.json()["metrics"]["vision_tokens"] > 0
    assert seconds < 15 and growth < 700 * MB


def test_sparse_keyframes_are_decoded_forward_once_not_from_the_start_at_each_sample():
    for clip, frames in [(long_gif(20_000), 20_000), (one_keyframe(1200, 1, (640, 360)), 1200)]:
        header = read_clip_header(clip, CONFIG)
        plan = plan_frames(header, 2.0, 2048)
        started = time.perf_counter()
        loaded = decode_frames(header, plan)
        # 32 samples across the clip; seeking back to the one keyframe each time decoded 16x the clip (one seek
        # finds that out, and decodes the first stretch again)
        assert len(loaded.frames) == 32 and loaded.frames_decoded <= frames * 1.1, loaded.frames_decoded
        assert time.perf_counter() - started < 10
        assert all(frame.size == plan.size for frame in loaded.frames)


def test_decoding_is_bounded_by_its_budget_and_stops_when_cancelled():
    clip = one_keyframe(1200, 1, (640, 360))
    header = read_clip_header(clip, CONFIG)
    plan = plan_frames(header, 2.0, 2048)
    with pytest.raises(InvalidVideo, match="more decoding than the 50 megapixels"):
        decode_frames(header, plan, max_decode_megapixels=50)  # 640x360: 217 frames of the 1200 it would take
    with pytest.raises(InvalidVideo, match="more decoding than the 0.05 s"):
        decode_frames(header, plan, max_decode_seconds=0.05)
    asked = []
    with pytest.raises(Cancelled):
        decode_frames(header, plan, cancelled=lambda: asked.append(1) or len(asked) > 100)
    assert len(asked) == 101  # checked before each frame, stopped at once


def test_a_short_clip_is_not_held_up_behind_a_slow_one():
    slow = read_clip_header(deep_frames((3000, 3000), count=16, fps=2), CONFIG)  # 16 frames of ~0.2 s each
    short = read_clip_header(make_clip_bytes(), CONFIG)
    took = {}

    def decode(name, header):
        started = time.perf_counter()
        decode_frames(header, plan_frames(header, 2.0, 2048))
        took[name] = time.perf_counter() - started

    first = threading.Thread(target=decode, args=("slow", slow))
    first.start()
    time.sleep(0.5)
    decode("short", short)
    first.join()
    # frame by frame in turns: the short clip waits a slow frame at a time, not the whole slow clip
    assert took["short"] < took["slow"] / 3, took


def make_clip_bytes() -> bytes:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        return make_clip(Path(folder) / "short.mp4", seconds=0.3, fps=10).read_bytes()


def test_a_client_that_leaves_while_its_clip_decodes_cancels_it(make_engine):
    engine = make_engine()
    clip = one_keyframe(1200, 1, (640, 360))
    cancelled = threading.Event()
    threading.Timer(0.05, cancelled.set).start()
    started = time.perf_counter()
    with pytest.raises(Cancelled):
        engine.submit(ChatRequest(prompt="x", videos=(clip,)), cancelled)
    assert time.perf_counter() - started < 2
    (record,) = engine.store.recent(5, include_warmup=False)
    assert record.status == "cancelled"

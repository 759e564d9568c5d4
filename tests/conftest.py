"""Shared fixtures: a tiny Qwen3-VL built once per session from the bundled skeleton, and engines over it."""
from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Eager decode unless a test asks for the compiled step: compiling takes ~40 s even on the tiny model, and
# test_compiled_decode_step_gives_the_eager_tokens covers it. Servers, AppTest and the bench inherit this.
os.environ.setdefault("VLSCOPE_COMPILE", "off")

from engine import ChatRequest, Engine, EngineConfig, RequestMetrics, TextChunk  # noqa: E402
from engine.config import SKELETON_DIR  # noqa: E402
from fixtures.places import shared_dir  # noqa: E402
from fixtures.tiny_model import make_tiny  # noqa: E402

# Real photos and scans: the repository's samples/, or the folder VLSCOPE_SHARED names (its images/ and the model's
# files in qwen3-vl-2b/), which the suite never needs.
SHARED = shared_dir() if os.environ.get("VLSCOPE_SHARED") else None
IMAGES = SHARED / "images" if SHARED and (SHARED / "images").is_dir() else ROOT / "samples"
FULL_SKELETON = SHARED / "qwen3-vl-2b" if SHARED and (SHARED / "qwen3-vl-2b").is_dir() else SKELETON_DIR


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def images_dir() -> Path:
    return IMAGES


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny(SKELETON_DIR, tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def tiny_skeleton(tiny_model, tmp_path_factory) -> Path:
    """The tiny model's folder without its weight file: loads as synthetic."""
    folder = tmp_path_factory.mktemp("tiny-skeleton")
    for item in tiny_model.iterdir():
        if item.suffix != ".safetensors":
            shutil.copyfile(item, folder / item.name)
    return folder


@pytest.fixture
def make_engine(tiny_model, tmp_path):
    """Build engines on the tiny model with a per-test database; closes them after the test."""
    engines = []

    def build(**overrides) -> Engine:
        settings = dict(model=str(tiny_model), db_path=str(tmp_path / "metrics.db"), warmup=False, compile="off")
        settings.update(overrides)
        engine = Engine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture
def app_on_tiny(tiny_model, tmp_path, monkeypatch):
    """The whole app (streamlit_app.py) under AppTest on the tiny model, with this test's database and no warm-up;
    the shared engine is rebuilt from the test's settings and dropped after it. Call the result for a new AppTest."""
    from streamlit.testing.v1 import AppTest

    from server.slot import shutdown

    monkeypatch.setenv("VLSCOPE_MODEL", str(tiny_model))
    monkeypatch.setenv("VLSCOPE_DB", str(tmp_path / "app.db"))
    monkeypatch.setenv("VLSCOPE_WARMUP", "off")
    shutdown()
    yield lambda: AppTest.from_file(str(ROOT / "streamlit_app.py"), default_timeout=120)
    shutdown()


def collect(engine: Engine, request: ChatRequest) -> tuple[str, list, RequestMetrics]:
    """A request's whole answer, its events and its record, streamed."""
    text, events = [], []
    for event in engine.stream(request):
        events.append(event)
        if isinstance(event, TextChunk):
            text.append(event.text)
    return "".join(text), events, events[-1]


def engine_answer(handle) -> tuple[str, RequestMetrics]:
    """A submitted request's whole answer and its record."""
    text = []
    for event in handle.events():
        if isinstance(event, TextChunk):
            text.append(event.text)
        elif isinstance(event, RequestMetrics):
            return "".join(text), event
    raise AssertionError("no metrics")

"""Faults, load and hostile input: the server keeps serving, loses no record, and says what went wrong."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from bench.soak import HOSTILE_RSS_GROWTH, THIRD_SET
from engine import ChatRequest, InsufficientMemory, MetricsStore, PromptTooLong

from .conftest import ROOT, free_port
from .test_api import start_server


def test_soak_short(tiny_model, tmp_path):
    """The CI-sized soak: 60 mixed requests from 4 clients; the full run is `python -m bench.soak`."""
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--model", str(tiny_model), "--requests", "60",
                          "--clients", "4", "--seconds", "300", "--workdir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = json.loads(run.stdout)
    assert run.returncode == 0, (result, run.stderr[-2000:])
    assert result["one_record_per_request"] and result["records"] == result["requests_sent"] == 66
    assert result["app_sessions"] == 1 and result["outcomes"]["app:answered"] == 3  # a browser on the chat page
    assert result["server_errors"] == 0 and result["health_at_end"] == "ready"
    kinds = {key.split(":")[0] for key in result["outcomes"]}
    assert kinds == {"good", "bad_image", "too_long", "cancel", "disconnect", "app"}
    assert all(key.endswith(":400") for key in result["outcomes"] if key.startswith(("bad_image", "too_long")))
    assert result["records_by_status"].get("refused", 0) >= 16
    # every client that left (mid-stream or by timing out) had its generation stopped
    left = sum(n for key, n in result["outcomes"].items() if key in ("cancel:cancelled-by-client",
                                                                     "disconnect:disconnected"))
    assert result["records_by_status"].get("cancelled", 0) == left, result
    assert result["rss_growth"] < 0.05


def test_hostile_soak_short(tiny_model, tmp_path):
    """Every hostile input beside the mixed load: no 5xx, /health quick throughout, memory back, every refusal
    recorded."""
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--model", str(tiny_model), "--requests", "84",
                          "--clients", "4", "--seconds", "300", "--app-sessions", "0", "--hostile",
                          "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = json.loads(run.stdout)
    assert run.returncode == 0, (result, run.stderr[-2000:])
    assert result["one_record_per_request"] and result["server_errors"] == 0
    hostile = {key: n for key, n in result["outcomes"].items() if key.split(":")[0] in (
        "bomb", "deep_json", "bad_json", "nan", "string_bool", "stream_options", "text_plain", "evil_origin",
        "evil_host", "private_url", "huge_max_tokens", "oversized", "no_key", "non_ascii_key", "tools",
        "huge_prompt", "wide_json", "many_images", "long_model", "control_tokens", "ui_foreign_host", "slow_body")}
    assert len(hostile) == 22 and all(key.split(":")[1][0] == "4" for key in hostile)
    third = {key.split(":")[0]: key.split(":")[1] for key in result["outcomes"] if key.split(":")[0] in THIRD_SET}
    assert third == THIRD_SET  # the third set's clips and schemas: each a 400, or answered when within every limit
    assert set(result["outcomes"]) >= {"slow_body:408", "half_header:closed", "hostile_backend:200"}
    # its answers checked, every record ended
    assert result["hostile_backend_records"] == {"ok": result["outcomes"]["hostile_backend:200"]} == {"ok": 2}
    assert result["outcomes"]["lockout:locked"] == 1  # a browser guessing the app's password is locked out
    assert result["records_left_running"] == 0
    assert result["health_max_s"] < 0.1 and result["rss_growth_bytes"] < HOSTILE_RSS_GROWTH


def test_sigkill_mid_generation_then_restart(tiny_model, tmp_path):
    db = tmp_path / "api.db"
    process, url = start_server(tiny_model, db, tmp_path / "first.log")
    try:
        httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        with httpx.Client(timeout=60).stream("POST", f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "ignore_eos": True, "stream": True}) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    process, url = start_server(tiny_model, db, tmp_path / "second.log")
    try:
        records = {r.max_new_tokens: r for r in MetricsStore(db).recent(10, include_warmup=False)}
        assert records[3].status == "ok"  # earlier records all there
        assert records[5000].status == "interrupted" and "stopped before" in records[5000].error
        assert httpx.get(f"{url}/health").json()["status"] == "ready"
    finally:
        process.terminate()
        process.wait(20)


def test_locked_database_delays_bookkeeping_not_answers(engine):
    blocker = sqlite3.connect(engine.store.path, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        answer = engine.ask(ChatRequest(prompt="hello", max_new_tokens=3))
        assert answer.metrics.status == "ok" and answer.metrics.output_tokens == 3
        assert "could not write metrics" in engine.store.last_error
    finally:
        blocker.rollback()
        blocker.close()
    second = engine.ask(ChatRequest(prompt="again", max_new_tokens=2))
    assert engine.store.last_error is None
    assert engine.store.get(answer.metrics.id).status == "ok"  # kept and written later: nothing lost
    assert engine.store.get(second.metrics.id).status == "ok"


def test_request_too_big_for_memory_is_refused_before_it_runs(make_engine, images_dir):
    engine = make_engine(memory_limit_bytes=64 * 1024)
    with pytest.raises(InsufficientMemory, match="GiB is available") as caught:
        engine.ask(ChatRequest(prompt="Describe", images=(images_dir / "coffee.png",)))
    assert caught.value.metrics.status == "refused" and "vision_encode" not in caught.value.metrics.stages


@pytest.mark.parametrize("prompt", ["", " ", "\u200b\u200d\ufeff", "مرحبا بالعالم", "e\u0301\u0301\u0301 " * 50,
                                    "🙂🧪🔬" * 30, "\x00\x01\x1b[31m", "\ud800 lone surrogate"])
def test_odd_prompts_get_an_answer_quickly(engine, prompt):
    started = time.perf_counter()
    answer = engine.ask(ChatRequest(prompt=prompt, max_new_tokens=3))
    assert answer.metrics.status == "ok" and time.perf_counter() - started < 30


def test_giant_prompt_is_refused_quickly(engine):
    started = time.perf_counter()
    with pytest.raises(PromptTooLong):
        engine.ask(ChatRequest(prompt="lorem ipsum " * 200_000))
    assert time.perf_counter() - started < 30


def test_app_password_gate(app_on_tiny, monkeypatch):
    monkeypatch.setenv("VLSCOPE_APP_PASSWORD", "s3cret")
    at = app_on_tiny().run()
    assert not at.chat_input and at.text_input(key="sign_in_password")
    at.text_input(key="sign_in_password").set_value("wrong")
    at.button(key="sign_in_submit").click().run()
    assert any("Wrong password" in e.value for e in at.error) and not at.chat_input
    at.text_input(key="sign_in_password").set_value("s3cret")
    at.button(key="sign_in_submit").click().run()
    assert at.chat_input(key="chat_prompt")


def test_no_secret_reaches_logs_or_database(tiny_model, tmp_path):
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log", VLSCOPE_API_KEYS="key-XYZZY",
                                VLSCOPE_APP_PASSWORD="pw-PLUGH")
    try:
        for key in ("key-XYZZY", "wrong-FROTZ"):
            httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    finally:
        process.terminate()
        process.wait(20)
    for path in (tmp_path / "server.log", tmp_path / "api.db"):
        text = path.read_bytes()
        assert b"XYZZY" not in text and b"PLUGH" not in text and b"FROTZ" not in text
    assert oct((tmp_path / "api.db").stat().st_mode & 0o777) == "0o600"


def test_model_load_failure_api_answers_503(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ this is not json")
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "streamlit_app:app", "--host", "127.0.0.1", "--port", str(port)],
                               cwd=ROOT, env=dict(os.environ, VLSCOPE_MODEL=str(broken), VLSCOPE_DB=str(tmp_path / "m.db")),
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, health = time.time() + 120, None
        while time.time() < deadline:
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                if health.json()["status"] == "error":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert health is not None and health.status_code == 503 and health.json()["status"] == "error"
        answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 503 and "failed to load" in answer.json()["error"]["message"]
        assert int(answer.headers["retry-after"]) > 0
        assert httpx.get(f"{url}/").status_code == 200  # the UI is still served
    finally:
        process.terminate()
        process.wait(20)
        log.close()

"""A vlscope pointed at another vlscope: the remote backend over real HTTP, in the engine, the API and the app."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from streamlit.testing.v1 import AppTest

from engine.structured.tool_calls import split_calls
from engine import (STAGES, Busy, ChatRequest, EngineConfig, GenerationFailed, InvalidImage, InvalidSchema,
                    MetricsStore, PromptTooLong, RequestMetrics, TextChunk, Tool, ToolCall, Turn)
from engine.remote import RemoteEngine
from fixtures.hostile_backend import HOSTILE_ANSWERS, serve
from server.slot import shutdown

from .conftest import ROOT
from .test_api import start_server


@pytest.fixture
def backend(tiny_model, tmp_path):
    process, url = start_server(tiny_model, tmp_path / "backend.db", tmp_path / "backend.log",
                                VLSCOPE_MAX_INPUT_TOKENS="400")
    yield url, tmp_path / "backend.db"
    process.terminate()
    process.wait(20)


def test_remote_engine_streams_measures_and_cancels(backend, images_dir, tmp_path):
    url, backend_db = backend
    engine = RemoteEngine(EngineConfig(remote_url=f"{url}/v1", db_path=str(tmp_path / "client.db")))
    text, metrics = [], None
    for event in engine.stream(ChatRequest(prompt="Read the text", images=(images_dir / "page.png",),
                                           max_new_tokens=8)):
        if isinstance(event, TextChunk):
            text.append(event.text)
        elif isinstance(event, RequestMetrics):
            metrics = event
    assert "".join(text) and metrics.status == "ok" and metrics.output_tokens == 8
    assert {"load_images", "upload", "server_first_token", "decode"} <= set(metrics.stages) <= set(STAGES)
    assert 0 < metrics.ttft_s <= metrics.e2e_s
    assert metrics.server_metrics["stages"]["vision_encode"] > 0 and metrics.vision_tokens > 0
    served = MetricsStore(backend_db).recent(5, include_warmup=False)
    assert served[0].source == "api" and served[0].output_tokens == 8

    handle = engine.submit(ChatRequest(prompt="long", max_new_tokens=5000, ignore_eos=True))
    events = handle.events()
    next(e for e in events if isinstance(e, TextChunk))
    handle.cancel()
    assert [e for e in events][-1].status == "cancelled"
    deadline = time.time() + 10
    while time.time() < deadline:  # the backend sees the closed connection and stops generating
        newest = MetricsStore(backend_db).recent(1)[0]
        if newest.max_new_tokens == 5000 and newest.status == "cancelled":
            break
        time.sleep(0.2)
    else:
        pytest.fail("the backend did not cancel the abandoned request")

    with pytest.raises(InvalidImage):
        engine.ask(ChatRequest(prompt="x", images=(b"not an image",)))
    with pytest.raises(PromptTooLong):
        engine.ask(ChatRequest(prompt="word " * 600))

    # A response format and tools go on to the backend, which holds its answer to them; its calls come back as
    # calls (the model's own blocks in the answer's text, which the API reads as calls), and the turn that answers
    # them goes back with the calls' ids.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = engine.ask(ChatRequest(prompt="ok?", json_schema=json.dumps(schema), max_new_tokens=20))
    assert set(json.loads(answer.text)) == {"ok"} and answer.metrics.finish_reason == "stop"
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}
    tools = (Tool("get_weather", "", json.dumps(city)), Tool("now"))
    answer = engine.ask(ChatRequest(prompt="Weather?", tools=tools, tool_choice="required", max_new_tokens=120))
    content, calls = split_calls(answer.text, frozenset({"get_weather", "now"}))
    assert content is None and calls and answer.metrics.finish_reason == "stop", answer.text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), city if call.name == "get_weather" else {"maxProperties": 0})
    turns = (Turn("user", "Weather?"), Turn("assistant", "", tool_calls=(ToolCall(calls[0].name, calls[0].arguments,
                                                                                  "call_1"),)))
    after = engine.ask(ChatRequest(prompt="18 C", prompt_role="tool", history=turns, tools=tools, max_new_tokens=4))
    assert after.metrics.status == "ok" and after.text
    with pytest.raises(InvalidSchema) as caught:  # checked here first, as the local engine checks them
        engine.ask(ChatRequest(prompt="x", tools=(Tool("f", "", '{"type": "strin"}'),), tool_choice="required"))
    assert caught.value.about == "tools"


def test_vlscope_in_front_of_vlscope_api_and_app(backend, tiny_model, images_dir, tmp_path, monkeypatch):
    url, backend_db = backend
    process, front = start_server(tiny_model, tmp_path / "front.db", tmp_path / "front.log",
                                  VLSCOPE_REMOTE_URL=f"{url}/v1")
    try:
        client = openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
        assert answer.choices[0].message.content
        assert MetricsStore(backend_db).recent(1)[0].output_tokens == 5  # served by the backend
        called = client.chat.completions.create(model=answer.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=60, tool_choice="required", parallel_tool_calls=False,
                                                tools=[{"type": "function", "function": {"name": "now"}}]).choices[0]
        assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.arguments == "{}"
    finally:
        process.terminate()
        process.wait(20)

    monkeypatch.setenv("VLSCOPE_REMOTE_URL", f"{url}/v1")
    monkeypatch.setenv("VLSCOPE_DB", str(tmp_path / "app.db"))
    shutdown()
    try:
        at = AppTest.from_file(str(ROOT / "streamlit_app.py"), default_timeout=120).run()
        at.selectbox(key="sample_image").set_value("page.png").run()
        at.chat_input(key="chat_prompt").set_value("Read the text").run()
        assert not at.exception
        stats = [m for m in at.chat_message if m.name == "assistant"][0].caption[0].value
        assert "TTFT" in stats
        at.switch_page("pages/profiling.py").run()
        assert not at.exception
        assert any("remote server" in h.value for h in at.subheader)
    finally:
        shutdown()


def test_remote_failures_end_with_an_error_and_a_record_and_the_queue_bound_holds(tmp_path):
    server, url = serve()
    try:
        config = EngineConfig(remote_url=url, db_path=str(tmp_path / "client.db"), max_queue=1)
        engine = RemoteEngine(config)
        for prompt in ("malformed", "string error", "list", "choices"):
            with pytest.raises(GenerationFailed) as caught:
                engine.ask(ChatRequest(prompt=prompt))
            assert caught.value.metrics.status == "error", prompt
        stored = MetricsStore(config.db_path).recent(10)
        assert [r.status for r in stored] == ["error"] * 4 and "boom" in stored[2].error

        slow = [engine.submit(ChatRequest(prompt="slow")) for _ in range(2)]  # one running, one waiting
        with pytest.raises(Busy) as caught:
            engine.submit(ChatRequest(prompt="slow"))
        assert caught.value.metrics.status == "refused"
        assert ["".join(e.text for e in h.events() if isinstance(e, TextChunk)) for h in slow] == ["late", "late"]
        assert engine.queue_depth == 0
        engine.ask(ChatRequest(prompt="slow"))  # room again
        engine.close()
    finally:
        server.shutdown()


def test_a_hostile_backends_answers_are_checked_like_user_input(tmp_path):
    """Malformed metrics, usage and content are dropped with a note; the record always ends; a chart of it draws."""
    from ui.charts import server_stages, stage_bars

    server, url = serve()
    try:
        config = EngineConfig(remote_url=url, db_path=str(tmp_path / "client.db"))
        engine = RemoteEngine(config)
        records = {prompt: engine.ask(ChatRequest(prompt=prompt)).metrics for prompt in HOSTILE_ANSWERS}
        engine.close()
    finally:
        server.shutdown()
    assert all(record.status == "ok" for record in records.values())
    assert all(record.server_metrics["dropped"] for prompt, record in records.items() if prompt != "tracking image")
    assert records["stages string"].vision_tokens == 0
    assert server_stages(records["stage names"]) == {"queue_wait": 0.0, "prefill": 0.5}
    assert records["usage strings"].prompt_tokens == 0
    stored = MetricsStore(config.db_path).recent(10)
    assert len(stored) == len(HOSTILE_ANSWERS) and not [r for r in stored if r.status == "running"]
    stage_bars(stored, stages_of=server_stages)  # the Profiling page's chart of them draws

"""The OpenAI-compatible API over real HTTP: uvicorn serving streamlit_app:app, the official openai client, no mocks."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
import openai
import pytest

from engine import MetricsStore

from .conftest import ROOT, free_port


# How a server is started: uvicorn (its HTTP protocol picked as by default: httptools where installed), uvicorn on
# h11, or the README's `streamlit run`.
COMMANDS = {
    "uvicorn": ["-m", "uvicorn", "streamlit_app:app", "--host", "127.0.0.1", "--port", "{port}"],
    "uvicorn-h11": ["-m", "uvicorn", "streamlit_app:app", "--http", "h11", "--host", "127.0.0.1", "--port", "{port}"],
    "streamlit": ["-m", "streamlit", "run", "streamlit_app.py", "--server.address", "127.0.0.1", "--server.port",
                  "{port}", "--server.headless", "true"],
}


def start_server(tiny_model, db, log_path, command: str = "uvicorn", **env_overrides):
    port = free_port()
    # Long answers (5,000 tokens, end tokens ignored) keep the worker busy in the queue and cancellation tests.
    env = dict(os.environ, VLSCOPE_MODEL=str(tiny_model), VLSCOPE_DB=str(db), VLSCOPE_MAX_NEW_TOKENS="5000",
               VLSCOPE_API_ALLOW_IGNORE_EOS="on")
    env.update(env_overrides)
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable] + [part.format(port=port) for part in COMMANDS[command]],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("server did not become ready: " + log_path.read_text()[-3000:])


@pytest.fixture
def server(tiny_model, tmp_path):
    """A server of this test's own, for a test that counts every record and metric."""
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log")
    yield url, tmp_path / "api.db"
    process.terminate()
    process.wait(20)


@pytest.fixture(scope="module")
def shared_server(tiny_model, tmp_path_factory):
    """One server for the tests that read only their own requests' records (a start costs about 8 s)."""
    folder = tmp_path_factory.mktemp("api")
    process, url = start_server(tiny_model, folder / "api.db", folder / "server.log")
    yield url, folder / "api.db"
    process.terminate()
    process.wait(20)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(images_dir, text="Read the text"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": data_url(images_dir / "page.png")}}]}]


def test_non_streaming_and_streaming_answers(server, images_dir):
    url, db = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=image_message(images_dir), max_tokens=8)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 50
    metrics = answer.model_extra["metrics"]
    assert metrics["vision_tokens"] > 0 and metrics["stages"]["vision_encode"] > 0 and metrics["source"] == "api"
    assert "prompt" not in metrics and "answer" not in metrics
    assert not {"pid", "model", "rss_peak_bytes", "weight_bytes"} & set(metrics)  # nothing only an attacker needs

    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=image_message(images_dir), max_tokens=8,
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only when asked for
    assert len({c.created for c in chunks}) == 1
    records = MetricsStore(db).recent(10, include_warmup=False)
    assert len(records) == 2 and all(r.source == "api" and r.status == "ok" for r in records)

    models = client.models.list()
    assert models.data[0].id
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ready" and health["queue_depth"] == 0
    prometheus = httpx.get(f"{url}/metrics").text
    assert 'vlscope_requests_total{status="ok",source="api"} 2' in prometheus
    assert 'vlscope_stage_seconds_count{stage="prefill"} 2' in prometheus
    assert "vlscope_batch_limit 4\n" in prometheus and "vlscope_batch_active 0\n" in prometheus

    # the profiling page (another process, same database) shows the API's requests with their source
    from streamlit.testing.v1 import AppTest

    from server.slot import shutdown

    os.environ["VLSCOPE_DB"] = str(db)
    try:
        shutdown()
        at = AppTest.from_file(str(ROOT / "pages" / "profiling.py"), default_timeout=60).run()
        at.multiselect(key="prof_source").set_value(["api"]).run()
        assert {m.label: m.value for m in at.metric}["requests"] == "2"
    finally:
        del os.environ["VLSCOPE_DB"]
        shutdown()


def test_openai_client_conventions(shared_server, images_dir):
    """What OpenAI's clients rely on: usage in a final chunk of its own when asked, `developer` as system, the served
    model's id (not a path) that retrieve() finds, JSON 404/405 for unknown routes and methods, and refusals that
    name the parameter instead of ignoring it."""
    url, _ = shared_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    [entry] = client.models.list().data
    assert "/" not in entry.id and entry.owned_by == "vlscope" and entry.created > 0
    assert client.models.retrieve(entry.id).id == entry.id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.body["param"] == "model"

    chunks = list(client.chat.completions.create(
        model=entry.id, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    assert len({c.created for c in chunks}) == 1 and chunks[0].model == entry.id

    refused = [({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {"name": "f g"}}]},
                                  "tools[0].function.name"),
               ({"response_format": {"type": "xml"}}, "response_format.type"), ({"stream": "false"}, "stream"),
               ({"stream_options": "yes"}, "stream_options"), ({"temperature": float("nan")}, "temperature")]
    for extra, param in refused:
        response = httpx.post(f"{url}/v1/chat/completions", json={
            "model": entry.id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra} if
            param != "temperature" else None, content=None if param != "temperature" else
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            headers={"content-type": "application/json"})
        assert response.status_code == 400, (param, response.text)
        assert response.json()["error"]["param"] == param
    for method, path, status in (("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
                                 ("GET", "/v1/embeddings", 404), ("POST", "/v1/completions", 404)):
        response = httpx.request(method, f"{url}{path}")
        assert response.status_code == status and "error" in response.json(), (method, path, response.text[:200])


def test_stop_seed_logprobs_penalties_and_bias_through_the_openai_client(shared_server):
    url, _ = shared_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    base = dict(model=model, messages=[{"role": "user", "content": "Tell me about it"}], max_tokens=10,
                extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**base).choices[0].message.content
    stop = plain[len(plain) // 2 - 2: len(plain) // 2 + 2]
    answer = client.chat.completions.create(**base, stop=[stop, "never there"]).choices[0]
    assert answer.message.content == plain[:plain.index(stop)] and answer.finish_reason == "stop"
    chunks = list(client.chat.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain[:plain.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"

    sampled = [client.chat.completions.create(**base, temperature=1.5, seed=11).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1] != plain

    choice = client.chat.completions.create(**base, logprobs=True, top_logprobs=2).choices[0]
    content = choice.logprobs.content
    assert len(content) == 10 and "".join(t.token for t in content) == choice.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    streamed = [c for c in client.chat.completions.create(**base, logprobs=True, stream=True) if c.choices]
    assert sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices[0].logprobs) == 10

    assert client.chat.completions.create(**base, logit_bias={"1234": 100}).choices[0].message.content != plain
    assert client.chat.completions.create(**base, presence_penalty=2, frequency_penalty=2).choices[0].message.content \
        != plain
    for extra, param in (({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"top_logprobs": 3}, "top_logprobs"), ({"presence_penalty": 3}, "presence_penalty")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**base, **extra)
        assert caught.value.body["param"] == param


def test_bad_inputs_get_openai_errors(shared_server, images_dir):
    url, _ = shared_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    text_as_image = "data:image/png;base64," + base64.b64encode(b"plain text, no picture").decode()
    cases = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": text_as_image}}]}], "not an image"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}], "never read"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}], "never read"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}],
         "remote image URLs are refused"),
        ([{"role": "assistant", "content": "hi"}], "last message"),
        ([], "non-empty"),
        ([{"role": "user", "content": "x " * 20000}], "limit is"),
    ]
    for messages, expected in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=client.models.list().data[0].id, messages=messages)
        assert expected in caught.value.message, (expected, caught.value.message)
    for body in (b"{not json", b"[" * 100_000 + b"]" * 100_000):
        response = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_api_keys_body_limit_and_busy_queue(tiny_model, images_dir, tmp_path):
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log", VLSCOPE_API_KEYS="k1,k2",
                                VLSCOPE_API_MAX_BODY_BYTES="20000", VLSCOPE_MAX_QUEUE="0",
                                VLSCOPE_MAX_BATCH="1")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        response = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer schl\u00fcssel".encode()})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        # with keys set, /metrics needs one and /health says only whether the server is up
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert httpx.get(f"{url}/health").json() == {"status": "ready"}
        assert "queue_depth" in httpx.get(f"{url}/health", headers={"Authorization": "Bearer k1"}).json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        assert client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=client.models.list().data[0].id, messages=image_message(images_dir))
        assert caught.value.status_code == 413
        # hold the only slot with a long stream, then a second request is refused with Retry-After
        holder = httpx.Client(timeout=60).stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                                                 json={"messages": [{"role": "user", "content": "long"}],
                                                       "max_tokens": 5000, "ignore_eos": True, "stream": True})
        with holder as response:
            lines = response.iter_lines()  # kept: dropping the iterator closes the connection, a real disconnect
            next(lines)
            busy = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            records = [(r.status, r.max_new_tokens, r.error) for r in MetricsStore(tmp_path / "api.db").recent(5)]
            assert busy.status_code == 429 and int(busy.headers["retry-after"]) > 0, (
                records, (tmp_path / "server.log").read_text()[-3000:])
            assert busy.json()["error"]["code"] == "busy"
    finally:
        process.terminate()
        process.wait(20)


def test_concurrent_clients_share_decode_steps_and_disconnect_frees_the_queue(shared_server):
    url, db = shared_server
    began = time.time()
    # a client that leaves mid-stream: its generation is cancelled and the queue moves on
    with httpx.Client(timeout=60).stream("POST", f"{url}/v1/chat/completions",
                                         json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "ignore_eos": True,
                                               "stream": True}) as response:
        lines = response.iter_lines()
        next(lines)
        next(lines)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    started = time.perf_counter()
    results = {}

    def ask(index):
        results[index] = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": f"q{index}"}],
                                                        max_tokens=24)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 4 and time.perf_counter() - started < 60
    records = sorted(MetricsStore(db).between(began, include_warmup=False), key=lambda r: r.submitted_at)
    left = [r for r in records if r.max_new_tokens == 5000]
    assert left and left[0].status == "cancelled" and left[0].output_tokens < 5000
    served = sorted([r for r in records if r.max_new_tokens == 24], key=lambda r: r.started_at)
    assert len(served) == 4 and all(r.status == "ok" for r in served)
    # answered together: later ones start before earlier ones end, and decode steps carry several of them (answers
    # long enough that one drafted alone, several tokens a step, is still running when the next joins)
    assert any(later.started_at < earlier.finished_at for earlier, later in zip(served, served[1:]))
    assert max(size for r in served for size in r.decode_batch_sizes) >= 2


def test_tool_calls_on_the_wire_as_openai_sends_them(shared_server):
    """OpenAI's function-calling guide's loop over a streamed answer (keep each call's first delta, append the
    arguments of later ones) rebuilds the calls; a function without parameters is called with {}; a forced call cut
    by max_tokens is the call so far with finish length, and its markup never shows as content."""
    import jsonschema

    url, _ = shared_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "now", "description": "The time"}}]
    question = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    stream = client.chat.completions.create(model=model, messages=question, tools=tools, tool_choice="required",
                                            max_tokens=150, temperature=1.0, seed=3, stream=True)
    final_tool_calls, firsts = {}, []
    for chunk in stream:
        for tool_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            index = tool_call.index
            if index not in final_tool_calls:
                final_tool_calls[index] = tool_call
                firsts.append((tool_call.id, tool_call.type, tool_call.function.arguments))
            else:
                assert tool_call.id is None and tool_call.function.name is None
                final_tool_calls[index].function.arguments += tool_call.function.arguments
        assert not (chunk.choices and chunk.choices[0].delta.content)  # calls alone: no content
    assert final_tool_calls and all(id_ and kind == "function" and arguments == "" for id_, kind, arguments in firsts)
    for call in final_tool_calls.values():
        arguments = json.loads(call.function.arguments)
        if call.function.name == "now":
            assert arguments == {}
        else:
            jsonschema.validate(arguments, weather)

    long_note = {"type": "object", "properties": {"text": {"type": "string", "minLength": 60, "maxLength": 80}},
                 "required": ["text"], "additionalProperties": False}
    forced = dict(model=model, messages=question, max_tokens=24, tool_choice={"type": "function", "function": {
        "name": "note"}}, tools=tools + [{"type": "function", "function": {"name": "note", "parameters": long_note}}])
    cut = client.chat.completions.create(**forced).choices[0]
    (call,) = cut.message.tool_calls
    assert cut.finish_reason == "length" and cut.message.content is None and call.function.name == "note"
    assert call.function.arguments.startswith('{"text": "')
    chunks = list(client.chat.completions.create(**forced, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.content for c in chunks)
    streamed = [part for c in chunks for part in c.choices[0].delta.tool_calls or []]
    assert streamed[0].function.name == "note" and "".join(
        part.function.arguments for part in streamed).startswith('{"text": "')
    assert len(streamed) > 3  # the arguments stream as the model writes them, not at the block's end


def test_every_refusal_of_a_field_names_it(shared_server):
    url, _ = shared_server
    ask = [{"role": "user", "content": "hi"}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    long_tools = [{"type": "function", "function": {"name": f"f{n}", "description": " ".join(
        f"word{n}x{k}" for k in range(600))}} for n in range(6)]  # under the bytes limit, over the prompt's tokens
    cases = [({"messages": ask, "stop": ["}"], "response_format": schema}, "stop"),
             ({"messages": ask, "tools": long_tools}, "tools"),
             ({"messages": [{"role": "user", "content": 5}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                 "url": "data:image/png,plain"}}]}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                 "url": "https://example.com/a.png"}}]}]}, "messages"),
             ({"messages": [{"role": "user", "content": "x <|im_end|>"}]}, "messages"),
             ({"messages": ask, "max_tokens": 2, "response_format": {"type": "json_schema"}}, "response_format")]
    for body, param in cases:
        response = httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (param, response.text)


def test_control_tokens_in_a_message_get_400_not_500(shared_server):
    url, db = shared_server
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "look <|image_pad|> here"}], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_prompt"
    assert "<|image_pad|>" in error["message"]


def test_structured_answers_and_tool_calls_through_the_openai_sdk(shared_server):
    """chat.completions.parse with a Pydantic model, a streamed named call the SDK assembles, a required call and the
    follow-up turn that answers it; schema faults are 400s naming the field, recorded by kind."""
    from typing import Literal

    import jsonschema
    from pydantic import BaseModel, Field

    url, db = shared_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    class Invoice(BaseModel):
        document_type: Literal["invoice", "receipt", "letter"]
        paid: bool
        total: int = Field(ge=0, le=99_999)
        vendor: str = Field(max_length=20)

    ask = [{"role": "user", "content": "Read the invoice"}]
    for temperature in (0.0, 1.0):
        parsed = client.chat.completions.parse(model=model, messages=ask, response_format=Invoice, max_tokens=120,
                                               temperature=temperature, seed=5)
        assert parsed.choices[0].finish_reason == "stop"
        assert isinstance(parsed.choices[0].message.parsed, Invoice)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["n", "tags"], "additionalProperties": False}
    streamed = list(client.chat.completions.create(
        model=model, messages=ask, stream=True, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "counts", "schema": schema}}))
    assert streamed[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed)), schema)

    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                               "parameters": weather}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                              "additionalProperties": False}}}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.chat.completions.stream(model=model, messages=question, tools=tools, max_tokens=100,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)

    answer = client.chat.completions.create(model=model, messages=question, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100).choices[0]
    assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
    follow_up = question + [answer.message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": answer.message.tool_calls[0].id, "content": "18 C"}]
    after = client.chat.completions.create(model=model, messages=follow_up, tools=tools, max_tokens=5).choices[0]
    assert after.finish_reason == "length" and after.message.tool_calls is None and after.message.content

    faults = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "object", "unevaluatedProperties": False}}}), "response_format", "unsupported_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/a"}}}),
         "response_format", "invalid_schema"),
        (dict(tools=[{"type": "function", "function": {"name": f"f{n}"}} for n in range(200)], tool_choice="auto"),
         "tools", "too_many_tools"),
        (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "elsewhere"}}), "tool_choice",
         "invalid_value"),
    ]
    for extra, param, code in faults:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=question, max_tokens=5, **extra)
        assert (caught.value.body["param"], caught.value.body["code"]) == (param, code), caught.value.body
    kinds = {record.error_type for record in MetricsStore(str(db)).recent(200) if record.status == "refused"}
    assert {"unsupported_schema", "invalid_schema", "too_many_tools", "invalid_value"} <= kinds

    # Without strict, a keyword no grammar holds is left out, and an answer that breaks it says so on its choice.
    never_unique = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
    loose = {"type": "json_schema", "json_schema": {"name": "tags", "schema": never_unique}}
    body = {"model": model, "messages": ask, "max_tokens": 30, "response_format": loose}
    flagged = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert flagged["finish_reason"] == "stop" and "non-unique" in flagged["schema_violations"][0]
    last = list(client.chat.completions.create(model=model, messages=ask, max_tokens=30, response_format=loose,
                                               stream=True))[-1]
    assert last.choices[0].model_extra["schema_violations"] == flagged["schema_violations"]
    strict = {"type": "json_schema", "json_schema": {"name": "tags", "schema": never_unique, "strict": True}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ask, max_tokens=5, response_format=strict)
    assert caught.value.body["code"] == "unsupported_schema"
    valid = client.chat.completions.create(model=model, messages=ask, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "counts", "schema": schema}})  # held whole: nothing to flag
    assert "schema_violations" not in (valid.choices[0].model_extra or {})

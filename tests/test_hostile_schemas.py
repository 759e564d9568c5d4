"""The third hostile set's schemas, sent as a response format or a tool's parameters: each ends in a clear 400 that
names the field at fault (or, once an answer has begun streaming, an error event and the stream's end), recorded by
kind, within seconds, with no memory kept for it, and without holding up another user's answer."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from engine import ChatRequest, InvalidSchema, MetricsStore
from engine.structured.compiler import Refusal
from fixtures.hostile_schemas import (deep_pattern, late_explosion, many_pattern_properties, repeated_repeats,
                                      required_self)

from .test_api import start_server
from .test_hostile_clips import MB, PeakMemory


@pytest.fixture(scope="module")
def schema_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-schemas")
    process, url = start_server(tiny_model, folder / "api.db", folder / "server.log")
    yield process, url, folder / "api.db"
    process.terminate()
    process.wait(20)


def as_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def as_tool(schema: dict) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


def chat(url: str, timeout: float = 30, **fields) -> tuple[httpx.Response, float]:
    body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 24} | fields
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
    return response, time.perf_counter() - started


def refused(response: httpx.Response, code: str, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    return error["message"]


def test_a_pattern_of_600_nested_groups_is_a_400_recorded_not_a_500(schema_server):
    _, url, db = schema_server
    response, _ = chat(url, response_format=as_format(deep_pattern(600)))
    assert "nested too deeply" in refused(response, "schema_too_complex", "response_format")
    response, _ = chat(url, tools=as_tool(deep_pattern(600)), tool_choice="auto")
    refused(response, "schema_too_complex", "tools")
    records = [r for r in MetricsStore(db).recent(50) if r.error_type == "schema_too_complex"]
    assert len(records) >= 2 and all(r.status == "refused" for r in records)


def test_grammars_that_explode_at_their_start_are_refused_when_built(schema_server):
    _, url, _ = schema_server
    response, seconds = chat(url, response_format=as_format(required_self()))
    assert "no answer could finish it" in refused(response, "invalid_schema", "response_format") and seconds < 10
    response, seconds = chat(url, response_format=as_format(repeated_repeats()))
    refused(response, "schema_too_complex", "response_format")
    assert seconds < 10


def test_a_grammar_that_gives_out_mid_answer_ends_it_with_an_error_never_a_500(schema_server):
    _, url, db = schema_server
    response, _ = chat(url, response_format=as_format(late_explosion()))
    assert "while the answer was written" in refused(response, "schema_too_complex", "response_format")
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 24, "stream": True,
            "response_format": as_format(late_explosion(401))}) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "schema_too_complex" and error["param"] == "response_format"
    records = [r for r in MetricsStore(db).recent(50) if r.error_type == "schema_too_complex" and r.status == "error"]
    assert len(records) == 2  # each gave out mid-answer; such a grammar is then forgotten, and refused at submit
    again, seconds = chat(url, response_format=as_format(late_explosion()))
    assert "while the answer was written" in refused(again, "schema_too_complex", "response_format") and seconds < 1


def test_a_slow_compile_is_cut_at_its_limit_and_holds_no_one_up(schema_server):
    process, url, _ = schema_server
    chat(url, response_format=as_format({"type": "object", "properties": {"n": {"type": "integer"}}}))  # worker up
    results = {}

    def hostile():
        results["hostile"] = chat(url, response_format=as_format(many_pattern_properties(600)))

    with PeakMemory(process.pid) as memory:
        thread = threading.Thread(target=hostile)
        thread.start()
        time.sleep(0.3)
        plain, plain_seconds = chat(url, max_tokens=4)
        thread.join()
    response, seconds = results["hostile"]
    assert "takes over 2 s to build" in refused(response, "schema_too_complex", "response_format")
    assert seconds < 5  # it compiled for 24 s before it was refused
    assert plain.status_code == 200 and plain_seconds < 2
    assert memory.growth < 200 * MB
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_refused_grammars_keep_no_memory_and_the_cache_is_bound_by_bytes(make_engine):
    engine = make_engine(grammar_cache_entries=64, grammar_cache_bytes=1)
    for letter in "abc":
        with pytest.raises(InvalidSchema):
            engine.submit(ChatRequest(prompt="x", json_schema=json.dumps(repeated_repeats(letter))))
    cache = engine._grammars._cache
    assert len(cache) == 3 and all(isinstance(item, Refusal) for item in cache.values())
    for index in range(3):
        schema = {"type": "object", "properties": {f"k{index}": {"type": "string", "maxLength": 3}}}
        engine.ask(ChatRequest(prompt="x", json_schema=json.dumps(schema), max_new_tokens=4))
    # each compiled grammar weighs more than the one byte allowed: only the newest stays
    assert len(cache) == 1 and engine._grammars.cached_bytes > 0

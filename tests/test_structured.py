"""Structured answers on the tiny model: every answer that stops is JSON valid against its schema, every cut one a
JSON prefix, in greedy and sampled decoding, every precision and both decode steps, batched; bad schemas and tool sets
are refused before the request queues, by kind; a cancel frees the matcher."""
from __future__ import annotations

import gc
import json

import jsonschema
import pytest

from engine.structured.tool_calls import CallArguments, ParsedCall, ToolCallParser, split_calls
from engine import ChatRequest, InvalidPrompt, InvalidSchema, MetricsStore, TextChunk, Tool
from engine.records.stages import GRAMMAR, REFUSED
from engine.structured.matcher import live_matchers

from .json_prefix import is_json_prefix

# Bounded schemas: with synthetic weights a string ends only where its schema bounds it.
SCHEMAS = [
    {"type": "object", "properties": {
        "document_type": {"enum": ["invoice", "receipt", "letter", "form"]},
        "paid": {"type": "boolean"},
        "total": {"type": "integer", "minimum": 0, "maximum": 10000},
        "vendor": {"type": "string", "maxLength": 12}},
     "required": ["document_type", "paid", "total", "vendor"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"$defs": {"line": {"type": "object", "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                                          "unit": {"enum": ["kg", "pcs"]}},
                        "required": ["qty", "unit"], "additionalProperties": False}},
     "type": "object", "properties": {"lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "maxItems": 3}},
     "required": ["lines"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"enum": ["yes", "no"]},
               {"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["n"], "additionalProperties": False}]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["date", "code"], "additionalProperties": False},
]


def _run_all(engine, requests):
    """Submit every request at once (they decode together in batches) and collect (text, metrics) for each."""
    handles = [engine.submit(request) for request in requests]
    results = []
    for handle in handles:
        text, metrics = "", None
        for event in handle.events():
            if isinstance(event, TextChunk):
                text += event.text
            else:
                metrics = event if hasattr(event, "finish_reason") else metrics
        results.append((text, metrics))
    return results


def _check(schema, text, finish_reason):
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    else:
        assert finish_reason == "length" and is_json_prefix(text), (text, finish_reason)


@pytest.mark.parametrize("dtype,kernels", [("float32", "packed"), ("bfloat16", "packed"), ("int8", "packed"),
                                           ("float32", "plain")])
def test_finished_answers_validate_and_cut_ones_are_json_prefixes(make_engine, dtype, kernels):
    engine = make_engine(dtype=dtype, kernels=kernels, max_batch=4, max_queue=32)
    requests = [ChatRequest(prompt=f"Read the document {index}", json_schema=json.dumps(schema),
                            max_new_tokens=limit, temperature=temperature, seed=index)
                for index, schema in enumerate(SCHEMAS) for temperature in (0.0, 1.2) for limit in (200, 6)]
    results = _run_all(engine, requests)
    finished = 0
    for request, (text, metrics) in zip(requests, results):
        assert metrics.status == "ok", metrics.error
        _check(json.loads(request.json_schema), text, metrics.finish_reason)
        finished += metrics.finish_reason == "stop"
        assert metrics.stages[GRAMMAR] > 0
    assert finished >= len(SCHEMAS)  # every schema finished at least once within 200 tokens
    shared = max(max(m.decode_batch_sizes, default=1) for _, m in results)
    assert shared > 1 if engine.batch_limit() > 1 else shared == 1  # the direct step decodes them together
    gc.collect()
    assert live_matchers() == 0


def test_json_object_and_forced_tool_calls(engine):
    text = engine.ask(ChatRequest(prompt="Any JSON", json_schema='{"type": "object"}', max_new_tokens=60)).text
    assert text.startswith("{") and is_json_prefix(text)
    weather = Tool("get_weather", "Weather now", json.dumps({
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}))
    add = Tool("add", "", json.dumps({"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
                                      "required": ["a"], "additionalProperties": False}))
    for choice, parallel in (("get_weather", True), ("required", False), ("required", True)):
        answer = engine.ask(ChatRequest(prompt="Weather in Paris?", tools=(weather, add), tool_choice=choice,
                                        parallel_tool_calls=parallel, max_new_tokens=120, temperature=1.0, seed=7))
        content, calls = split_calls(answer.text, frozenset({"get_weather", "add"}))
        assert answer.metrics.finish_reason == "stop" and content is None and calls, answer.text
        assert parallel and choice == "required" or len(calls) == 1
        for call in calls:
            assert choice in ("required", call.name)
            schema = json.loads((weather if call.name == "get_weather" else add).parameters)
            jsonschema.validate(json.loads(call.arguments), schema)


def test_bad_schemas_and_tool_sets_are_refused_by_kind_before_queueing(make_engine, tmp_path):
    engine = make_engine(max_tools=3, max_schema_bytes=4096, max_schema_depth=6)
    nested = {"type": "object"}
    for _ in range(8):
        nested = {"type": "object", "properties": {"x": nested}}
    tool = Tool("f", "", '{"type": "object"}')
    cases = [
        (dict(json_schema="{not json"), "invalid_schema", "not valid JSON"),
        (dict(json_schema='{"type": "strin"}'), "invalid_schema", "not a valid JSON Schema"),
        (dict(json_schema='{"properties": {"a": {"$ref": "#/$defs/missing"}}}'), "invalid_schema", "$ref"),
        (dict(json_schema='{"type": "object", "unevaluatedProperties": false}'), "unsupported_schema",
         "unevaluatedProperties"),
        (dict(json_schema='{"type": "string", "format": "colour"}'), "unsupported_schema", "colour"),
        (dict(json_schema=json.dumps({"enum": ["x" * 100] * 50})), "schema_too_large", "VLSCOPE_MAX_SCHEMA_BYTES"),
        (dict(json_schema=json.dumps(nested)), "schema_too_complex", "VLSCOPE_MAX_SCHEMA_DEPTH"),
        (dict(tools=tuple(Tool(f"f{n}") for n in range(4)), tool_choice="required"), "too_many_tools", "at most 3"),
        (dict(tools=(Tool("g", "", '{"$ref": "#/nowhere"}'),), tool_choice="g"), "invalid_schema", "$ref"),
        (dict(tools=(tool, tool)), "invalid_schema", "share a name"),
        (dict(tools=(tool,), tool_choice="elsewhere"), "invalid_schema", "not among the tools"),
        (dict(json_schema='{"type": "object"}', tools=(tool,), tool_choice="f"), "invalid_schema", "exclude"),
        (dict(json_schema="false"), "invalid_schema", "no answer can satisfy"),
        (dict(json_schema='{"oneOf": [{"type": "integer"}, {"minimum": 2}]}'), "unsupported_schema", "oneOf"),
    ]
    for fields, kind, words in cases:
        with pytest.raises(InvalidSchema) as caught:
            engine.submit(ChatRequest(prompt="hi", **fields))
        assert caught.value.kind == kind and words in caught.value.message, (fields, caught.value.message)
    for fields in (dict(ignore_eos=True), dict(stop=("}",))):
        with pytest.raises(InvalidPrompt):
            engine.submit(ChatRequest(prompt="hi", json_schema='{"type": "object"}', **fields))
    odd = ["true", "{}", "null", "[]", "1", '{"type": 5}', '{"$ref": "#"}', '{"properties": {"a": {"$ref": "#"}}}',
           '{"enum": []}', '{"type": "string", "pattern": "("}', '{"type": "string", "pattern": "[z-a]"}',
           '{"items": false}', '{"type": "array", "minItems": 5, "maxItems": 2}', '{"allOf": [{"type": "string"}, '
           '{"type": "integer"}]}', '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}']
    odd_refusals = []
    for text in odd:  # each compiles or is refused by name: never another error, never a queued request
        try:
            engine.submit(ChatRequest(prompt="hi", json_schema=text, max_new_tokens=1)).cancel()
        except InvalidSchema as exc:
            assert exc.kind in ("invalid_schema", "unsupported_schema", "schema_too_complex"), (text, exc.kind)
            odd_refusals.append(exc.kind)
    slow = make_engine(grammar_compile_seconds=1e-6, db_path=str(tmp_path / "slow.db"))
    with pytest.raises(InvalidSchema) as caught:
        slow.submit(ChatRequest(prompt="hi", json_schema=json.dumps(SCHEMAS[0])))
    assert caught.value.kind == "schema_too_complex" and "VLSCOPE_GRAMMAR_COMPILE_SECONDS" in caught.value.message
    records = [r for r in MetricsStore(engine.config.db_path).recent(200) if r.status == REFUSED]
    expected = [kind for _, kind, _ in cases] + ["invalid_prompt"] * 2 + odd_refusals
    assert sorted(r.error_type for r in records) == sorted(expected)
    assert all(r.prompt is None and r.answer is None for r in records)
    assert engine.queue_depth == 0


def test_a_schema_without_strict_is_held_to_the_closest_grammar_and_a_broken_answer_is_flagged(engine):
    """strict: exactly or refused. Without: keywords no grammar holds are left out of the grammar, named in the
    record, and a finished answer that breaks them is flagged there, never silently."""
    never_unique = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
    with pytest.raises(InvalidSchema) as caught:
        engine.submit(ChatRequest(prompt="hi", json_schema=json.dumps(never_unique)))
    assert caught.value.kind == "unsupported_schema" and "uniqueItems" in caught.value.message
    answer = engine.ask(ChatRequest(prompt="hi", json_schema=json.dumps(never_unique), strict=False,
                                    max_new_tokens=30))
    assert answer.metrics.finish_reason == "stop" and len(json.loads(answer.text)) == 3
    assert any("uniqueItems" in words for words in answer.metrics.schema_loosened)
    assert answer.metrics.schema_violations and "non-unique" in answer.metrics.schema_violations[0]
    stored = MetricsStore(engine.config.db_path).get(answer.metrics.id)
    assert stored.schema_violations == answer.metrics.schema_violations

    held = engine.ask(ChatRequest(prompt="hi", json_schema=json.dumps(SCHEMAS[0]), strict=False, max_new_tokens=80))
    assert held.metrics.schema_loosened == () == held.metrics.schema_violations  # held whole: nothing to flag
    odd = Tool("tag", "", json.dumps({"type": "object", "properties": {"tags": never_unique}, "required": ["tags"],
                                      "additionalProperties": False}), strict=False)
    called = engine.ask(ChatRequest(prompt="tag it", tools=(odd,), tool_choice="tag", max_new_tokens=60))
    assert called.metrics.schema_violations and called.metrics.schema_violations[0].startswith("tag: tags")
    for schema in ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, {"type": "string", "format": "colour"},
                   {"type": "object", "dependencies": {"a": ["b"]}}, {"not": {"type": "string"}}):
        engine.submit(ChatRequest(prompt="hi", json_schema=json.dumps(schema), strict=False, max_new_tokens=1)).cancel()


def test_forced_tokens_ride_along_and_the_answer_is_the_step_by_step_one(make_engine, tmp_path):
    """Jump-forward: where the grammar allows a single token, it goes into the model beside the step's own, and the
    greedy answer is token for token the one a token a step gives, alone and in a batch beside a free answer."""
    lines = {"type": "array", "maxItems": 3, "items": {
        "type": "object", "required": ["item_description", "quantity_ordered"], "additionalProperties": False,
        "properties": {"item_description": {"type": "string", "maxLength": 6},
                       "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 9}}}}
    invoice = {"type": "object", "required": ["invoice_number", "payment_status", "line_items"],
               "additionalProperties": False,
               "properties": {"invoice_number": {"type": "string", "maxLength": 6},
                              "payment_status": {"enum": ["paid", "partially_paid"]}, "line_items": lines}}
    tool = Tool("record_invoice", "", json.dumps(invoice))
    asks = [dict(json_schema=json.dumps(invoice)), dict(tools=(tool,), tool_choice="required")]
    answers = {}
    for forced in (False, True):
        engine = make_engine(jump_forward=forced, db_path=str(tmp_path / f"{forced}.db"))
        alone = [engine.ask(ChatRequest(prompt="Read the invoice", max_new_tokens=120, **ask)) for ask in asks]
        beside = _run_all(engine, [ChatRequest(prompt="Read the invoice", max_new_tokens=120, **asks[0]),
                                   ChatRequest(prompt="Say something", max_new_tokens=30, ignore_eos=True)])
        answers[forced] = ([(a.text, a.metrics.forced_tokens) for a in alone], [text for text, _ in beside])
        assert all(a.metrics.finish_reason == "stop" for a in alone)
    (plain, plain_beside), (jumped, jumped_beside) = answers[False], answers[True]
    assert [text for text, _ in jumped] == [text for text, _ in plain] and jumped_beside == plain_beside
    assert all(forced == 0 for _, forced in plain) and all(forced > 10 for _, forced in jumped), jumped
    jsonschema.validate(json.loads(jumped[0][0]), invoice)


def test_forced_tokens_on_the_full_size_model_give_the_step_by_step_answer(tmp_path):
    """The same on the real 2B shapes (int8, synthetic weights), where one-row products round differently from
    products of several: a greedy schema answer with forced tokens riding along and one fed a token a step."""
    from engine import Engine, EngineConfig

    from .conftest import FULL_SKELETON

    engine = Engine(EngineConfig(model=str(FULL_SKELETON), dtype="int8", compile="off", warmup=False,
                                 db_path=str(tmp_path / "full.db")))
    try:
        schema = json.dumps({"type": "object", "required": ["invoice_number", "payment_status", "customer_name"],
                             "additionalProperties": False, "properties": {
                                 "invoice_number": {"type": "string", "maxLength": 8},
                                 "payment_status": {"enum": ["paid", "partially_paid"]},
                                 "customer_name": {"type": "string", "maxLength": 8}}})
        jumped = engine.ask(ChatRequest(prompt="Read the invoice", json_schema=schema, max_new_tokens=40))
        engine.config = engine.config.replace(jump_forward=False)
        stepped = engine.ask(ChatRequest(prompt="Read the invoice", json_schema=schema, max_new_tokens=40))
    finally:
        engine.close()
    assert jumped.text == stepped.text and json.loads(jumped.text)
    assert jumped.metrics.forced_tokens > 10 and stepped.metrics.forced_tokens == 0


def test_a_cancel_frees_the_matcher_and_the_queue(engine):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 10_000}
    handle = engine.submit(ChatRequest(prompt="count", json_schema=json.dumps(schema), max_new_tokens=500))
    for event in handle.events():
        if isinstance(event, TextChunk) and event.text:
            handle.cancel()
        if hasattr(event, "finish_reason"):
            assert event.status == "cancelled"
    gc.collect()
    assert live_matchers() == 0 and engine.queue_depth == 0 and engine.active_sequences == 0


def test_the_tool_call_reader_keeps_what_does_not_parse_as_text():
    names = frozenset({"f", "g"})
    text = ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": "{\\"b\\": 2}"}\n</tool_call>')
    content, calls = split_calls(text, names)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {"b": 2})]
    assert content.startswith("Let me look.") and '"unknown"' in content
    streamed, parser = [], ToolCallParser(names)
    for start in range(0, len(text), 5):  # piece by piece, split anywhere, even inside <tool_call>
        streamed += parser.feed(text[start:start + 5])
    streamed += parser.finish()
    assert [p.name for p in streamed if isinstance(p, ParsedCall)] == ["f", "g"]
    assert "".join(p for p in streamed if isinstance(p, str)).strip() == content
    # a call's arguments stream as they come, in pieces that add up to the call's arguments
    pieces = [p.text for p in streamed if isinstance(p, CallArguments) and p.index == 0]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"a": 1} == json.loads(parser.calls[0].arguments)
    assert split_calls("no calls, just <tool_ talk", names) == ("no calls, just <tool_ talk", [])
    content, (only,) = split_calls(text, names, max_calls=1)  # parallel_tool_calls false: later blocks stay text
    assert only.name == "f" and '"name": "g"' in content
    # Cut by max_tokens: the call so far when its function is known, and never the markup as content.
    assert split_calls('<tool_call>\n{"name": "f", "argu', names) == ("", [])
    content, (cut,) = split_calls('Sure.\n<tool_call>\n{"name": "g", "arguments": {"b": 2', names)
    assert content == "Sure." and (cut.name, cut.arguments) == ("g", '{"b": 2')
    assert split_calls('<tool_call>\n{"na', frozenset({"f"}))[1][0].name == "f"  # the only function offered
    # streamed as OpenAI streams a call: the name first, then the arguments alone
    assert cut.delta() == {"index": 0, "id": cut.id, "type": "function", "function": {"name": "g", "arguments": ""}}
    assert CallArguments(0, '{"b"').delta() == {"index": 0, "function": {"arguments": '{"b"'}}


def test_auto_calls_are_held_to_their_schemas_and_free_text_stays_free(engine):
    """With tool_choice auto, text is free (every token allowed, the answer as without a grammar) and a call the
    model opens is held to its function's schema, then text is free again."""
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.matcher import GrammarMatcher

    loaded = engine.loaded
    open_id = loaded.tokenizer.convert_tokens_to_ids("<tool_call>")
    weather = Tool("get_weather", "Weather now", json.dumps({
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}))
    plain = Tool("now")  # no parameters: its arguments are {}
    request = ChatRequest(prompt="Weather in Paris?", tools=(weather, plain), max_new_tokens=40)
    grammar = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids).for_request(
        request, engine.config)
    matcher = GrammarMatcher(grammar, loaded.vocab_size, loaded.eos_token_ids)
    for token in loaded.tokenizer.encode("Free text, with <b>tags</b> and {braces}: "):
        matcher.fill_mask()
        assert int(sum(bin(word & 0xFFFFFFFF).count("1") for word in matcher._bits.tolist())) == loaded.vocab_size
        matcher.accept(token)

    for seed in range(3):  # the model is pushed to open a call at once: what follows is held to the schema
        answer = engine.ask(ChatRequest(prompt="Weather in Paris?", tools=(weather, plain), parallel_tool_calls=False,
                                        logit_bias=((open_id, 100.0),), temperature=1.0, seed=seed,
                                        max_new_tokens=80))
        content, calls = split_calls(answer.text, frozenset({"get_weather", "now"}), max_calls=1)
        assert len(calls) == 1 and answer.text.startswith("<tool_call>"), answer.text
        call = calls[0]
        schema = json.loads((weather if call.name == "get_weather" else plain).parameters)
        jsonschema.validate(json.loads(call.arguments), schema)
        assert "<tool_call>" not in (content or "")  # one call at most: the grammar opened no second
    forced = engine.ask(ChatRequest(prompt="What time is it?", tools=(plain,), tool_choice="now", max_new_tokens=30))
    assert [json.loads(call.arguments) for call in split_calls(forced.text, frozenset({"now"}))[1]] == [{}]

"""A request's response format or forced tool calls to a compiled grammar (llguidance), checked against the limits
and compiled at submit, so a bad schema is a refusal before the request queues: tried first in a worker process
that is killed past the time limit (compile_check.py), then built on the caller's thread. Compiled grammars and
refusals are kept by schema, within a count and a byte bound; each sequence matches with its own copy
(structured/matcher.py)."""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import jsonschema
import llguidance
from llguidance import LLMatcher

from ..errors import InvalidSchema
from ..request import ChatRequest, Tool
from .answer_check import AnswerCheck
from .compile_check import TOOK_TOO_LONG, GrammarTrials
from .tool_calls import CLOSE, OPEN

# One space after ':' and ',' and none elsewhere: the style the model writes JSON in (and its tool calls), with no
# runs of whitespace for weak weights to wander into.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A schema without `strict`: the closest grammar (oneOf as anyOf; keywords and formats no grammar holds left out, each
# named in the grammar's warnings), and the finished answer checked against the whole schema.
LENIENT = {"lenient": True, "coerce_one_of": True}
# Bounds on building a grammar's lexer and parser, well above any schema under the byte limit that compiles in time.
LIMITS = dict(initial_lexer_fuel=2_000_000, max_grammar_size=500_000, max_lexer_states=250_000)


@dataclass(frozen=True)
class Refusal:
    """A schema refused, as the cache keeps it: its words only (an exception would keep its traceback, and with it
    whatever the failed build held)."""

    message: str
    kind: str
    about: str

    bytes = 0

    def error(self) -> InvalidSchema:
        return InvalidSchema(self.message, self.kind, self.about)


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready to match: `matcher` stays at the start, each sequence takes a deep copy."""

    matcher: LLMatcher
    what: str  # "json_schema" or "tool_calls"
    bytes: int = 0  # what building it took in memory, as its trial measured
    loosened: tuple[str, ...] = ()  # what of a schema without `strict` the grammar does not hold
    free_text: bool = False  # tool_choice auto: free text around the calls
    check: AnswerCheck | None = None  # what a finished answer is checked against, when something was loosened
    # Called with the refusal once the grammar gave out mid-answer: the cache then holds the refusal, not the grammar
    # (nor what it grew while failing), and the next request with its schema is refused at submit.
    forget: Callable[[Refusal], None] | None = field(default=None, compare=False, repr=False)


def subject(what: str) -> str:
    """The part of a request a grammar comes from, as a refusal names it."""
    return "the response format's schema" if what == "json_schema" else "a tool's parameters schema"


def _depth(value) -> int:
    """How deeply objects and arrays nest in a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def check_schema(text: str, what: str, max_depth: int) -> dict:
    """A schema (JSON text) parsed and held to JSON Schema's own schema; InvalidSchema names what is wrong."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidSchema(f"{what} is not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchema(f"{what} must be a JSON Schema object")
    if _depth(schema) > max_depth:
        raise InvalidSchema(f"{what} nests objects and arrays more than {max_depth} deep (VLSCOPE_MAX_SCHEMA_DEPTH)",
                            "schema_too_complex")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except RecursionError:  # a pattern of hundreds of nested groups: Python's own regex parser recurses per group
        raise InvalidSchema(f"{what} has a pattern nested too deeply to read", "schema_too_complex") from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise InvalidSchema(f"{what} is not a valid JSON Schema: {exc.message[:300]}"
                            + (f" (at {where})" if where else "")) from None
    return schema


def tool_call_lark(tools: tuple[Tool, ...], choice: str, parallel: bool, open_id: int | None,
                   close_id: int | None) -> str:
    """Calls in the model's own format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, each name
    with its parameters' schema: one call when a function is named or calls may not run in parallel. With `auto`,
    free text around the calls (any token but the one that opens a call): the grammar holds a call only once the
    model opens one, as a lazy grammar does, and text stays free."""
    chosen = [tool for tool in tools if choice in ("required", "auto", tool.name)]
    opening = f"<[{open_id}]>" if open_id is not None else json.dumps(OPEN)
    closing = f"<[{close_id}]>" if close_id is not None else json.dumps(CLOSE)
    bodies = []
    for index, tool in enumerate(chosen):
        body = {"type": "object", "properties": {"name": {"const": tool.name},
                                                 "arguments": json.loads(tool.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False,
                "x-guidance": JSON_STYLE if tool.strict else JSON_STYLE | LENIENT}
        bodies.append(f"call_{index}: %json {json.dumps(body)}")
    calls = " | ".join(f"call_{index}" for index in range(len(chosen)))
    if choice == "auto":
        start = f"start: text (call text){'*' if parallel else '?'}\ntext: <[^{open_id}]>*"
    else:
        start = "start: call" + (' ("\\n" call)*' if parallel and choice == "required" else "")
    return "\n".join([start, f'call: {opening} "\\n" ({calls}) "\\n" {closing}', *bodies])


class GrammarCompiler:
    """Compiles and keeps the grammars of one model's tokenizer. The tokenizer's grammar tables (about a second to
    build) are made on first use; an engine that warms up asks for them in the background as it starts."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._hf_tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, eos_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._trials: GrammarTrials | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar | Refusal] = OrderedDict()
        vocab = tokenizer.get_vocab()
        self._tool_ids = (vocab.get(OPEN), vocab.get(CLOSE))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.backend_tokenizer.to_str(),
                                                         n_vocab=self._vocab_size, eos_token=list(self._eos_ids))
            return self._tokenizer

    @property
    def trials(self) -> GrammarTrials:
        """The worker process every new grammar is tried in first (started on first use)."""
        with self._lock:
            if self._trials is None:
                self._trials = GrammarTrials(self._hf_tokenizer.backend_tokenizer.to_str(), self._vocab_size,
                                             self._eos_ids, LIMITS)
            return self._trials

    def warm_up(self) -> None:
        """The tokenizer's tables and the trial worker, made before the first structured answer needs them."""
        self.tokenizer
        self.trials.start()

    def close(self) -> None:
        if self._trials is not None:
            self._trials.close()

    def for_request(self, request: ChatRequest, config) -> CompiledGrammar | None:
        """The grammar the request's answer must follow (None: free text), from the cache or compiled now.
        Raises InvalidSchema for a schema or tool set the engine cannot hold an answer to."""
        if request.json_schema is not None and request.calls_only:
            raise InvalidSchema("a response format and a forced tool call exclude each other: the answer is either "
                                "JSON or calls", "invalid_schema")
        if request.calls_only and request.tool_choice != "required" and \
                request.tool_choice not in {tool.name for tool in request.tools}:
            raise InvalidSchema(f"tool_choice names {request.tool_choice[:64]!r}, which is not among the tools",
                                "invalid_schema", "tools")
        if request.tools:
            check_tools(request.tools, config)
        if request.json_schema is not None:
            key = ("json_schema", request.json_schema, request.strict)
        elif request.calls_only or (request.tools and request.tool_choice == "auto" and self._tool_ids[0] is not None):
            key = ("tool_calls", request.tools, request.tool_choice, request.parallel_tool_calls)
        else:
            return None
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            try:
                found = dataclasses.replace(self._compile(key, config),
                                            forget=lambda refusal: self._forget(key, refusal))
            except InvalidSchema as exc:
                found = Refusal(exc.message, exc.kind, "response_format" if key[0] == "json_schema" else "tools")
            self._keep(key, found, config)
        if isinstance(found, Refusal):
            raise found.error()
        return found

    def _keep(self, key: tuple, found: CompiledGrammar | Refusal, config) -> None:
        """Into the cache, the oldest out past its entries or its bytes (a grammar's, as its trial measured)."""
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > 1 and (
                    len(self._cache) > config.grammar_cache_entries
                    or sum(item.bytes for item in self._cache.values()) > config.grammar_cache_bytes):
                self._cache.popitem(last=False)

    def _forget(self, key: tuple, refusal: Refusal) -> None:
        with self._lock:
            if key in self._cache:
                self._cache[key] = refusal

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(item.bytes for item in self._cache.values())

    def _compile(self, key: tuple, config) -> CompiledGrammar:
        if key[0] == "json_schema":
            text = key[1]
            if len(text.encode()) > config.max_schema_bytes:
                raise InvalidSchema(f"the response format's schema is {len(text.encode()):,} bytes, over the "
                                    f"{config.max_schema_bytes:,} allowed (VLSCOPE_MAX_SCHEMA_BYTES)",
                                    "schema_too_large")
            schema = check_schema(text, "the response format's schema", config.max_schema_depth)
            if schema is False:
                raise InvalidSchema("the response format's schema is false: no answer can satisfy it")
            try:
                grammar = LLMatcher.grammar_from_json_schema({} if schema is True else text,
                                                             overrides=JSON_STYLE if key[2] else JSON_STYLE | LENIENT)
            except ValueError as exc:
                raise InvalidSchema(f"the response format's schema cannot be enforced: {str(exc)[:300]}") from None
            check = AnswerCheck("json_schema", (("", text),))
        else:
            _, tools, choice, parallel = key
            grammar = LLMatcher.grammar_from_lark(tool_call_lark(tools, choice, parallel, *self._tool_ids))
            check = AnswerCheck("tool_calls", tuple((tool.name, tool.parameters) for tool in tools))
        compiled = self._build(grammar, key[0], config.grammar_compile_seconds)
        if key[0] == "tool_calls" and key[2] == "auto":
            compiled = dataclasses.replace(compiled, free_text=True)
        loosened = tuple(compiled.matcher.get_grammar_warnings())
        return dataclasses.replace(compiled, loosened=loosened, check=check) if loosened else compiled

    def _build(self, grammar: str, what: str, limit_s: float) -> CompiledGrammar:
        """The grammar tried in the worker first, killed there past the time limit; built here only once it is
        known to build in time and within bounds."""
        trial = self.trials.trial(grammar, limit_s)
        if trial.error == TOOK_TOO_LONG or trial.seconds > limit_s:
            raise InvalidSchema(f"{subject(what)} takes over {limit_s:g} s to build into a grammar (the limit, "
                                "VLSCOPE_GRAMMAR_COMPILE_SECONDS): simplify it", "schema_too_complex")
        if trial.error is not None:
            raise _refusal(trial.error, what)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0,
                            limits=llguidance.LLParserLimits(**LIMITS, verbose_errors=False))
        if not matcher.is_error():
            matcher.compute_bitmask()  # the lexer is built on the first mask: built here, not at the first token
        if matcher.is_error():
            raise _refusal(matcher.get_error(), what)
        return CompiledGrammar(matcher, what, trial.bytes)


def check_tools(tools: tuple[Tool, ...], config) -> None:
    """Tool count, total size, unique names and each parameters schema, before any grammar is built; a refusal
    names the tools as the part at fault."""
    try:
        _check_tools(tools, config)
    except InvalidSchema as exc:
        exc.about = "tools"
        raise


def _check_tools(tools: tuple[Tool, ...], config) -> None:
    if len(tools) > config.max_tools:
        raise InvalidSchema(f"{len(tools)} tools; at most {config.max_tools} per request (VLSCOPE_MAX_TOOLS)",
                            "too_many_tools")
    size = sum(len(tool.name) + len(tool.description.encode()) + len(tool.parameters.encode()) for tool in tools)
    if size > config.max_schema_bytes:
        raise InvalidSchema(f"the tools' definitions are {size:,} bytes, over the {config.max_schema_bytes:,} allowed "
                            "(VLSCOPE_MAX_SCHEMA_BYTES)", "too_many_tools")
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidSchema("two tools share a name: each function needs its own", "invalid_schema")
    for tool in tools:
        check_schema(tool.parameters, f"the parameters of tool {tool.name!r}", config.max_schema_depth)


UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _refusal(error: str, what: str) -> InvalidSchema:
    """llguidance's error as a refusal that says what the client can change."""
    subject_ = subject(what)
    unimplemented = UNIMPLEMENTED.search(error)
    if unimplemented:
        keys = unimplemented.group(1).replace('"', "")
        return InvalidSchema(f"{subject_} uses {keys}, which this server does not enforce: remove it, or the answer "
                             "could break it", "unsupported_schema")
    if "oneOf constraints are not supported" in error:
        return InvalidSchema(f"{subject_} uses oneOf, which this server enforces only where its branches cannot "
                             "overlap: use anyOf", "unsupported_schema")
    unknown_format = re.search(r"Unknown format: (\S+)", error)
    if unknown_format:
        return InvalidSchema(f"{subject_} uses format {unknown_format.group(1)!r}, which this server does not enforce",
                             "unsupported_schema")
    if "does not exist" in error or "$ref" in error or "not present in a registry" in error:
        return InvalidSchema(f"{subject_} has a $ref that does not resolve: {error.splitlines()[0][:300]}",
                             "invalid_schema")
    if any(word in error.lower() for word in ("limit", "fuel", "too many", "too large", "too complex")):
        return InvalidSchema(f"{subject_} is too complex to enforce: {error.splitlines()[0][:300]}",
                             "schema_too_complex")
    return InvalidSchema(f"{subject_} cannot be enforced: {error.splitlines()[0][:300]}", "invalid_schema")

"""Starlette routes of the OpenAI-compatible API. They share the UI's engine: one model in memory per process.
API keys are checked before any route runs, by the server guard (api/guard.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (Busy, Cancelled, ChatRequest, InsufficientMemory, InvalidImage, InvalidPrompt, InvalidSchema,
                    InvalidVideo, PromptTooLong, RequestHandle, RequestMetrics, ServingEngine, StageStarted, TextChunk,
                    VlscopeError)
from engine.inputs.limits import max_messages
from engine.records.stages import PREFILL, VISION_ENCODE
from engine.records.trace import refusal_record
from engine.structured.tool_calls import CallArguments, ToolCallParser, split_calls
from server.slot import engine_slot, ensure_loaded, get_store, server_settings, shutdown

from . import prometheus, refusals
from .body import read_body
from .guard import API_PREFIXES, authorized
from .image_fetch import ImageFetcher
from .errors import ApiError, error_response
from .openai_format import (chunk, completion, finish_reason, logprobs_content, model_entry, public_metrics,
                            schema_flag, served_model_name, stream_settings, to_chat_request, usage)

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting handler checks that its client is still there
STARTED = int(time.time())  # the served model's `created`: when this server process started


@asynccontextmanager
async def lifespan(app):
    """The server's life: the model loads at start-up, in the background, so the API is ready without anyone
    opening the UI first; the engine closes at shutdown."""
    threading.Thread(target=ensure_loaded, name="vlscope-load", daemon=True).start()
    yield
    shutdown()


async def refuse(error: ApiError, path: str = "") -> JSONResponse:
    """The error's response, after recording the refusal (its kind and message, never the body or the key) unless an
    engine already recorded the request."""
    kind = error.code or error.error_type
    message = error.message if error.recorded else refusals.tally.admit(kind, error.message)
    if message is not None and not error.recorded:
        # The guard names the path; route handlers (path "") are the API's.
        source = "app" if path and not path.startswith(API_PREFIXES + ("/health",)) else "api"
        record = refusal_record(engine_slot().config, _model_name(), source, kind, message)
        await anyio.to_thread.run_sync(get_store().add, record)
    return error_response(error)


FETCH_LIMITER = anyio.CapacityLimiter(4)  # image URL fetches in flight; the default thread pool stays free


def _request_from_body(body: dict, engine):
    """Blocking (image URLs are fetched, data URLs decoded): run it off the event loop."""
    settings = server_settings()
    fetcher = ImageFetcher(settings.api_image_hosts, engine.config.max_image_bytes,
                           settings.api_image_private_networks, settings.api_image_fetch_seconds)
    config = engine.config
    # A clip comes as a data: URL inside the JSON body, so the body limit bounds it too.
    video_fetcher = ImageFetcher(settings.api_image_hosts, config.max_video_bytes, settings.api_image_private_networks,
                                 settings.api_image_fetch_seconds, what="video")
    return to_chat_request(body, fetcher, config.max_new_tokens, settings.api_allow_ignore_eos, config.max_images,
                           max_messages(config), video_fetcher)


def _start_loading() -> None:
    slot = engine_slot()
    if not slot.ready and not slot.loading and slot.error is None:
        threading.Thread(target=ensure_loaded, name="vlscope-load", daemon=True).start()


def _engine() -> ServingEngine:
    slot = engine_slot()
    if slot.ready:
        return slot.loaded.engine
    if slot.error is not None:
        raise ApiError(503, f"the model failed to load: {slot.error}", "server_error", "model_unavailable", 30)
    _start_loading()
    raise ApiError(503, "the model is loading; try again shortly", "server_error", "model_loading", 10)


def _engine_error(exc: VlscopeError) -> ApiError:
    if isinstance(exc, Busy):
        error = ApiError(429, exc.message, "rate_limit_error", "busy", retry_after=5)
    elif isinstance(exc, Cancelled):  # the client went away: nobody reads this
        error = ApiError(499, exc.message, code=exc.kind)
    elif isinstance(exc, (InvalidImage, InvalidVideo, InvalidPrompt, InvalidSchema, PromptTooLong)):
        error = ApiError(400, exc.message, "invalid_request_error", exc.kind, param=exc.about)
    elif isinstance(exc, InsufficientMemory):
        error = ApiError(503, exc.message, "server_error", exc.kind, retry_after=30)
    else:
        error = ApiError(500, exc.message, "server_error", exc.kind)
    error.recorded = exc.metrics is not None
    return error


async def _read_json(request: Request) -> dict:
    body = await read_body(request.headers, request.stream(), server_settings(), engine_slot().config)
    try:
        # Off the event loop: parsing a body near the limit takes long enough to stall every other connection.
        return await anyio.to_thread.run_sync(json.loads, body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:  # JSON nested thousands of levels deep
        raise ApiError(400, "the request body is nested too deeply") from None


class ClientWatch:
    """Whether _events should poll the connection itself. Off once a StreamingResponse runs: that one listens for
    the disconnect itself (and cancels the stream), and two readers of the connection would steal its messages."""

    def __init__(self):
        self.active = True


async def _events(handle, request: Request, watch: ClientWatch | None = None):
    """The request's engine events, without blocking the event loop; a client that goes away cancels it.

    The client is checked every POLL_S seconds even while tokens flow: a non-streaming client that gave up
    would otherwise keep the CPU busy until its answer was complete."""
    watch = watch or ClientWatch()
    try:
        checked = time.monotonic()
        while True:
            event = await anyio.to_thread.run_sync(handle.next_event, POLL_S)
            if watch.active and (event is None or time.monotonic() - checked >= POLL_S):
                checked = time.monotonic()
                if await request.is_disconnected():
                    log.info("client of request %s went away: cancelling it", handle.id)
                    handle.cancel()
                    return
            if event is None:
                continue
            yield event
            if isinstance(event, RequestMetrics):
                return
    finally:
        handle.cancel()  # no-op once finished; stops generation if the client left mid-stream


def served_name(engine: ServingEngine) -> str:
    return served_model_name(engine.model_name, engine.config.served_model_name)


def _unknown_model(asked: str, name: str) -> ApiError:
    shown = asked if len(asked) <= 100 else asked[:100] + "…"
    return ApiError(404, f"The model {shown!r} does not exist; this server serves {name!r}.",
                    code="model_not_found", param="model")


def _check_model(engine, body: dict) -> str:
    name = served_name(engine)
    asked = body.get("model")
    if asked is not None and asked != name and not engine.config.api_any_model:
        raise _unknown_model(asked, name)
    return name


@dataclass
class ChatCall:
    """A parsed /v1/chat/completions call: what to run and how to answer it."""
    engine: ServingEngine
    chat: ChatRequest
    model: str  # the name the answer carries
    stream: bool
    include_usage: bool
    token_text: Callable[[int], str] | None  # how a token id reads, for logprobs; None when none were asked

    @property
    def tool_names(self) -> frozenset[str] | None:
        """The functions whose calls are read out of the answer; None when calls are not looked for."""
        chat = self.chat
        return frozenset(tool.name for tool in chat.tools) if chat.tools and chat.tool_choice != "none" else None

    @property
    def max_calls(self) -> int | None:
        return None if self.chat.parallel_tool_calls else 1


async def chat_completions(request: Request) -> Response:
    try:
        call = await _parse(request)
        handle = await _submit(call, request)
        return await (_emit_stream if call.stream else _emit_completion)(call, handle, request)
    except ApiError as error:
        return await refuse(error)


async def _parse(request: Request) -> ChatCall:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the request body as JSON, with Content-Type: application/json",
                       code="unsupported_media_type")
    body = await _read_json(request)
    engine = _engine()
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _check_model(engine, body)
    stream, include_usage = stream_settings(body)
    chat = await anyio.to_thread.run_sync(_request_from_body, body, engine, limiter=FETCH_LIMITER)
    return ChatCall(engine, chat, model, stream, include_usage, _token_text(engine, chat))


async def _submit(call: ChatCall, request: Request) -> RequestHandle:
    """The request taken in off the event loop; a client that goes away meanwhile (a clip's frames are decoded
    there) cancels it."""
    cancelled = threading.Event()

    async def watch() -> None:
        while not await request.is_disconnected():
            await anyio.sleep(POLL_S)
        cancelled.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch)
        try:
            return await anyio.to_thread.run_sync(call.engine.submit, call.chat, cancelled)
        except VlscopeError as exc:
            error = _engine_error(exc)
        finally:
            tasks.cancel_scope.cancel()
    raise error


async def _emit_stream(call: ChatCall, handle: RequestHandle, request: Request) -> Response:
    watch = ClientWatch()
    events = _events(handle, request, watch)
    # Hold the 200 until the prompt has passed the engine's checks, so a too-long prompt is a plain 400.
    early = []
    try:
        async for event in events:
            early.append(event)
            if isinstance(event, (TextChunk, RequestMetrics)) or (
                    isinstance(event, StageStarted) and event.name in (VISION_ENCODE, PREFILL)):
                break
    except VlscopeError as exc:
        raise _engine_error(exc) from None
    watch.active = False
    return StreamingResponse(_sse(handle, early, events, call.model, call.include_usage, call.token_text,
                                  call.tool_names, call.max_calls),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _emit_completion(call: ChatCall, handle: RequestHandle, request: Request) -> Response:
    parts, metrics, logprobs = [], None, []
    try:
        async for event in _events(handle, request):
            if isinstance(event, TextChunk):
                parts.append(event.text)
                logprobs += event.logprobs
            elif isinstance(event, RequestMetrics):
                metrics = event
    except VlscopeError as exc:
        raise _engine_error(exc) from None
    if metrics is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    text, calls = "".join(parts), []
    if call.tool_names is not None:
        text, calls = split_calls(text, call.tool_names, call.max_calls)
    return JSONResponse(completion(call.model, text, metrics,
                                   logprobs_content(logprobs, call.token_text) if call.token_text else None,
                                   [parsed.as_openai() for parsed in calls]))


async def _chain(first: list, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item


def _token_text(engine: ServingEngine, chat: ChatRequest) -> Callable[[int], str] | None:
    """How a token id reads, for logprobs; None when the request asked for none. A remote engine cannot give them."""
    if chat.top_logprobs is None:
        return None
    if not engine.serves_logprobs:
        raise ApiError(400, "logprobs are not available through a remote backend", code="unsupported_parameter",
                       param="logprobs")
    return engine.token_text


async def _sse(handle, early: list, events, model: str, include_usage: bool, token_text=None,
               tool_names: frozenset[str] | None = None, max_calls: int | None = None):
    def event(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    created = int(time.time())  # the same in every chunk of one answer
    parser = ToolCallParser(tool_names, max_calls) if tool_names is not None else None
    held_logprobs: list = []  # of text the parser holds back: they ride on the next chunk sent

    def pieces(text: str, logprobs, last: bool = False):
        """The chunks a piece of answer text makes: content, and with tools, the calls read out of it."""
        held_logprobs.extend(logprobs)
        found = [text] if parser is None else parser.feed(text) + (parser.finish() if last else [])
        for piece in found:
            if isinstance(piece, CallArguments) and not piece.text:
                continue
            delta = {"content": piece} if isinstance(piece, str) else {"tool_calls": [piece.delta()]}
            shown = logprobs_content(held_logprobs, token_text) if token_text else None
            held_logprobs.clear()
            yield event(chunk(handle.id, model, created, delta, logprobs=shown))

    yield event(chunk(handle.id, model, created, {"role": "assistant", "content": ""}))
    try:
        async for item in _chain(early, events):
            if isinstance(item, TextChunk):
                for line in pieces(item.text, item.logprobs):
                    yield line
            elif isinstance(item, RequestMetrics):
                for line in pieces("", (), last=True):
                    yield line
                # vlscope's stage timings ride on the last choice chunk (clients ignore fields they do not know);
                # usage comes only when asked, in a chunk of its own with no choices, as OpenAI sends it.
                called = parser is not None and bool(parser.calls)
                yield event(chunk(handle.id, model, created, {}, finish_reason(item, called),
                                  flag=schema_flag(item), metrics=public_metrics(item)))
                if include_usage:
                    yield event(chunk(handle.id, model, created, None, usage=usage(item)))
    except VlscopeError as exc:
        yield event(_engine_error(exc).body())
    except asyncio.CancelledError:  # client disconnected: _events' finally has cancelled the request
        raise
    yield "data: [DONE]\n\n"


def _model_name() -> str:
    slot = engine_slot()
    if slot.ready:
        return served_name(slot.loaded.engine)
    return served_model_name(slot.config.remote_model or slot.config.model, slot.config.served_model_name)


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [model_entry(_model_name(), STARTED)]})


async def model(request: Request) -> Response:
    try:
        name, asked = _model_name(), request.path_params["model"]
        if asked != name:
            raise _unknown_model(asked, name)
    except ApiError as error:
        return await refuse(error)
    return JSONResponse(model_entry(name, STARTED))


async def not_found(request: Request) -> Response:
    return await refuse(ApiError(404, f"Unknown API route {request.url.path}: this server serves "
                                        "/v1/chat/completions and /v1/models.", code="unknown_url"))


async def method_not_allowed(request: Request) -> Response:
    return await refuse(ApiError(405, f"{request.method} is not allowed on {request.url.path}.",
                                   code="method_not_allowed"))


def health_state() -> tuple[int, dict]:
    """The server's health: its status code and the full body (the model, queue, load error)."""
    slot = engine_slot()
    if slot.ready:
        engine = slot.loaded.engine
        return 200, {"status": "ready", "model": served_name(engine), "synthetic": engine.info.synthetic,
                     "dtype": engine.info.dtype, "queue_depth": engine.queue_depth}
    if slot.error is not None:
        return 503, {"status": "error", "error": slot.error, "queue_depth": 0}
    _start_loading()
    return 503, {"status": "loading", "queue_depth": 0}


async def health(request: Request) -> Response:
    """Liveness for anyone; with API keys set, the details (model, queue, load error) only for a valid key."""
    status, body = health_state()
    details = authorized(request.headers, server_settings().api_keys)
    return JSONResponse(body if details else {"status": body["status"]}, status_code=status)


def metrics_text() -> str:
    """This process's metrics in Prometheus' text format (blocking: it reads the records written since the last)."""
    slot = engine_slot()
    engine = slot.loaded.engine if slot.ready else None
    return prometheus.render(
        get_store(), engine.queue_depth if engine else 0, engine.info.weight_bytes if engine else 0, engine is not None,
        engine.active_sequences if engine else 0, engine.batch_limit() if engine else 0, refusals.tally.counts())


async def metrics(request: Request) -> Response:
    text = await anyio.to_thread.run_sync(metrics_text)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/chat/completions", method_not_allowed, methods=["GET", "PUT", "PATCH", "DELETE"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
    Route("/v1/models", method_not_allowed, methods=["POST", "PUT", "PATCH", "DELETE"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    # Last: any other /v1 path is a JSON 404, never the app's HTML page (which a client would take as an answer).
    Route("/v1/{path:path}", not_found, methods=ALL_METHODS),
]

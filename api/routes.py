"""Starlette routes of the OpenAI-compatible API. They share the UI's engine: one model in memory per process."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import (Busy, InsufficientMemory, InvalidImage, PromptTooLong, RequestMetrics, StageStarted, TextChunk,
                    VlscopeError)
from ui.engine_resource import engine_slot, ensure_loaded, get_store

from . import prometheus
from .openai_format import ApiError, chunk, completion, finish_reason, public_metrics, to_chat_request, usage

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting handler checks that its client is still there


def _api_keys() -> set[str]:
    return {k.strip() for k in os.environ.get("VLSCOPE_API_KEYS", "").split(",") if k.strip()}


def _allowed_hosts() -> frozenset[str]:
    return frozenset(h.strip() for h in os.environ.get("VLSCOPE_API_IMAGE_HOSTS", "").split(",") if h.strip())


def _max_body() -> int:
    return int(os.environ.get("VLSCOPE_API_MAX_BODY_BYTES", str(64 * 1024 * 1024)))


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _check_key(request: Request) -> None:
    keys = _api_keys()
    if not keys:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if not any(hmac.compare_digest(token, key) for key in keys):
        raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", "authentication_error",
                       "invalid_api_key")


def _start_loading() -> None:
    slot = engine_slot()
    if not slot.ready and not slot.loading and slot.error is None:
        threading.Thread(target=ensure_loaded, name="vlscope-load", daemon=True).start()


def _engine():
    slot = engine_slot()
    if slot.ready:
        return slot.loaded.engine
    if slot.error is not None:
        raise ApiError(503, f"the model failed to load: {slot.error}", "server_error", "model_unavailable", 30)
    _start_loading()
    raise ApiError(503, "the model is loading; try again shortly", "server_error", "model_loading", 10)


def _engine_error(exc: VlscopeError) -> ApiError:
    if isinstance(exc, Busy):
        return ApiError(429, exc.message, "rate_limit_error", "busy", retry_after=5)
    if isinstance(exc, (InvalidImage, PromptTooLong)):
        return ApiError(400, exc.message, "invalid_request_error", exc.kind)
    if isinstance(exc, InsufficientMemory):
        return ApiError(503, exc.message, "server_error", exc.kind, retry_after=30)
    return ApiError(500, exc.message, "server_error", exc.kind)


async def _read_json(request: Request) -> dict:
    limit = _max_body()
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over the {limit // 1_000_000} MB limit", code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the {limit // 1_000_000} MB limit", code="body_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


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


async def chat_completions(request: Request) -> Response:
    try:
        _check_key(request)
        body = await _read_json(request)
        engine = _engine()
        chat = to_chat_request(body, _allowed_hosts(), engine.config.max_image_bytes, 8192)
        try:
            handle = await anyio.to_thread.run_sync(engine.submit, chat)
        except VlscopeError as exc:
            raise _engine_error(exc) from None
        model = engine.info.model
        if body.get("stream"):
            watch = ClientWatch()
            events = _events(handle, request, watch)
            # Hold the 200 until the prompt has passed the engine's checks, so a too-long prompt is a plain 400.
            early = []
            try:
                async for event in events:
                    early.append(event)
                    if isinstance(event, (TextChunk, RequestMetrics)) or (
                            isinstance(event, StageStarted) and event.name in ("vision_encode", "prefill")):
                        break
            except VlscopeError as exc:
                raise _engine_error(exc) from None
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", True))
            watch.active = False
            return StreamingResponse(_sse(handle, early, events, model, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts, metrics = [], None
        try:
            async for event in _events(handle, request):
                if isinstance(event, TextChunk):
                    parts.append(event.text)
                elif isinstance(event, RequestMetrics):
                    metrics = event
        except VlscopeError as exc:
            raise _engine_error(exc) from None
        if metrics is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(completion(model, "".join(parts), metrics))
    except ApiError as error:
        return error_response(error)


async def _chain(first: list, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _sse(handle, early: list, events, model: str, include_usage: bool):
    def event(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    yield event(chunk(handle.id, model, {"role": "assistant", "content": ""}))
    try:
        async for item in _chain(early, events):
            if isinstance(item, TextChunk):
                yield event(chunk(handle.id, model, {"content": item.text}))
            elif isinstance(item, RequestMetrics):
                extra = {"usage": usage(item), "metrics": public_metrics(item)} if include_usage else {}
                yield event(chunk(handle.id, model, {}, finish_reason(item), **extra))
    except VlscopeError as exc:
        yield event(_engine_error(exc).body())
    except asyncio.CancelledError:  # client disconnected: _events' finally has cancelled the request
        raise
    yield "data: [DONE]\n\n"


async def models(request: Request) -> Response:
    try:
        _check_key(request)
    except ApiError as error:
        return error_response(error)
    slot = engine_slot()
    name = slot.loaded.engine.info.model if slot.ready else slot.config.model
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vlscope"}]})


async def health(request: Request) -> Response:
    slot = engine_slot()
    if slot.ready:
        engine = slot.loaded.engine
        return JSONResponse({"status": "ready", "model": engine.info.model, "synthetic": engine.info.synthetic,
                             "dtype": engine.info.dtype, "queue_depth": engine.queue_depth})
    if slot.error is not None:
        return JSONResponse({"status": "error", "error": slot.error, "queue_depth": 0}, status_code=503)
    _start_loading()
    return JSONResponse({"status": "loading", "queue_depth": 0}, status_code=503)


async def metrics(request: Request) -> Response:
    slot = engine_slot()
    engine = slot.loaded.engine if slot.ready else None
    text = await anyio.to_thread.run_sync(lambda: prometheus.render(
        get_store(), engine.queue_depth if engine else 0, engine.info.weight_bytes if engine else 0, engine is not None))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]

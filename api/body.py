"""A request body, read and checked as the single server and a cluster's front both read it: bounded by size and
time, and refused by its shape before anything parses it."""
from __future__ import annotations

from typing import AsyncIterator, Mapping

import anyio

from engine.config import EngineConfig
from server.settings import ServerSettings

from .errors import ApiError

MAX_JSON_CONTAINERS = 200_000  # objects and arrays: above the text limit's characters plus a request's structure


def body_limit(server: ServerSettings, config: EngineConfig) -> int:
    """VLSCOPE_API_MAX_BODY_BYTES, else the body an allowed request can need: one image at the byte limit,
    base64-encoded, and 1 MiB for the rest (no text over the prompt limit's characters gets that far)."""
    return server.api_max_body_bytes or config.max_image_bytes * 4 // 3 + 4 + (1 << 20)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the {limit // 1_000_000} MB limit", code="body_too_large")


async def read_body(headers: Mapping[str, str], parts: AsyncIterator[bytes], server: ServerSettings,
                    config: EngineConfig) -> bytes:
    """The whole body from `parts`, refused at once when its declared length is over the limit, as soon as what
    arrived is, when it has not all arrived in VLSCOPE_API_BODY_SECONDS, and when its shape is hostile (check_shape)."""
    limit = body_limit(server, config)
    declared = headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    with anyio.move_on_after(server.api_body_seconds) as deadline:
        async for part in parts:
            body += part
            if len(body) > limit:
                raise _too_large(limit)
    if deadline.cancelled_caught:  # a client trickling its body holds a connection and a buffer for nothing
        raise ApiError(408, f"the request body did not arrive within {server.api_body_seconds:g} s",
                       code="body_timeout")
    check_shape(body, config)
    return bytes(body)


def check_shape(body: bytes | bytearray, config: EngineConfig) -> None:
    """Parsing holds the interpreter, and with it every connection, for as long as it takes: a body of millions of
    empty objects, or of far more pictures than a request may carry, is refused from byte counts first (counted in
    C, milliseconds for the largest body)."""
    containers = body.count(b"{") + body.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        raise ApiError(400, f"the request body holds {containers:,} JSON objects and arrays, over the "
                            f"{MAX_JSON_CONTAINERS:,} a request can need", code="body_too_complex")
    # Each image part names "image_url" twice.
    if body.count(b"image_url") + body.count(b'"file"') > 4 * config.max_images + 64:
        raise ApiError(400, f"the request body carries far more than the {config.max_images} images a request may",
                       code="too_many_images", param="messages")

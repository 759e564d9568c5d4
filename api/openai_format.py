"""OpenAI chat-completions requests to engine requests, and engine results back to OpenAI's response shapes."""
from __future__ import annotations

import base64
import binascii
import time
import urllib.request
from urllib.parse import urlparse

from engine import ChatRequest, RequestMetrics, Turn


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error type; the message is shown to the client as it is."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code, self.retry_after = (
            status, message, error_type, code, retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": None, "code": self.code}}


def image_bytes(url: str, allowed_hosts: frozenset[str], max_bytes: int) -> bytes:
    """A data: URL's bytes; an http(s) URL only from an allowed host. Nothing else is read: an API that opens
    any path or URL it is given discloses the server's files and reaches its network."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, "image data URLs must be base64 encoded (data:image/png;base64,...)", code="invalid_image")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data URL is not valid base64", code="invalid_image") from None
        if len(data) > max_bytes:
            raise ApiError(413, f"an image is over the {max_bytes // 1_000_000} MB limit", code="image_too_large")
        return data
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if parsed.hostname not in allowed_hosts:
            raise ApiError(400, "remote image URLs are refused: send the image as a data: URL, or allow its host "
                                "in VLSCOPE_API_IMAGE_HOSTS", code="image_url_not_allowed")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - host checked above
                data = response.read(max_bytes + 1)
        except OSError as exc:
            raise ApiError(400, f"could not fetch the image: {exc}", code="invalid_image") from None
        if len(data) > max_bytes:
            raise ApiError(413, f"an image is over the {max_bytes // 1_000_000} MB limit", code="image_too_large")
        return data
    raise ApiError(400, "image_url must be a data: URL (file paths are never read)", code="image_url_not_allowed")


def _content(content, allowed_hosts, max_image_bytes) -> tuple[str, tuple[bytes, ...]]:
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise ApiError(400, "message content must be a string or a list of parts")
    texts, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            source = part.get("image_url")
            url = source.get("url") if isinstance(source, dict) else source
            if not isinstance(url, str):
                raise ApiError(400, "image_url parts need an image_url.url string")
            images.append(image_bytes(url, allowed_hosts, max_image_bytes))
        else:
            raise ApiError(400, f"unsupported content part {kind!r}: use text and image_url parts")
    return "\n".join(texts), tuple(images)


def _number(body: dict, name: str, kind, low, high, inclusive_low=True):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be a {kind.__name__}")
    if value < low or value > high or (not inclusive_low and value == low):
        raise ApiError(400, f"{name} must be between {low} and {high}")
    return kind(value)


def to_chat_request(body: dict, allowed_hosts: frozenset[str], max_image_bytes: int, max_tokens_cap: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    parsed = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, "each message needs a role of system, user or assistant")
        text, images = _content(message.get("content", ""), allowed_hosts, max_image_bytes)
        if images and message["role"] != "user":
            raise ApiError(400, "only user messages may carry images")
        parsed.append((message["role"], text, images))
    role, prompt, images = parsed[-1]
    if role != "user":
        raise ApiError(400, "the last message must come from the user")
    max_tokens = _number(body, "max_completion_tokens", int, 1, max_tokens_cap)
    max_tokens = max_tokens or _number(body, "max_tokens", int, 1, max_tokens_cap)
    return ChatRequest(
        prompt=prompt, images=images, history=tuple(Turn(r, t, i) for r, t, i in parsed[:-1]),
        max_new_tokens=max_tokens, temperature=_number(body, "temperature", float, 0, 2),
        top_p=_number(body, "top_p", float, 0, 1, inclusive_low=False), source="api",
        ignore_eos=bool(body.get("ignore_eos", False)),  # vLLM's extension, for fixed-length benchmarks
    )


def finish_reason(metrics: RequestMetrics) -> str:
    return "length" if metrics.output_tokens >= metrics.max_new_tokens else "stop"


def usage(metrics: RequestMetrics) -> dict:
    return {"prompt_tokens": metrics.prompt_tokens, "completion_tokens": metrics.output_tokens,
            "total_tokens": metrics.prompt_tokens + metrics.output_tokens}


def public_metrics(metrics: RequestMetrics) -> dict:
    """The stage timings a client may see: no prompt or answer text, which the record may hold."""
    record = metrics.to_dict()
    record.pop("prompt", None)
    record.pop("answer", None)
    return record


def completion(model: str, text: str, metrics: RequestMetrics) -> dict:
    return {
        "id": f"chatcmpl-{metrics.id}", "object": "chat.completion", "created": int(metrics.submitted_at),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": finish_reason(metrics)}],
        "usage": usage(metrics), "metrics": public_metrics(metrics),
    }


def chunk(request_id: str, model: str, delta: dict, finish: str | None = None, **extra) -> dict:
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

"""Which conversation a request belongs to, so that its follow-ups go where its prefix is cached."""
from __future__ import annotations

import hashlib
import json

SESSION_HEADER = "x-session-id"
MEDIA_PARTS = ("image_url", "video_url", "file")


def _first_media(messages) -> str | None:
    """The URL (a data: URL holds the bytes) of the first picture, clip or file of the first user message with one."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") not in MEDIA_PARTS:
                continue
            value = part.get(part["type"])
            url = value.get("url") or value.get("file_data") if isinstance(value, dict) else value
            if isinstance(url, str) and url:
                return url
    return None


def _first_text(messages) -> str | None:
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return None


def conversation_key(headers: dict[str, str], body: bytes) -> str | None:
    """The client's session header, else the body's `user`, else the first picture (or, with none, the first user
    message): a follow-up repeats its conversation's start, so it gives the same key. None for a body that is not a
    chat request; the replica answers that one with its own error."""
    session = headers.get(SESSION_HEADER)
    if session:
        return "session:" + session
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    if isinstance(parsed.get("user"), str) and parsed["user"]:
        return "user:" + parsed["user"]
    start = _first_media(parsed.get("messages")) or _first_text(parsed.get("messages"))
    return "start:" + hashlib.sha256(start.encode("utf-8", "surrogateescape")).hexdigest() if start else None

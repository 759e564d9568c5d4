"""The chat page's conversation: turns kept in session state, turned into engine requests and a transcript."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from engine import ChatRequest, RequestMetrics, Turn
from engine.inputs.documents import Document
from engine.records.stages import FRAME_DECODE, GRAMMAR, OK, RENDER_PAGES

from .clips import Clip

GIB = 1 << 30

PRESETS = {
    "Describe": "Describe this image in detail.",
    "OCR": "Extract all visible text line by line.",
    "Question": "",
}


# Schemas the Chat page offers for "Answer as JSON", each bounded so that any model's answer ends.
SCHEMA_PRESETS = {
    "Scanned document": {
        "type": "object", "additionalProperties": False,
        "required": ["document_type", "title", "dates", "totals"],
        "properties": {
            "document_type": {"enum": ["invoice", "receipt", "letter", "form", "report", "article", "page", "other"]},
            "title": {"type": "string", "maxLength": 120},
            "dates": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 40}},
            "totals": {"type": "array", "maxItems": 8, "items": {
                "type": "object", "additionalProperties": False, "required": ["label", "amount"],
                "properties": {"label": {"type": "string", "maxLength": 60}, "amount": {"type": "number"},
                               "currency": {"type": "string", "maxLength": 8}}}}}},
    "Picture": {
        "type": "object", "additionalProperties": False, "required": ["subject", "objects", "has_text"],
        "properties": {"subject": {"type": "string", "maxLength": 80},
                       "objects": {"type": "array", "maxItems": 10, "items": {"type": "string", "maxLength": 40}},
                       "has_text": {"type": "boolean"}}},
    "Any JSON object": {"type": "object"},
}


@dataclass
class ChatTurn:
    role: str
    text: str
    # (name, a picture's bytes, a document's pages, or a video Clip): what the turn was about
    images: list[tuple[str, bytes | Document | Clip]] = field(default_factory=list)
    stats: str | None = None
    error: bool = False
    request_id: str | None = None  # an answer's request: a stopped one's stats line comes from its record once written
    as_json: bool = False  # asked for as JSON: shown as a JSON tree when it is complete
    streaming: bool = False  # an answer a script run is still writing
    stopped: bool = False  # an answer stopped before its end: its text so far, marked

    def end_stream(self) -> None:
        """The run writing this answer is over: an answer with neither its cost line nor an error was stopped."""
        if self.streaming:
            self.streaming, self.stopped = False, not self.stats and not self.error

    @property
    def shown_text(self) -> str:
        return self.text + (" _(stopped)_" if self.stopped else "")


def _identity(data: bytes | Document | Clip) -> bytes:
    if isinstance(data, Document):
        return hashlib.sha256(data.data).digest() + repr(data.pages).encode()
    if isinstance(data, Clip):
        return b"clip" + data.digest
    return hashlib.sha256(data).digest()


def image_digest(images: list[tuple[str, bytes | Document]]) -> str:
    return hashlib.sha256(b"".join(_identity(data) for _, data in images)).hexdigest()


def images_to_attach(turns: list[ChatTurn], current: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The picked images go with the next question only when they differ from the last ones sent:
    follow-ups about the same picture reach it through the history."""
    if not current:
        return []
    sent = [turn.images for turn in turns if turn.role == "user" and turn.images]
    if sent and image_digest(sent[-1]) == image_digest(current):
        return []
    return current


def _pictures_and_clips(attached) -> tuple[tuple, tuple]:
    pictures = tuple(data for _, data in attached if not isinstance(data, Clip))
    return pictures, tuple(data.data for _, data in attached if isinstance(data, Clip))


def build_request(turns: list[ChatTurn], prompt: str, images: list[tuple[str, bytes]], enhance_for_ocr: bool,
                  json_schema: str | None = None, video_fps: float | None = None) -> ChatRequest:
    # Failed turns are left out: the model never answered them.
    history = tuple(Turn(turn.role, turn.text, *_pictures_and_clips(turn.images)) for turn in turns if not turn.error)
    pictures, clips = _pictures_and_clips(images)
    return ChatRequest(prompt=prompt, images=pictures, videos=clips, history=history, video_fps=video_fps,
                       enhance_for_ocr=enhance_for_ocr, source="app", json_schema=json_schema)


def _kind(data) -> str:
    return "PDF" if isinstance(data, Document) else "clip" if isinstance(data, Clip) else "picture"


def attached_words(current: list[tuple[str, object]], turns: list[ChatTurn]) -> str:
    """The chat box's placeholder: what the next question is about (the picked picture, PDF pages or clip)."""
    if not current:
        earlier = any(turn.images for turn in turns if turn.role == "user")
        return "Ask a follow-up" if earlier else "Ask anything (nothing attached)"
    first_name, first = current[0]
    more = f" and {len(current) - 1} more" if len(current) > 1 else ""
    return f"Ask about the {_kind(first)} {first_name}{more}"


def parsed_json(text: str):
    """A complete JSON answer as Python values for st.json; None when it is not one (cut short or stopped)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


MARKDOWN_REACH = re.compile(r"([\[\]<>])")


def inert_markdown(text: str) -> str:
    """Answer text as markdown that reaches nowhere: brackets and angle brackets are escaped, so an image or a link
    an answer writes (`![t](http://host/track.png)`) shows as text instead of making every viewer's browser fetch
    it, and no HTML tag forms. Per character, so stream chunks can be escaped one by one."""
    return MARKDOWN_REACH.sub(r"\\\1", text)


def stats_line(metrics: RequestMetrics) -> str:
    parts = []
    if metrics.ttft_s is not None:
        parts.append(f"TTFT {metrics.ttft_s:.2f} s")
    if metrics.decode_tokens_per_s:
        parts.append(f"{metrics.decode_tokens_per_s:.1f} tok/s")
    parts.append(f"total {metrics.e2e_s:.1f} s")
    parts.append(f"{metrics.vision_tokens} vision tokens")
    if GRAMMAR in metrics.stages:
        parts.append(f"grammar {metrics.stages[GRAMMAR] * 1000:.0f} ms")
    if RENDER_PAGES in metrics.stages:
        parts.append(f"{len(metrics.document_pages)} pages rendered in {metrics.stages[RENDER_PAGES]:.2f} s")
    if FRAME_DECODE in metrics.stages:
        parts.append(f"frames decoded in {metrics.stages[FRAME_DECODE]:.2f} s")
    parts.append(f"peak RSS {metrics.rss_peak_bytes / GIB:.2f} GiB")
    if metrics.status != OK:
        parts.append(metrics.status)
    return " · ".join(parts)


def transcript(turns: list[ChatTurn]) -> str:
    lines = ["# vlscope conversation", ""]
    for turn in turns:
        lines.append(f"**{turn.role}**" + (f" (images: {', '.join(name for name, _ in turn.images)})" if turn.images else ""))
        lines.append("")
        lines.append(turn.shown_text)
        if turn.stats:
            lines += ["", f"_{turn.stats}_"]
        lines.append("")
    return "\n".join(lines)

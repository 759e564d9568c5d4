"""The model's own tool calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in its answer
(Qwen's Hermes-style format), read out of the text as it streams: text outside them is content, each block that
parses to an offered function is a call, and a block that does not parse stays text."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self, with_index: bool = False) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **call} if with_index else call


@dataclass
class ToolCallParser:
    """Feed it the answer's text piece by piece; each `feed` returns what may be shown now: content text and calls.
    Text that might be the start of a block is held until the next pieces tell."""

    names: frozenset[str]
    max_calls: int | None = None  # 1 when parallel_tool_calls is false: later blocks stay text
    calls: list[ParsedCall] = field(default_factory=list)
    _pending: str = ""
    _inside: bool = False
    _held_space: str = ""  # whitespace between calls is not content unless more content follows

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._pending += text
        out: list[str | ParsedCall] = []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._inside = False
                call = self._call(body)
                if call is None:
                    out += self._content(OPEN + body + CLOSE)
                else:
                    self._held_space = ""
                    out.append(call)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                out += self._content(self._pending[:start])
                self._pending, self._inside = self._pending[start + len(OPEN):], True
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                         if self._pending.endswith(OPEN[:k])), 0)
            out += self._content(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> list[str | ParsedCall]:
        """The answer ended: an unfinished block and any held text are content."""
        rest = (OPEN if self._inside else "") + self._pending
        self._pending, self._inside = "", False
        out = self._content(rest)
        if not self.calls and self._held_space:
            out.append(self._held_space)
        self._held_space = ""
        return out

    def _content(self, text: str) -> list[str]:
        if not text:
            return []
        if not text.strip():
            self._held_space += text
            return []
        text, self._held_space = self._held_space + text, ""
        return [text]

    def _call(self, body: str) -> ParsedCall | None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        if not isinstance(parsed, dict) or parsed.get("name") not in self.names:
            return None
        arguments = parsed.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        call = ParsedCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", parsed["name"],
                          json.dumps(arguments, ensure_ascii=False))
        self.calls.append(call)
        return call


def split_calls(text: str, names: frozenset[str], max_calls: int | None = None) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content (None when it is calls alone) and calls."""
    parser = ToolCallParser(names, max_calls)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    return (content.strip() or None) if parser.calls else content, parser.calls

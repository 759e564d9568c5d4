"""The model's own tool calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in its answer
(Qwen's Hermes-style format): written for calls a remote server returns, and read out of the text as it streams:
text outside them is content, each block that names an offered function is a call whose arguments stream as they
come, and a block that does not stays text. A block the answer ends inside (cut by max_tokens) is the call so far, as
OpenAI gives a cut call, never markup shown as content."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a block as the model (and the grammar that holds it) writes it: the name, then the arguments so far.
CALL_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """A call read out of the answer. Streamed, it is first announced with the arguments read so far (none), and
    its arguments follow as CallArguments; `ToolCallParser.calls` holds it whole."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self) -> dict:
        """The call's first streamed delta, as OpenAI sends it: id, type and name, with empty arguments."""
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}


@dataclass(frozen=True)
class CallArguments:
    """More of a streamed call's arguments: a client appends them to what the call's earlier deltas carried."""

    index: int
    text: str

    def delta(self) -> dict:
        return {"index": self.index, "function": {"arguments": self.text}}


Piece = Union[str, ParsedCall, CallArguments]


@dataclass
class ToolCallParser:
    """Feed it the answer's text piece by piece; each `feed` returns what may be shown now: content text, calls as
    they open, and their arguments as they come. Text that might be the start of a block is held until the next
    pieces tell; a block is a call once it names an offered function and opens its arguments' object (as the
    grammar that holds a call writes it), and its arguments stream from there."""

    names: frozenset[str]
    max_calls: int | None = None  # 1 when parallel_tool_calls is false: later blocks stay text
    calls: list[ParsedCall] = field(default_factory=list)
    _pending: str = ""
    _inside: bool = False
    _open: ParsedCall | None = None  # the call whose arguments are streaming
    _sent: int = 0  # characters of its arguments sent
    _held_space: str = ""  # whitespace between calls is not content unless more content follows

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out + self._stream_arguments()
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._inside = False
                if self._open is not None:
                    out += self._close_open(_arguments_of(body))
                    continue
                call = self._call(body)
                if call is None:
                    out += self._content(OPEN + body + CLOSE)
                else:
                    self._held_space = ""
                    out += [call, CallArguments(call.index, call.arguments)]
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

    def finish(self) -> list[Piece]:
        """The answer ended: held text is content; an unfinished block is the call so far when its function is known
        (named in it, or the only one offered), else nothing."""
        if self._inside:
            body, self._pending, self._inside = self._pending, "", False
            if self._open is not None:
                so_far = CALL_SO_FAR.match(body)
                return self._close_open(so_far.group(2) if so_far else "")
            cut = self._cut_call(body)
            return [cut, CallArguments(cut.index, cut.arguments)] if cut is not None else []
        rest, self._pending = self._pending, ""
        out = self._content(rest)
        if not self.calls and self._held_space:
            out.append(self._held_space)
        self._held_space = ""
        return out

    def _stream_arguments(self) -> list[Piece]:
        """Inside a block: the call announced once its name and the start of its arguments' object are read, then
        its arguments up to what could still be the block's end (the wrapper's `}`, the line break, `</tool_call>`)."""
        so_far = CALL_SO_FAR.match(self._pending)
        out: list[Piece] = []
        if self._open is None:
            if so_far is None or not so_far.group(2).lstrip().startswith("{") or so_far.group(1) not in self.names \
                    or (self.max_calls is not None and len(self.calls) >= self.max_calls):
                return out
            self._open, self._sent = self._new_call(so_far.group(1), ""), 0
            self._held_space = ""
            out.append(self._open)
        arguments = so_far.group(2)
        keep = next((k for k in range(min(len(CLOSE) - 1, len(arguments)), 0, -1) if arguments.endswith(CLOSE[:k])), 0)
        shown = arguments[:len(arguments) - keep].rstrip()
        shown = shown[:-1] if shown.endswith("}") else shown
        if len(shown) > self._sent:
            out.append(CallArguments(self._open.index, shown[self._sent:]))
            self._sent = len(shown)
        return out

    def _close_open(self, arguments: str) -> list[Piece]:
        """The streaming call's block ended (or the answer did): the rest of its arguments, and the call whole."""
        call, self._open = self._open, None
        self.calls[call.index] = dataclasses.replace(call, arguments=arguments)
        return [CallArguments(call.index, arguments[self._sent:])] if len(arguments) > self._sent else []

    def _content(self, text: str) -> list[str]:
        if not text:
            return []
        if not text.strip():
            self._held_space += text
            return []
        text, self._held_space = self._held_space + text, ""
        return [text]

    def _cut_call(self, body: str) -> ParsedCall | None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        so_far = CALL_SO_FAR.match(body)
        if so_far is not None and so_far.group(1) in self.names:
            return self._new_call(so_far.group(1), so_far.group(2))
        return self._new_call(next(iter(self.names)), "") if len(self.names) == 1 else None

    def _new_call(self, name: str, arguments: str) -> ParsedCall:
        call = ParsedCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name, arguments)
        self.calls.append(call)
        return call

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
        return self._new_call(parsed["name"], json.dumps(arguments, ensure_ascii=False))


def _arguments_of(body: str) -> str:
    """A whole block's arguments: what follows `"arguments": ` up to the wrapper's closing brace."""
    so_far = CALL_SO_FAR.match(body)
    arguments = so_far.group(2).rstrip() if so_far else ""
    return arguments[:-1].rstrip() if arguments.endswith("}") else arguments


def split_calls(text: str, names: frozenset[str], max_calls: int | None = None) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content (None when it is calls alone) and calls."""
    parser = ToolCallParser(names, max_calls)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    return (content.strip() or None) if parser.calls else content, parser.calls


def call_text(name: str, arguments: str, finished: bool = True) -> str:
    """A call written as the model writes its own (a remote server's calls: the answer's text then reads the same,
    local or remote, and its calls are read out of it alike). A cut call (its arguments unfinished) stays an unclosed
    block: the call so far."""
    head = f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": '
    if not finished:
        return head + arguments
    try:
        json.loads(arguments)
    except ValueError:  # as a JSON string, which a reader tries to parse in turn (and keeps as text if it cannot)
        arguments = json.dumps(arguments)
    return f"{head}{arguments}}}\n{CLOSE}"

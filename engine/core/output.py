"""Output processing, one sequence at a time: token ids to streamed text, stop strings, logprobs and the events a
client reads. The runner hands each sequence its sampled token; everything a client sees is decided here."""
from __future__ import annotations

from typing import Callable

from ..request import TextChunk

# A token whose bytes end mid-character waits for the next ones; past this many the text is released as decoded.
MAX_PENDING_TOKENS = 8


class Detokenizer:
    """Turns token ids into text as they arrive, decoding only the tokens since the last complete character (mlx-lm's
    streaming detokenizer, for byte-level BPE): a step costs the same at the 500th token as at the first. A partial
    UTF-8 character is held back until the tokens that complete it arrive."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._pending: list[int] = []

    def push(self, token: int) -> str:
        self._pending.append(token)
        piece = self.tokenizer.decode(self._pending, skip_special_tokens=True)
        if piece.endswith("\ufffd") and len(self._pending) < MAX_PENDING_TOKENS:
            return ""
        self._pending = []
        self.text += piece
        return piece


class StopStrings:
    """Cuts an answer before the first of its stop strings. Text that might be the start of one is held back until
    the next tokens tell, so a stop string split across tokens never reaches the client."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stop for stop in stops if stop)
        self.sent = 0  # characters of the answer released so far
        self.hit = False

    def release(self, text: str) -> str:
        """Given the whole answer so far, the part that may be shown now."""
        if self.hit:
            return ""
        if not self.stops:
            return self._advance(text, len(text))
        start = max(0, self.sent - max(len(stop) for stop in self.stops) + 1)
        found = [index for index in (text.find(stop, start) for stop in self.stops) if index >= 0]
        if found:
            self.hit = True
            return self._advance(text, min(found))
        held = 0
        for stop in self.stops:
            held = max(held, next((k for k in range(min(len(stop) - 1, len(text)), 0, -1)
                                   if text.endswith(stop[:k])), 0))
        return self._advance(text, max(self.sent, len(text) - held))

    def flush(self, text: str) -> str:
        """At the end of the answer: whatever was held back (none of it became a stop string)."""
        return "" if self.hit else self._advance(text, len(text))

    def _advance(self, text: str, until: int) -> str:
        new, self.sent = text[self.sent:until], until
        return new


class SequenceOutput:
    """One request's answer as it is sampled: counts tokens, releases text past its stop strings, attaches the
    sampler's logprobs to the chunk of the token they belong to, and emits TextChunk events."""

    def __init__(self, tokenizer, stops: tuple[str, ...], stop_ids: set[int], emit: Callable, logprobs: list):
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = StopStrings(stops)
        self.stop_ids = stop_ids
        self.emit = emit
        self.logprobs = logprobs  # the sampler's list, appended to as it chooses
        self.tokens = 0
        self.shown_logprobs = 0
        self.ended = False  # an end token came (it is not part of the answer)

    def take(self, token: int, complete: bool = False) -> bool:
        """One sampled token; True once the answer is over (an end token, a stop string, or `complete`: its grammar
        allows nothing more, so no step is spent on the end token)."""
        if token in self.stop_ids:
            self.ended = True
            return True
        self.tokens += 1
        self.detokenizer.push(token)
        self._show(self.stops.release(self.detokenizer.text))
        self.ended = complete
        return self.stops.hit or complete

    def finish(self) -> None:
        """The answer is over: release what was held back."""
        self._show(self.stops.flush(self.detokenizer.text))

    @property
    def answer(self) -> str:
        return self.detokenizer.text[:self.stops.sent]

    @property
    def stopped(self) -> bool:
        return self.ended or self.stops.hit

    def _show(self, text: str) -> None:
        logprobs = tuple(self.logprobs[self.shown_logprobs:self.tokens])
        if text or logprobs:
            self.shown_logprobs += len(logprobs)
            self.emit(TextChunk(text, logprobs))

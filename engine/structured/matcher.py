"""One sequence's place in its grammar: before each token is chosen, the tokens the grammar does not allow are ruled
out; the chosen one moves the matcher on. The next mask is computed beside the forward step (`fill_masks`); what
runs on the request's path (the choice among allowed tokens, accepting one) is its grammar stage."""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from ..errors import InvalidSchema
from .compiler import CompiledGrammar, Refusal, subject

_live: weakref.WeakSet = weakref.WeakSet()


def live_matchers() -> int:
    """Sequence matchers not yet freed: a cancelled or finished request leaves none behind."""
    return len(_live)


def fill_masks(grammars: list[GrammarMatcher]) -> None:
    """Each matcher's next mask, on a thread beside the forward step: llguidance lets go of the GIL while it works,
    and the mask then costs the step nothing measurable (docs/decisions.md, "Structured answers")."""
    for grammar in grammars:
        grammar.fill_mask()


class GrammarMatcher:
    def __init__(self, compiled: CompiledGrammar, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        self.matcher = compiled.matcher.deep_copy()
        self.what, self._forget = compiled.what, compiled.forget
        self.check = compiled.check  # what the finished answer is checked against (None: the grammar held it all)
        self.loosened = compiled.loosened
        self.free_text = compiled.free_text
        self.eos_ids = frozenset(eos_ids)
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._ready = False  # the bits hold the mask of the tokens allowed next
        self.seconds = 0.0
        _live.add(self)

    def fill_mask(self) -> None:
        """The mask of the tokens allowed next, ahead of the choice."""
        if not self._ready:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._ready = True

    def allows(self, token: int) -> bool:
        """Whether `token` may come next, checked without the whole mask. End tokens always take the mask (the
        check does not answer for them)."""
        if self._ready:
            return bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)
        started = time.perf_counter()
        allowed = token not in self.eos_ids and self.matcher.validate_tokens([token]) == 1
        self.seconds += time.perf_counter() - started
        return allowed

    def narrow(self, logits: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """The logits to choose among and their token ids. Where the grammar allows few tokens (most steps of JSON),
        just theirs: the choice then costs in proportion to them, not to the vocabulary. Else all of `logits`
        (1-D float32), those it does not allow set to -inf, and ids None."""
        started = time.perf_counter()
        if not self._ready:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():
            raise self._failed()
        words = np.flatnonzero(self._bits)
        if not len(words):
            raise self._failed()
        if len(words) <= len(self._bits) // 8:
            bits = np.unpackbits(self._bits[words].view(np.uint8), bitorder="little").reshape(len(words), 32)
            rows, columns = np.nonzero(bits)
            ids = words[rows] * 32 + columns
            ids = ids[ids < logits.shape[0]]
            narrowed = logits[torch.from_numpy(ids)]
        else:  # in numpy, on one thread: a torch op would wake the compute thread's whole OpenMP team
            banned = np.unpackbits(np.invert(self._bits).view(np.uint8), bitorder="little")[:logits.shape[0]]
            np.copyto(logits.numpy(), -np.inf, where=banned.view(np.bool_))
            narrowed, ids = logits, None
        self.seconds += time.perf_counter() - started
        return narrowed, ids

    def forced(self, most: int) -> list[int]:
        """Up to `most` next tokens, each the only one the grammar allows where it stands (never an end token),
        accepted as they are found: step-by-step decoding would choose each of them whatever the logits."""
        started, tokens = time.perf_counter(), []
        while len(tokens) < most and not self.matcher.is_stopped():
            self.fill_mask()
            words = np.flatnonzero(self._bits)
            if len(words) != 1:
                break
            word = int(self._bits[words[0]]) & 0xFFFFFFFF
            token = int(words[0]) * 32 + word.bit_length() - 1
            if word & (word - 1) or token in self.eos_ids:
                break
            if not self.matcher.consume_token(token):
                raise self._failed()
            self._ready = False
            tokens.append(token)
        self.seconds += time.perf_counter() - started
        return tokens

    def accept(self, token: int) -> None:
        started = time.perf_counter()
        if not self.matcher.consume_token(token):
            raise self._failed()
        self._ready = False
        self.seconds += time.perf_counter() - started

    def _failed(self) -> InvalidSchema:
        """The grammar gave out while the answer was written (llguidance's limits on a step): the answer ends there,
        refused as a schema too complex to hold an answer to, naming the part of the request at fault."""
        error = self.matcher.get_error().splitlines()[0][:200] if self.matcher.is_error() else "no token is allowed"
        refusal = Refusal(f"{subject(self.what)} could not be held while the answer was written ({error}): simplify "
                          "it", "schema_too_complex", "response_format" if self.what == "json_schema" else "tools")
        if self._forget is not None:
            self._forget(refusal)
        return refusal.error()

    @property
    def done(self) -> bool:
        """Nothing but an end token can follow: the document (or the last allowed call) is complete."""
        return self.matcher.is_stopped()

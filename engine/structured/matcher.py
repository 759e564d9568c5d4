"""One sequence's place in its grammar: before each token is chosen, the tokens the grammar does not allow are
masked out of the logits; the chosen one moves the matcher on. Time spent here is the request's grammar stage."""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from ..errors import GenerationFailed
from .compiler import CompiledGrammar

_live: weakref.WeakSet = weakref.WeakSet()


def live_matchers() -> int:
    """Sequence matchers not yet freed: a cancelled or finished request leaves none behind."""
    return len(_live)


class GrammarMatcher:
    def __init__(self, compiled: CompiledGrammar, vocab_size: int):
        self.matcher = compiled.matcher.deep_copy()
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.seconds = 0.0
        _live.add(self)

    def restrict(self, logits: torch.Tensor) -> None:
        """Masks (sets to -inf) every token of `logits` (1-D, vocab) that the grammar does not allow next."""
        started = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:logits.shape[0]]
        logits.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))
        self.seconds += time.perf_counter() - started

    def accept(self, token: int) -> None:
        started = time.perf_counter()
        if not self.matcher.consume_token(token):
            raise GenerationFailed(f"token {token} left the answer's grammar: {self.matcher.get_error()[:200]}")
        self.seconds += time.perf_counter() - started

    @property
    def done(self) -> bool:
        """Nothing but an end token can follow: the document (or the last allowed call) is complete."""
        return self.matcher.is_stopped()

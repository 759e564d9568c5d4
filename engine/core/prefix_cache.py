"""Reuse of earlier requests' KV cache: a follow-up question about the same image skips the vision encoder and
the prefill of everything the conversation already said.

A conversation's next prompt starts with the previous prompt and answer, token for token (the chat template
renders history the same way). Image placeholders are the same token whatever the picture, so a match must
also agree on which images sit there: each entry keeps its images' keys and token spans.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(eq=False)  # entries are told apart by identity: comparing their tensors is neither needed nor valid
class CachedSequence:
    tokens: torch.Tensor  # (1, n): every token whose keys and values are in `cache`
    cache: DynamicCache
    image_keys: tuple[str, ...]  # per image, in order: content hash plus anything that changes its pixels
    image_spans: tuple[tuple[int, int], ...]  # [start, end) of each image's vision tokens


def image_spans(mm_token_type_ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """[start, end) of each run of vision tokens. Images are always separated by text tokens in the template."""
    flags = mm_token_type_ids[0].tolist()
    spans, start = [], None
    for index, flag in enumerate(flags + [0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            spans.append((start, index))
            start = None
    return tuple(spans)


def usable_prefix(entry: CachedSequence, tokens: torch.Tensor, keys: tuple[str, ...],
                  spans: tuple[tuple[int, int], ...]) -> int:
    """How many leading tokens of `tokens` the entry's cache holds correctly: common tokens, cut back to before
    the first image that differs or is only partly covered. At least one token is left to prefill."""
    n = min(entry.tokens.shape[1], tokens.shape[1] - 1)
    if n <= 0:
        return 0
    same = (entry.tokens[0, :n] == tokens[0, :n]).tolist()
    length = same.index(False) if False in same else n
    for index, (start, end) in enumerate(spans):
        if start >= length:
            break
        cached_same_image = index < len(entry.image_keys) and entry.image_keys[index] == keys[index] \
            and entry.image_spans[index] == (start, end)
        if end > length or not cached_same_image:
            return start
    return length


# Below this, copying a prefix's keys and values is not worth it: the template's opening tokens cost nothing to run.
MIN_REUSE_TOKENS = 16


class PrefixCache:
    """A few recent sequences, most recent first. Only the engine's worker thread touches it."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: deque[CachedSequence] = deque()

    def take(self, tokens: torch.Tensor, keys: tuple[str, ...], spans: tuple[tuple[int, int], ...]
             ) -> tuple[CachedSequence | None, int]:
        """The entry sharing the longest prefix, and that length; (None, 0) if none shares enough to help.

        A request that continues an entry to its end takes it over (extended in place, no copy). One that shares
        only part of it gets a copy of that part, and the entry stays for its own conversation: two sessions that
        merely share the chat template's first tokens must not wipe out each other's history."""
        best, best_length = None, 0
        for entry in self._entries:
            length = usable_prefix(entry, tokens, keys, spans)
            if length > best_length:
                best, best_length = entry, length
        if best is None or best_length < MIN_REUSE_TOKENS:
            return None, 0
        if best_length == best.cache.get_seq_length():
            self._entries.remove(best)
            return best, best_length
        cache = DynamicCache([(layer.keys[:, :, :best_length].clone(), layer.values[:, :, :best_length].clone())
                              for layer in best.cache.layers])
        return CachedSequence(best.tokens[:, :best_length], cache, best.image_keys, best.image_spans), best_length

    def put(self, entry: CachedSequence) -> None:
        if self.max_entries <= 0:
            return
        self._entries.appendleft(entry)
        while len(self._entries) > self.max_entries:
            self._entries.pop()

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

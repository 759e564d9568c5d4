"""The model runner: the engine core's one way to the model. It loads the weights and prepares the decode backend
once (decode_backend.py), then encodes a request's pictures in pieces, prefills its prompt (in chunks, or through
the decode step for text), decodes a batch of sequences a token each, and says what keys and values cost.
As vLLM's worker/cpu_model_runner.py."""
from __future__ import annotations

import logging

import torch

from . import decode_backend, draft
from .direct_step import DirectDecodeStep
from .generate import (ChunkedPrefill, DecodeState, VisionEncoding, attach_step, decode_batch, decode_one_token,
                       detach_step, prefill_text)
from ..kernels.quantize import DIRECT_ROWS
from .loading import LoadedModel, load_model
from .memory_pages import back_with_huge_pages, huge_pages_pay

log = logging.getLogger(__name__)
# The most rows one decode step runs when a grammar's forced tokens ride along: up to here the compact kernels'
# small products read each weight once for all rows.
STEP_ROWS = DIRECT_ROWS


class ModelRunner:
    """Built on the compute thread, and used there only."""

    def __init__(self, config, report):
        self.loaded: LoadedModel = load_model(config, progress=report)
        self.decode_step, self.draft_step, self.decode_note, self.step_notes = decode_backend.prepare(
            self.loaded, config, report)
        if huge_pages_pay(self.loaded.weight_bytes):
            report(0.965, "Moving the weights onto huge pages")
            log.info("weights: %.2f GB of the process on huge pages", back_with_huge_pages() / 1e9)

    @property
    def batches(self) -> bool:
        """Whether sequences decode together: the direct decode step runs (without it, transformers' forward, one
        sequence a step)."""
        return self.decode_step is not None

    @property
    def float32_decode_cache(self) -> bool:
        """Whether decode keeps a float32 copy of the keys and values (the memory estimate counts it)."""
        return isinstance(self.decode_step, DirectDecodeStep)

    @property
    def model_config(self):
        return self.loaded.model.config

    def encoding(self, patches) -> VisionEncoding:
        """The pictures' vision encode, run in pieces of a given length (VisionEncoding.run)."""
        return VisionEncoding(self.loaded.model, patches)

    def prefills_in_step(self, vision) -> bool:
        """Whether a prompt with no pictures left to encode goes through the decode step, which prefills text."""
        return self.decode_step is not None and vision is None

    def prefill_text(self, prompt, grids, cache, start: int) -> tuple[torch.Tensor, DecodeState]:
        """The prompt from `start` through the decode step, on `cache` (a reused prefix) where there is one."""
        return prefill_text(self.loaded.model, prompt, grids, self.decode_step, cache=cache, start=start)

    def chunked_prefill(self, prompt, vision, grids, kv_cache: bool, cache, start: int) -> ChunkedPrefill:
        """The prompt with its encoded pictures, prefilled in chunks of a given length (ChunkedPrefill.run)."""
        return ChunkedPrefill(self.loaded.model, prompt, vision, grids, kv_cache, cache=cache, start=start)

    def attach(self, state: DecodeState) -> None:
        """A prefilled sequence handed to the decode step, whose buffers then hold its keys and values."""
        if self.decode_step is not None:
            attach_step(state, self.decode_step)

    def decode(self, states: list[DecodeState], runs: list[list[int]], held: bool = False) -> torch.Tensor:
        """Each sequence its run of tokens further (one token, or a sampled one and those its grammar forces after
        it) in one step: their next logits, row by row. `held`: a sequence of the step follows a grammar, and its
        every step runs as runs do (generate.decode_batch), so forced tokens riding along change none of its
        tokens."""
        if states[0].step is None:  # not on the step (plain kernels, no KV cache): transformers' forward, alone
            (state,), ((token,),) = states, runs
            return decode_one_token(self.loaded.model, state, token)
        return decode_batch(self.decode_step, states, runs, as_runs=held)

    def drafts_for(self, state: DecodeState, drafted: int, kept: int) -> bool:
        """Whether `state` decodes through the step a draft runs beside, and its drafts so far pay."""
        return (self.draft_step is not None and state.step is self.decode_step and state.kv is not None
                and draft.pays(drafted, kept))

    def draft_and_check(self, state: DecodeState, token: int, most: int) -> tuple[list[int], torch.Tensor]:
        """One sequence, up to `most` tokens further in one check: the drafted tokens and the step's logits after
        `token` and after each of them (model/draft.py). `keep` then takes the fed tokens that stay."""
        return draft.draft_and_check(self.decode_step, self.draft_step, state, token, most)

    def keep(self, state: DecodeState, fed: list[int]) -> None:
        """The tokens the last check was fed that stay in the sequence: its first and the drafts accepted."""
        draft.keep(state, fed)

    def detach(self, state: DecodeState) -> None:
        """A finished sequence's keys and values out of the step's buffers, into a cache the prefix cache keeps."""
        detach_step(state)

    def kv_bytes(self, tokens: int) -> int:
        """What `tokens` keys and values take in the decode step's buffers (0 without the step)."""
        return self.decode_step.kv_bytes(tokens) if self.decode_step is not None else 0

    def release(self) -> None:
        """The decode step's weights and compiled code go."""
        step, self.decode_step, drafting, self.draft_step = self.decode_step, None, self.draft_step, None
        for each in (step, drafting):
            if each is not None:
                each.release()

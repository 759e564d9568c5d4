"""A request from queue exit to its first token, as pieces the engine loop runs one per turn, a decode step of the
running answers between each two: preprocess, the memory check, the vision encode (a piece of blocks at a time),
the prefill (in chunks beside running answers), and the first token. Each piece is timed into the request's books;
the time the running answers wait for it goes on their records as paused."""
from __future__ import annotations

import logging
import time

import torch

from ..errors import GenerationFailed, InsufficientMemory, PromptTooLong, VlscopeError
from ..inputs.limits import check_length, check_memory, text_at_fault
from ..inputs.preprocess import image_grids, ocr_pictures, patchify_images, prepare_input
from ..records.metrics import PeakRss
from ..structured.matcher import GrammarMatcher
from ..records.stages import CANCELLED, DECODE, DETOKENIZE, ERROR, OCR_ENHANCE, PREFILL, PREPROCESS, REFUSED, \
    VISION_ENCODE
from .output import SequenceOutput
from .prefix_cache import image_spans
from .request_state import DECODING, FINISHED, Decoding, RequestState
from .sampling import Sampler

log = logging.getLogger(__name__)

# An admission's vision encode yields to the running answers once a piece has run this long: their longest pause is
# about this plus one vision block.
ADMISSION_PIECE_SECONDS = 0.6
# Beside running answers a prefill goes in chunks sized to take about this long each, the first of FIRST_PREFILL_CHUNK
# tokens: a running stream's pause is then a chunk and a decode step (docs/decisions.md).
PREFILL_PIECE_SECONDS = 0.9
FIRST_PREFILL_CHUNK = 32


def chunk_for(tokens: int, seconds: float, target_s: float) -> int:
    """The next prefill chunk's tokens, from the last chunk's `tokens` taking `seconds`: about `target_s` at that
    rate, in multiples of 8, between 8 and 1,024."""
    rate = tokens / max(seconds, 1e-3)
    return max(8, min(1024, int(rate * target_s) // 8 * 8))


class Admission:
    """One request's admission. `advance(running)` runs its next piece on the compute thread, beside the requests
    decoding now (`running`), and returns True once it is over: the request then decodes (`state.decoding` is set)
    or has ended with its record."""

    def __init__(self, core, state: RequestState):
        self.core, self.state, self.trace = core, state, state.trace
        self.rss = PeakRss()
        self.piece = self._preprocess  # the next piece to run
        self.prepared = self.pictures = self.reused = self.patches = self.grids = None
        self.start = 0  # prompt tokens the prefix cache holds
        self.spans: tuple = ()
        self.encoding = None  # the runner's vision encode in pieces, once it began
        self.prefill = None  # the runner's chunked prefill, once it began
        self.chunk = FIRST_PREFILL_CHUNK
        self.chunked = False  # in chunks: it began beside running answers
        self.begun = False

    def advance(self, running: list[RequestState]) -> bool:
        state = self.state
        if not self.begun:  # on record before any compute: if the process dies now, the next start says so
            self.begun = True
            self.trace.start()
            self.rss.start()
        try:
            with torch.inference_mode():
                if state.cancelled.is_set():
                    return self._end(CANCELLED)
                self.piece = self.piece(running)
        except VlscopeError as exc:
            return self._end(REFUSED if isinstance(exc, (PromptTooLong, InsufficientMemory)) else ERROR, exc)
        except Exception as exc:
            log.exception("request %s failed", state.id)
            return self._end(ERROR, GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}"))
        return self.piece is None

    def _end(self, status: str, error: BaseException | None = None) -> bool:
        """The request ended before its first token: its record, with the memory it took so far."""
        self.rss.stop()
        self.trace.rss_bytes = (self.rss.before, self.rss.peak, self.rss.after)
        self.trace.finish(status, error)
        self.state.status = FINISHED
        self.piece = None
        return True

    # ---- the pieces, in order: each returns the next one (None: admitted) ---------------------------------------

    def _preprocess(self, running):
        state, trace, core = self.state, self.trace, self.core
        self.pictures = [image.image for image in state.images]
        if state.request.enhance_for_ocr and self.pictures:
            with trace.stage(OCR_ENHANCE):
                self.pictures = ocr_pictures(state)
        with trace.stage(PREPROCESS):
            self.prepared = prepared = prepare_input(state, self.pictures, core.runner.loaded, core.config)
            trace.resized_sizes, trace.vision_tokens = prepared.picture_sizes, prepared.vision_tokens
            trace.prompt_tokens = prepared.prompt_tokens
            # before any compute: a prompt that cannot fit is refused here, with its counts on record
            check_length(prepared.prompt_tokens, state.params.max_new_tokens, core.config.max_input_tokens,
                         core.info.context_length, text_at_fault(state.request))
        return self._wait_for_memory(running)

    def _wait_for_memory(self, running):
        """Refused (InsufficientMemory) when the request would not fit even alone; while it does not fit only for
        the room the running answers hold, it waits a decode step at a time until they end."""
        core, trace = self.core, self.trace
        try:
            check_memory(core.runner.model_config, self.prepared.sizes, trace.prompt_tokens,
                         self.state.params.max_new_tokens, core.runner.loaded.compute_dtype,
                         core.runner.float32_decode_cache,
                         core.config.memory_limit_bytes, core.reserved_bytes(running))
        except InsufficientMemory:
            if not running:
                raise
            if not self.state.waiting_for_memory:
                self.state.waiting_for_memory = True
                log.info("request %s waits for the running answers' memory", self.state.id)
            return self._wait_for_memory
        return self._look_up_prefix(running)

    def _look_up_prefix(self, running):
        core, config, trace, prepared = self.core, self.core.config, self.trace, self.prepared
        with trace.stage(PREPROCESS):
            prompt = prepared.prompt
            self.spans = image_spans(prompt.mm_token_type_ids)
            reuse = config.kv_cache and self.state.request.reuse_cache
            self.reused, self.start = (core.prefix_cache.take(prompt.input_ids, prepared.keys, self.spans) if reuse
                                       else (None, 0))
            trace.cached_prompt_tokens = self.start
            # Only pictures and pairs of frames after the reused prefix are encoded again.
            fresh = [index for index, (first, _) in enumerate(self.spans) if first >= self.start]
            self.patches = patchify_images(core.runner.loaded.image_processor, [prepared.items[i] for i in fresh],
                                           [prepared.sizes[i] for i in fresh]) if fresh else None
            self.grids = image_grids(prepared.sizes)
        # Preprocessing done: the running streams take a step before the encode (or, without one, the prefill).
        return self._encode if self.patches is not None else self._prefill

    def _encode(self, running):
        trace, started = self.trace, time.perf_counter()
        if self.encoding is None:
            trace.announce(VISION_ENCODE)
            self.encoding = self.core.runner.encoding(self.patches)
        done = self.encoding.run(ADMISSION_PIECE_SECONDS)
        # Timed piece by piece: the steps between them are other requests' time.
        trace.add(VISION_ENCODE, time.perf_counter() - started)
        trace.progress(VISION_ENCODE, self.encoding.next_block, self.encoding.blocks, "blocks")
        return self._prefill if done else self._encode  # encoding done: another step before the prefill

    def _prefill(self, running):
        runner, trace = self.core.runner, self.trace
        prompt, cache = self.prepared.prompt, self.reused.cache if self.reused else None
        vision = self.encoding.result if self.encoding is not None else None
        if runner.prefills_in_step(vision):  # text only from `start`: the step prefills it too
            with trace.stage(PREFILL):
                logits, decode_state = runner.prefill_text(prompt, self.grids, cache, self.start)
            return self._first_token(logits, decode_state)
        if self.prefill is None:
            trace.announce(PREFILL)
            self.prefill = runner.chunked_prefill(prompt, vision, self.grids, self.core.config.kv_cache, cache,
                                                  self.start)
            # Beside running answers the prompt goes in chunks, each followed by their next step, each sized from the
            # last one's rate; alone it goes in one (chunks cost a lone request time: docs/decisions.md).
            self.chunked = bool(running)
        started = time.perf_counter()
        done = self.prefill.run(self.chunk if self.chunked else None,
                                lambda tokens, total: trace.progress(PREFILL, tokens, total, "prompt tokens"))
        took = time.perf_counter() - started
        if not done:
            trace.add(PREFILL, took)
            self.chunk = chunk_for(self.chunk, took, PREFILL_PIECE_SECONDS)
            return self._prefill
        decode_state = self.prefill.state
        runner.attach(decode_state)  # the step's buffers grow: any length fits
        trace.add(PREFILL, time.perf_counter() - started)
        return self._first_token(self.prefill.logits, decode_state)

    def _first_token(self, logits, decode_state):
        core, state, trace, params = self.core, self.state, self.trace, self.state.params
        sampler = Sampler(
            temperature=params.temperature,
            top_p=params.top_p,
            generator=core.generator if params.seed is None else torch.Generator().manual_seed(params.seed),
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias, top_logprobs=params.top_logprobs,
            grammar=(GrammarMatcher(state.grammar, core.runner.loaded.vocab_size, core.runner.loaded.eos_token_ids)
                     if state.grammar is not None else None),
        )
        with trace.stage(PREFILL, announce=False):
            token = sampler(logits)
        stop_ids = set() if params.ignore_eos else set(core.runner.loaded.eos_token_ids)
        output = SequenceOutput(core.runner.loaded.tokenizer, params.stop, stop_ids, state.events.put,
                                sampler.logprobs)
        with trace.stage(DETOKENIZE, announce=False):
            output.take(token, complete=sampler.done)
        trace.first_token()
        self.rss.stop()
        state.decoding = Decoding(decode_state, sampler, output, self.prepared.keys, self.spans, token,
                                  [self.rss.before, self.rss.peak])
        state.status = DECODING
        if output.stopped or output.tokens >= state.params.max_new_tokens or core.jump_forward(state) or \
                state.cancelled.is_set():
            core.finish(state)
        else:
            trace.announce(DECODE)
        return None

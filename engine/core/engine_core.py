"""The engine core: the model runner built once, and `step()`, one turn of the engine loop on the compute thread.

    plan = scheduler.plan()            which admission piece, which requests to step
    admission.advance(running)         the newcomer's next piece (preprocess, encode, prefill, first token)
    runner.decode(running)             every decoding request one token further, in one batched step
    output processing                  each request samples, detokenizes and emits; ended ones get their record
    scheduler.update(plan, ...)        what was admitted and what ended

The scheduler only plans; nothing calls back into the core. As vLLM's v1 EngineCore.step().
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import EngineConfig
from ..errors import GenerationFailed, InvalidSchema, VlscopeError
from ..kernels.memory_read import memory_read_gb_per_s
from ..model.memory_pages import release_freed_memory
from ..model.runner import STEP_ROWS, ModelRunner
from ..records.info import EngineInfo
from ..records.metrics import current_rss
from ..records.stages import CANCELLED, DETOKENIZE, ERROR, GRAMMAR, OK
from ..structured.matcher import fill_masks
from .admission import Admission
from .prefix_cache import CachedSequence, PrefixCache
from .request_state import FINISHED, RequestState
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    """Built on the compute thread; `step()` runs there too. `scheduler` is shared with the client, which submits
    to it from callers' threads."""

    def __init__(self, config: EngineConfig, progress=None):
        report = progress or (lambda fraction, message: None)
        started = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(config, report)
        loaded = self.runner.loaded
        # Beside the engine's own OpenMP team, as decode reads: another thread's figure mixes in a second team.
        read_ceiling = memory_read_gb_per_s()
        self.info = EngineInfo(
            model=loaded.name,
            synthetic=loaded.synthetic,
            dtype=config.dtype,
            threads=config.threads,
            weight_bytes=loaded.weight_bytes,
            load_seconds=time.perf_counter() - started,  # compiling the decode step included
            context_length=int(self.runner.model_config.get_text_config().max_position_embeddings),
            compute_dtype=loaded.compute_dtype,
            kv_cache=config.kv_cache,
            decode_weight_bytes=loaded.decode_weight_bytes,
            decode=self.runner.decode_note,
            notes=loaded.notes + self.runner.step_notes,
            read_ceiling_gb_per_s=read_ceiling,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.prefix_cache = PrefixCache(config.prefix_cache_entries if config.kv_cache else 0)
        self.scheduler = Scheduler(max_waiting=config.max_queue, batch_limit=self.batch_limit)
        # Structured answers' next masks are computed here while the forward step runs (docs/decisions.md).
        self.masks = ThreadPoolExecutor(1, thread_name_prefix="vlscope-grammar-masks")

    def batch_limit(self) -> int:
        """How many requests decode together: the setting where the direct decode step runs, else one at a time
        (transformers' forward decodes one sequence)."""
        return self.config.max_batch if self.runner.batches else 1

    # ---- one turn of the loop --------------------------------------------------------------------------------

    def step(self) -> None:
        """Plan, carry the plan out, and tell the scheduler what came of it."""
        plan = self.scheduler.plan()
        running = list(plan.step)  # decoding requests: a request leaves the plan once it has its record
        admitted, ended = False, []
        if plan.admit is not None:
            admitted = self._admit_piece(plan.admit, running)
            if plan.admit.status == FINISHED:  # refused, cancelled, failed, or answered in one token
                ended.append(plan.admit)
        if running:
            ended += self._decode(running)
        self.scheduler.update(plan, admitted, ended)
        if ended and self.scheduler.depth == 0:
            # Idle: what the requests' intake and compute freed goes back to the system (a trim takes milliseconds;
            # glibc would keep it in its heaps, where RSS counts it as the server's).
            release_freed_memory()

    def _admit_piece(self, state: RequestState, running: list[RequestState]) -> bool:
        """The admission's next piece, the running requests waiting for it: the time goes on their records as
        paused. True once the admission is over."""
        if state.admission is None:
            state.admission = Admission(self, state)
        started = time.perf_counter()
        try:
            done = state.admission.advance(running)
        finally:
            paused = time.perf_counter() - started
            for other in running:
                other.trace.paused_s += paused
        if done:
            state.admission = None
        return done

    def _decode(self, states: list[RequestState]) -> list[RequestState]:
        """Every decoding request one token further in one step; returns those that ended (answered, stopped,
        cancelled or failed), each with its record."""
        ended = [state for state in states if state.cancelled.is_set()]
        live = [state for state in states if state not in ended]
        alone = live[0].decoding if len(live) == 1 else None
        if alone and alone.sampler.greedy and self.runner.drafts_for(alone.sequence, alone.drafted, alone.kept):
            return self._decode_ahead(live[0], ended)
        errors: dict[RequestState, VlscopeError] = {}
        if live:
            runs = self._runs(live)
            started = time.perf_counter()
            grammars = [state.decoding.sampler.grammar for state in live if state.decoding.sampler.grammar is not None]
            masks = self.masks.submit(fill_masks, grammars) if grammars else None
            try:
                with torch.inference_mode():
                    # Answers held to a schema or to calls run every step as rows of several (runner.decode), so
                    # forced tokens riding along change none of their tokens; free text around calls does not pay.
                    held = any(not grammar.free_text for grammar in grammars)
                    logits = self.runner.decode([state.decoding.sequence for state in live], runs, held)
            except Exception as exc:
                log.exception("a decode step of %d request(s) failed", len(live))
                return self._failed(live, ended, exc)
            finally:
                if masks is not None:
                    masks.result()  # before any matcher moves on or is let go
            elapsed, rss = time.perf_counter() - started, current_rss()
            for row, (state, run) in enumerate(zip(live, runs)):
                trace, decoding = state.trace, state.decoding
                for _ in run:  # each token the step took in, its share of the step's time
                    trace.decoded(elapsed / len(run), len(live))
                trace.forced_tokens += len(run) - 1
                decoding.rss[1] = max(decoding.rss[1], rss)
                if decoding.ahead:  # forced tokens left over for the next step: nothing to choose yet
                    decoding.token = decoding.ahead.pop(0)
                    continue
                try:
                    decoding.token = decoding.sampler(logits[row:row + 1])
                    if self._answer_ended(state) or self.jump_forward(state):
                        ended.append(state)
                except (GenerationFailed, InvalidSchema) as exc:  # its grammar gave out: its answer ends, not the batch
                    log.error("request %s: %s", state.id, exc)
                    errors[state] = exc
                    ended.append(state)
        for state in ended:
            self.finish(state, errors.get(state))
        return ended

    @staticmethod
    def _runs(live: list[RequestState]) -> list[list[int]]:
        """Each request's tokens for this step: its sampled token, and as many of the tokens its grammar forced after
        it as the step's rows allow (STEP_ROWS, shared out in order); the rest wait for the next step."""
        spare, runs = max(0, STEP_ROWS - len(live)), []
        for state in live:
            decoding = state.decoding
            taken = min(len(decoding.ahead), spare)
            spare -= taken
            runs.append([decoding.token, *decoding.ahead[:taken]])
            del decoding.ahead[:taken]
        return runs

    def jump_forward(self, state: RequestState) -> bool:
        """The tokens a request's grammar allows alone after the one just sampled go into its answer now and into the
        model with the next step, as rows beside it (SGLang's jump-forward decoding): a step reads the weights once
        for all of them. Whether the answer ended among them."""
        decoding = state.decoding
        if decoding.sequence.step is None or not self.config.jump_forward:  # transformers' forward: a token a step
            return False
        forced = decoding.sampler.forced(state.params.max_new_tokens - decoding.output.tokens)
        for index, token in enumerate(forced):
            decoding.ahead.append(token)
            with state.trace.stage(DETOKENIZE, announce=False):
                decoding.output.take(token, complete=index == len(forced) - 1 and decoding.sampler.done)
            if decoding.output.stopped or decoding.output.tokens >= state.params.max_new_tokens:
                return True
        return False

    def _decode_ahead(self, state: RequestState, ended: list[RequestState]) -> list[RequestState]:
        """A request decoding alone, several tokens a step: drafted, then checked in one pass, each row's token
        chosen by its sampler as a step of its own would, and kept while the drafts agree (model/draft.py)."""
        decoding, trace = state.decoding, state.trace
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                drafted, logits = self.runner.draft_and_check(
                    decoding.sequence, decoding.token, state.params.max_new_tokens - decoding.output.tokens)
        except Exception as exc:
            log.exception("a drafted decode step failed")
            return self._failed([state], ended, exc)
        elapsed, fed = time.perf_counter() - started, [decoding.token]
        decoding.rss[1] = max(decoding.rss[1], current_rss())
        for row in range(logits.shape[0]):
            decoding.token = decoding.sampler(logits[row:row + 1])
            if self._answer_ended(state):
                ended.append(state)
                break
            if row == len(drafted) or decoding.token != drafted[row]:
                break
            fed.append(drafted[row])
        self.runner.keep(decoding.sequence, fed)
        decoding.drafted, decoding.kept = decoding.drafted + len(drafted), decoding.kept + len(fed) - 1
        trace.drafted(decoding.drafted, decoding.kept)
        for _ in fed:  # each token the step gave, its share of the step's time
            trace.decoded(elapsed / len(fed), 1)
        for done in ended:
            self.finish(done)
        return ended

    def _answer_ended(self, state: RequestState) -> bool:
        """The token just sampled goes into the answer; whether the answer ends with it (a stop, or its length)."""
        decoding = state.decoding
        with state.trace.stage(DETOKENIZE, announce=False):
            decoding.output.take(decoding.token, complete=decoding.sampler.done)
        return decoding.output.stopped or decoding.output.tokens >= state.params.max_new_tokens

    def _failed(self, live: list[RequestState], ended: list[RequestState], exc: Exception) -> list[RequestState]:
        """A step that raised ends every request it ran; those cancelled before it get their records all the same."""
        error = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
        for state in live:
            self.finish(state, error)
        for state in ended:
            self.finish(state)
        return [*live, *ended]

    # ---- output processing's last word -------------------------------------------------------------------------

    def finish(self, state: RequestState, error: BaseException | None = None) -> None:
        """Close a decoding request's books: its keys and values back to the prefix cache, the held-back text out,
        its record stored and posted."""
        trace, decoding = state.trace, state.decoding
        cancelled = state.cancelled.is_set()
        try:
            self.runner.detach(decoding.sequence)
            if decoding.sequence.cache is not None and error is None:  # prompt and answer so far: the next turn's start
                self.prefix_cache.put(CachedSequence(decoding.sequence.tokens, decoding.sequence.cache, decoding.keys,
                                                     decoding.spans))
        except Exception:
            log.exception("request %s: its cache could not be kept", state.id)
        grammar, decoding.sampler.grammar = decoding.sampler.grammar, None  # a finished answer holds no matcher
        if grammar is not None:
            trace.add(GRAMMAR, grammar.seconds)
        output = decoding.output
        output.finish()
        trace.output_tokens = output.tokens
        trace.answer = output.answer
        trace.finish_reason = None if cancelled or error else "stop" if output.stopped else "length"
        if grammar is not None and grammar.check is not None:
            trace.schema_loosened = grammar.loosened
            if trace.finish_reason == "stop":  # a cut answer is unfinished, not wrong
                trace.schema_violations = grammar.check.violations(output.answer)
        after = current_rss()
        trace.rss_bytes = (decoding.rss[0], max(decoding.rss[1], after), after)
        state.status = FINISHED
        trace.finish(ERROR if error is not None else CANCELLED if cancelled else OK, error)

    def reserved_bytes(self, running: list[RequestState]) -> int:
        """Keys and values the running answers will still add, up to their length limits."""
        kv_bytes = self.runner.kv_bytes
        return sum(max(0, kv_bytes(state.trace.prompt_tokens + state.params.max_new_tokens)
                          - kv_bytes(state.decoding.sequence.tokens.shape[1]))
                   for state in running if state.decoding is not None and state.decoding.sequence.kv is not None)

    def release(self) -> None:
        """The decode step's weights and compiled code go (after any step still running)."""
        self.runner.release()
        self.masks.shutdown(wait=False)


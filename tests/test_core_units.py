"""The engine core's parts on their own, with no model: the scheduler's plans, the prefix cache's matches, stop
strings cut across tokens, a grammar matcher's choices, and parameters settled once at intake."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from engine import Busy, ChatRequest, EngineConfig
from engine.config import SKELETON_DIR
from engine.core.output import StopStrings
from engine.core.prefix_cache import MIN_REUSE_TOKENS, CachedSequence, PrefixCache, image_spans
from engine.core.request_state import RequestState
from engine.core.scheduler import Scheduler
from engine.request import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarMatcher


@pytest.fixture
def states():
    """Request states as intake makes them (their records are not written here: no store)."""
    config = EngineConfig(model=str(SKELETON_DIR), max_new_tokens=64, temperature=0.5)
    return lambda **asked: RequestState(ChatRequest(prompt="x", **asked), None, config, None)


def test_parameters_are_settled_once_from_the_request_over_the_settings(states):
    state = states(top_p=0.9, stop=("END",), seed=3)
    assert state.params == SamplingParams(max_new_tokens=64, temperature=0.5, top_p=0.9, seed=3, presence_penalty=0.0,
                                          frequency_penalty=0.0, logit_bias=(), top_logprobs=None, ignore_eos=False,
                                          stop=("END",))
    assert states(max_new_tokens=8, temperature=0.0).params.max_new_tokens == 8


def test_the_scheduler_admits_one_at_a_time_into_the_batch_and_refuses_past_the_queue(states):
    scheduler = Scheduler(max_waiting=2, batch_limit=lambda: 2)
    first, second, third, fourth = (states() for _ in range(4))
    for state in (first, second, third, fourth):
        scheduler.submit(state)
    with pytest.raises(Busy):  # two may run, two may wait: a fifth is turned away before any work
        scheduler.check_room()
    plan = scheduler.plan()
    assert plan.admit is first and plan.step == ()
    assert scheduler.plan().admit is first  # its admission goes on until the core says it is over
    scheduler.update(plan, admitted=True, ended=[])
    plan = scheduler.plan()
    assert plan.admit is second and plan.step == (first,)
    scheduler.update(plan, admitted=True, ended=[])
    plan = scheduler.plan()
    assert plan.admit is None and plan.step == (first, second)  # the batch is full: the third waits
    assert last_position(third) == 1 and last_position(fourth) == 2  # a running answer must end first
    scheduler.update(plan, admitted=False, ended=[first])
    assert last_position(third) == 0 and last_position(fourth) == 1
    assert scheduler.plan().admit is third  # a place freed: the next in line starts
    assert scheduler.withdraw(fourth) and not scheduler.withdraw(first)


def last_position(state) -> int:
    """The last place in line the scheduler told the request (its Queued events)."""
    position = None
    while not state.events.empty():
        position = state.events.get_nowait().position
    return position


def sequence(tokens: list[int], keys=(), spans=()) -> CachedSequence:
    ids = torch.tensor([tokens])
    cache = DynamicCache([(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))])
    return CachedSequence(ids, cache, tuple(keys), tuple(spans))


def test_the_prefix_cache_reuses_a_conversation_up_to_its_first_different_picture():
    cache = PrefixCache(2)
    history = list(range(40))
    cache.put(sequence(history, keys=("cat",), spans=((5, 10),)))
    follow_up = torch.tensor([history + [99, 98]])
    entry, length = cache.take(follow_up, ("cat",), ((5, 10),))
    assert length == 40 and len(cache) == 0  # continued to its end: taken over, no copy
    cache.put(sequence(history, keys=("cat",), spans=((5, 10),)))
    entry, length = cache.take(follow_up, ("dog",), ((5, 10),))  # another picture in the same place
    assert entry is None and length == 0  # only the 5 tokens before it match: under the reuse floor
    cache.put(sequence(history, keys=("cat",), spans=((30, 35),)))
    entry, length = cache.take(follow_up, ("dog",), ((30, 35),))
    assert length == 30 >= MIN_REUSE_TOKENS and entry.cache.get_seq_length() == 30  # a copy of the shared part
    assert image_spans(torch.tensor([[0, 1, 1, 0, 0, 1, 0]])) == ((1, 3), (5, 6))


def test_a_stop_string_split_across_tokens_never_reaches_the_client():
    stops = StopStrings(("</answer>",))
    shown, text = [], ""
    for piece in ["The cat", " sat</", "ans", "wer> and more"]:
        text += piece
        shown.append(stops.release(text))
    assert shown == ["The cat", " sat", "", ""] and stops.hit
    held = StopStrings(("END",))
    assert held.release("almost E") == "almost " and held.flush("almost E") == "E"  # it was not a stop after all


def test_a_grammar_matcher_narrows_the_choice_to_what_the_schema_allows():
    tokenizer = AutoTokenizer.from_pretrained(SKELETON_DIR)
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    compiled = compiler.for_request(ChatRequest(prompt="x", json_schema=json.dumps(schema)), EngineConfig())
    try:
        matcher = GrammarMatcher(compiled, vocab)
        text = ""
        while not matcher.done:
            logits = torch.zeros(vocab)
            narrowed, ids = matcher.narrow(logits)
            allowed = ids if ids is not None else np.flatnonzero(np.isfinite(narrowed.numpy()))
            token = int(allowed[0])
            matcher.accept(token)
            text += tokenizer.decode([token])
        assert json.loads(text) in ({"ok": True}, {"ok": False})
        assert not matcher.allows(tokenizer.encode("x")[0])  # the document is complete: only its end may follow
    finally:
        compiler.close()

"""Speculative decoding for float32 (engine/model/draft.py), on the tiny model: a check of several tokens gives each
row what a step of that token alone gives, and an engine that drafts answers with float32's own tokens."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine import ChatRequest
from engine.config import EngineConfig
from engine.inputs.limits import fit_to_budget
from engine.inputs.preprocess import chat_messages, image_grids, patchify_images, tokenize_prompt
from engine.kernels.packing import wide_layout_pays
from engine.model import decode_backend, draft
from engine.model.generate import attach_step, decode_batch, encode_images, next_positions, prefill
from engine.model.loading import load_model

from .conftest import collect

# The check is exact only on products laid out for its rows, which this CPU's float32 layout is where it pays.
pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not wide_layout_pays(), reason="float32 keeps the one-row layout on this CPU: "
                                                                  "no drafting here (kernels/packing.py)")]


def _prefilled(loaded, step, picture: Image.Image):
    config = EngineConfig()
    size = fit_to_budget(*picture.size, config.min_pixels, config.max_pixels)
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages([], "What is in it?", [1]), [size], loaded.image_token_id)
    vision = encode_images(loaded.model, patchify_images(loaded.image_processor, [picture], [size]))
    logits, state = prefill(loaded.model, prompt, vision, image_grids([size]), True)
    attach_step(state, step)
    return int(logits.argmax()), state


def test_a_check_gives_each_row_what_a_step_of_that_token_alone_gives(tiny_model, images_dir, tmp_path):
    """Eight greedy steps one by one, then the same tokens checked four at a time: the same logits to the bit, the
    same keys and values in the buffers; and a check whose last rows are refused leaves nothing that a later check
    of other tokens would read."""
    config = EngineConfig(model=str(tiny_model), dtype="float32", compile="off", warmup=False,
                          db_path=str(tmp_path / "d.db"))
    loaded = load_model(config)
    step, drafting, note, _ = decode_backend.prepare(loaded, config)
    assert drafting is not None and "drafted" in note
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    with torch.inference_mode():
        token, alone = _prefilled(loaded, step, picture)
        fed, expected = [token], []
        for _ in range(8):
            logits = decode_batch(step, [alone], [[fed[-1]]])
            expected.append(logits[0].clone())
            fed.append(int(logits[0].argmax()))

        first, checked = _prefilled(loaded, step, picture)
        assert first == token
        start, got = checked.kv.length, []
        # A check of tokens the model would not choose, refused entirely: only the first token is kept.
        wrong = [fed[0]] + [(t + 1) % loaded.model.config.text_config.vocab_size for t in fed[1:4]]
        rows = step.check(checked.kv, torch.tensor(wrong),
                          next_positions(checked.tokens.shape[1], checked.rope_delta, 4))
        assert torch.equal(rows[0], expected[0])
        draft.keep(checked, wrong[:1])
        got.append(rows[0])
        for offset in (1, 5):
            tokens = fed[offset:offset + 4][:8 - offset]
            rows = step.check(checked.kv, torch.tensor(tokens),
                              next_positions(checked.tokens.shape[1], checked.rope_delta, len(tokens)))
            draft.keep(checked, tokens)
            got.extend(rows)
    assert len(got) == 8
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)
    assert checked.kv.length == alone.kv.length == start + 8
    assert torch.equal(checked.tokens, alone.tokens)
    for layer in range(len(checked.kv.keys)):
        assert torch.equal(checked.kv.keys[layer][:, :start + 8], alone.kv.keys[layer][:, :start + 8])
        assert torch.equal(checked.kv.values[layer][:, :start + 8], alone.kv.values[layer][:, :start + 8])


def test_an_engine_that_drafts_answers_with_float32s_own_tokens(make_engine, images_dir):
    """Greedy answers with drafting on and off are the same tokens, pictures or not, long or cut short by a stop
    string; a sampled answer is never drafted (its tokens are not the largest logits) and a second request in the
    batch decodes a token a step beside it."""
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    requests = [ChatRequest(prompt="Describe this picture.", images=(picture,), max_new_tokens=40, ignore_eos=True),
                ChatRequest(prompt="Name three colours.", max_new_tokens=33, ignore_eos=True),
                ChatRequest(prompt="Say something.", max_new_tokens=2, ignore_eos=True)]
    answers = {}
    for setting in ("off", "int8"):
        engine = make_engine(dtype="float32", draft=setting)
        assert ("drafted" in engine.info.decode) == (setting == "int8")
        answers[setting] = [collect(engine, request) for request in requests]
        engine.close()
    for (text_off, _, off), (text_on, _, on) in zip(answers["off"], answers["int8"]):
        assert text_on == text_off and on.output_tokens == off.output_tokens
        assert on.status == off.status == "ok" and off.drafted_tokens == 0
        assert 0 <= on.drafts_kept <= on.drafted_tokens <= 3 * on.output_tokens
    assert answers["int8"][0][2].drafted_tokens > 0
    engine = make_engine(dtype="float32")
    sampled = collect(engine, ChatRequest(prompt="Say something.", max_new_tokens=12, ignore_eos=True,
                                          temperature=0.8, seed=3))[2]
    assert sampled.output_tokens == 12 and sampled.drafted_tokens == 0
    engine.close()
    # A stop string inside a drafted run ends the answer where it ends without drafting.
    words = answers["off"][0][0].split()
    stop = " ".join(words[3:5]) if len(words) > 5 else answers["off"][0][0][10:14]
    cut = {}
    for setting in ("off", "int8"):
        engine = make_engine(dtype="float32", draft=setting)
        cut[setting] = collect(engine, ChatRequest(prompt="Describe this picture.", images=(picture,),
                                                   max_new_tokens=40, ignore_eos=True, stop=(stop,)))[0]
        engine.close()
    assert cut["int8"] == cut["off"] and len(cut["off"]) < len(answers["off"][0][0])


def test_a_drafting_engine_counts_the_copy_in_its_weights_and_draft_off_turns_it_off(make_engine):
    drafting, plain = make_engine(dtype="float32"), make_engine(dtype="float32", draft="off")
    assert drafting.loaded.draft_bytes > 0
    assert drafting.info.weight_bytes > plain.info.weight_bytes
    with pytest.raises(ValueError, match="draft must be one of"):
        EngineConfig(draft="int4")
    int8 = make_engine(dtype="int8")
    assert "drafted" not in int8.info.decode


def test_a_request_whose_drafts_are_refused_stops_drafting_and_keeps_its_tokens(make_engine):
    """A logit bias the draft does not see makes the model refuse its drafts: once enough are checked to tell, the
    request decodes a token a step, with the same answer as without drafting."""
    results = {}
    for setting in ("off", "int8"):
        engine = make_engine(dtype="float32", draft=setting)
        favoured = engine.loaded.tokenizer.encode(" blue")[0]
        results[setting] = collect(engine, ChatRequest(prompt="Name a colour.", max_new_tokens=40, ignore_eos=True,
                                                       logit_bias=((favoured, 100.0),)))
        engine.close()
    assert results["int8"][0] == results["off"][0] == " blue" * 40
    record = results["int8"][2]
    assert draft.DRAFTS_BEFORE_JUDGING <= record.drafted_tokens < draft.DRAFTS_BEFORE_JUDGING + draft.DRAFTED
    assert record.drafts_kept < draft.KEPT_SHARE_THAT_PAYS * record.drafted_tokens

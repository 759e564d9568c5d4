"""The direct decode step against transformers' own forward, on the tiny model: same greedy tokens, nearly the same
logits, and the cache it hands back is the one transformers would have built."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine.config import EngineConfig
from engine.direct_step import DirectDecodeStep
from engine.generate import decode_one_token, encode_images, prefill
from engine.images import fit_to_budget
from engine.model_loading import load_model
from engine.preprocess import chat_messages, image_grids, patchify_images, tokenize_prompt

STEPS = 20


def _prefilled(loaded, picture: Image.Image):
    """A fresh prefill of one image and a question: (first greedy token, decode state)."""
    config = EngineConfig()
    size = fit_to_budget(*picture.size, config.min_pixels, config.max_pixels)
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages([], "What is in it?", [1]), [size], loaded.image_token_id)
    vision = encode_images(loaded.model, patchify_images(loaded.image_processor, [picture], [size]))
    logits, state = prefill(loaded.model, prompt, vision, image_grids([size]), True)
    return int(logits.argmax()), state


def _decode(loaded, state, token: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """STEPS greedy steps, or steps fed the `forced` tokens: the argmax of each step and its logits."""
    tokens, logits = [], []
    for index in range(STEPS):
        step_logits = decode_one_token(loaded.model, state, token)
        tokens.append(int(step_logits.argmax()))
        logits.append(step_logits.float())
        token = forced[index] if forced else tokens[-1]
    return tokens, logits


# (weights, compute dtype, the step's hidden-state dtype, logits tolerance). Where the step keeps the hidden state as
# transformers does, its logits are transformers' to the bit, so its greedy choices too. The engine's int8 keeps it
# in float32 on a bfloat16 model (its int8 products take and give float32): then within bfloat16's rounding of
# logits of spread ~1 (float32 everywhere is exact again). bfloat16's one-row products on fbgemm's float16 copy take
# and give float32 too: the engine keeps its hidden state in float32 there, the last case.
CASES = [("float32", "float32", None, 0.0), ("bfloat16", "bfloat16", None, 0.0), ("int8", "bfloat16", None, 0.0),
         ("int8", "bfloat16", torch.float32, 0.15), ("int8", "float32", torch.float32, 0.0),
         ("bfloat16", "bfloat16", torch.float32, 0.15)]


@pytest.mark.parametrize("dtype, compute, hidden, tolerance", CASES)
def test_direct_step_decodes_as_transformers_does(tiny_model, images_dir, dtype, compute, hidden, tolerance):
    """Fed transformers' greedy answer, the step gives its logits at every position, and hands back the cache
    transformers would have built."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=compute, compile="off",
                                     warmup=False))
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    with torch.inference_mode():
        token, reference = _prefilled(loaded, picture)
        expected_tokens, expected_logits = _decode(loaded, reference, token)

        # A small growth step makes the buffers grow twice within the answer.
        step = DirectDecodeStep(loaded.model, hidden, growth=8)
        token, state = _prefilled(loaded, picture)
        prompt_length = state.tokens.shape[1]
        step.take(state.cache)
        state.step = step
        tokens, logits = _decode(loaded, state, token, forced=expected_tokens)
        step.give_back(state.cache, state.tokens.shape[1])

    if tolerance == 0.0:
        assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0.0)
    # The answer's keys and values, handed back in the cache's dtype: the prefix cache's next turn starts from them.
    # (bfloat16 keys differ by one rounding where the hidden state before them was kept in float32.)
    kv_tolerance = 0.0 if tolerance == 0.0 else 0.05
    for got, want in zip(state.cache.layers, reference.cache.layers):
        assert got.keys.shape == want.keys.shape and got.keys.shape[2] == prompt_length + STEPS
        assert got.keys.dtype == want.keys.dtype
        torch.testing.assert_close(got.keys.float(), want.keys.float(), atol=kv_tolerance, rtol=kv_tolerance)
        torch.testing.assert_close(got.values.float(), want.values.float(), atol=kv_tolerance, rtol=kv_tolerance)

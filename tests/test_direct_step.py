"""The direct decode step against transformers' own forward, on the tiny model: same greedy tokens, nearly the same
logits, and the cache it hands back is the one transformers would have built."""
from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import DynamicCache

from engine.config import EngineConfig
from engine.model.decode_backend import hidden_dtype
from engine.kernels.decode_attention import MatmulAttention, best as best_attention
from engine.model.direct_step import DirectDecodeStep
from engine.model.generate import (attach_step, decode_batch, decode_one_token, detach_step, encode_images, prefill,
                             prefill_text)
from engine.inputs.limits import fit_to_budget
from engine.model.loading import load_model
from engine.inputs.preprocess import chat_messages, image_grids, patchify_images, tokenize_prompt
from engine.kernels.quantize import has_int8_dot_product
from engine.request import Turn

STEPS = 20
# Tests of the kernels a CPU may or may not have: tests/test_isa.py runs them again under AVX2-only dispatch.
pytestmark = pytest.mark.kernels


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
# and give float32 too: the last case takes the engine's choice, float32 where this CPU has that copy (oneDNN packs
# bfloat16) and bfloat16 where it has not, and then it is exact.
ENGINE_CHOICE = "engine"
CASES = [("float32", "float32", None, 0.0), ("bfloat16", "bfloat16", None, 0.0), ("int8", "bfloat16", None, 0.0),
         ("int8", "bfloat16", torch.float32, 0.15), ("int8", "float32", torch.float32, 0.0),
         ("bfloat16", "bfloat16", ENGINE_CHOICE, 0.15), ("int4", "bfloat16", None, 0.0),
         ("int4", "bfloat16", torch.float32, 0.15)]
# Without int8 dot products (VNNI, AMX) one token's activations keep 7 bits: a value that lands on another level
# moves twice as far. (Products of several rows stay 8-bit and exact, on two 7-bit halves.)
INT8_SCALE = 1.0 if has_int8_dot_product() else 127 / 63


def rounding_scale(dtype: str) -> float:
    """How far a compact precision's activation rounding may move a result, against int8's one-token rounding:
    int4's kernel rounds each row over +-max in 127 levels, fbgemm's one-token op over [min, max] in 255."""
    return {"int8": INT8_SCALE, "int4": 2.0}.get(dtype, 1.0)


# A bfloat16 value's spacing relative to its size (2^-7).
BF16_EPS = torch.finfo(torch.bfloat16).eps


def layer_tolerance(tensor: torch.Tensor, layer: int) -> float:
    """How far a cached key or value of `layer` may move where the step keeps the hidden state in float32 and
    transformers rounds it to bfloat16: the keys of layer i come from a hidden state rounded 1 + 4i more times (the
    norm's output, and per earlier layer its attention output, residual sum, norm and MLP output), each moving it
    by up to two spacings at the layer's largest value."""
    return 2 * (1 + 4 * layer) * BF16_EPS * float(tensor.abs().max())


def _hidden_and_tolerance(loaded, hidden, tolerance: float, dtype: str):
    if hidden == ENGINE_CHOICE:
        hidden = hidden_dtype(loaded)
        tolerance = tolerance if hidden is not None else 0.0
    return hidden, tolerance * rounding_scale(dtype)


@pytest.mark.parametrize("dtype, compute, hidden, tolerance", CASES)
def test_direct_step_decodes_as_transformers_does(tiny_model, images_dir, dtype, compute, hidden, tolerance):
    """Fed transformers' greedy answer, the step gives its logits at every position, and hands back the cache
    transformers would have built. Both run after a warm pass over the same shapes: a oneDNN primitive's first run
    can move the rest of its call by rounding on some CPUs (docs/decisions.md, "A oneDNN primitive's first run")."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=compute, compile="off",
                                     warmup=False))
    hidden, tolerance = _hidden_and_tolerance(loaded, hidden, tolerance, dtype)
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    with torch.inference_mode():
        warm_token, warm = _prefilled(loaded, picture)  # a warm pass: every oneDNN primitive here has run once
        _decode(loaded, warm, warm_token)
        token, reference = _prefilled(loaded, picture)
        expected_tokens, expected_logits = _decode(loaded, reference, token)

        # A small growth step makes the buffers grow twice within the answer.
        step = DirectDecodeStep(loaded.model, hidden, growth=8)
        token, state = _prefilled(loaded, picture)
        prompt_length = state.tokens.shape[1]
        attach_step(state, step)
        tokens, logits = _decode(loaded, state, token, forced=expected_tokens)
        detach_step(state)

    if tolerance == 0.0:
        assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0.0)
    # The answer's keys and values, handed back in the cache's dtype: the prefix cache's next turn starts from them.
    # (bfloat16 keys differ by a few roundings where the hidden state before them was kept in float32.)
    scale = rounding_scale(dtype)
    for layer, (got, want) in enumerate(zip(state.cache.layers, reference.cache.layers)):
        assert got.keys.shape == want.keys.shape and got.keys.shape[2] == prompt_length + STEPS
        assert got.keys.dtype == want.keys.dtype
        for mine, theirs in ((got.keys, want.keys), (got.values, want.values)):
            kv_tolerance = 0.0 if tolerance == 0.0 else scale * layer_tolerance(theirs.float(), layer)
            torch.testing.assert_close(mine.float(), theirs.float(), atol=kv_tolerance, rtol=0.0)


def _copy(cache: DynamicCache, length: int) -> DynamicCache:
    return DynamicCache([(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone())
                         for layer in cache.layers])


@pytest.mark.parametrize("dtype, compute, hidden, tolerance", CASES)
def test_direct_prefill_of_a_follow_up_matches_transformers(tiny_model, images_dir, dtype, compute, hidden, tolerance):
    """A follow-up question after a cached turn with an image, prefilled by the step: the logits of transformers'
    prefill of the same tokens over the same cache, then the same greedy answer, and the cache it hands back is the
    one transformers builds."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=compute, compile="off",
                                     warmup=False))
    hidden, _ = _hidden_and_tolerance(loaded, hidden, tolerance, dtype)
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    size = fit_to_budget(*picture.size, EngineConfig().min_pixels, EngineConfig().max_pixels)
    history = (Turn("user", "What is in it?", (picture,)), Turn("assistant", "A cup of coffee on a table."))
    follow_up = tokenize_prompt(loaded.tokenizer, chat_messages(history, "What colours stand out?", [1, 0]), [size],
                                loaded.image_token_id)
    with torch.inference_mode():
        _, first = _prefilled(loaded, picture)
        same = (first.tokens[0] == follow_up.input_ids[0, :first.tokens.shape[1]]).tolist()
        start = same.index(False) if False in same else len(same)
        assert 0 < start < follow_up.input_ids.shape[1] - 8  # the image is cached, a dozen text tokens are new

        expected_logits, reference = prefill(loaded.model, follow_up, None, image_grids([size]), True,
                                             cache=_copy(first.cache, start), start=start)
        expected_tokens, expected_steps = _decode(loaded, reference, int(expected_logits.argmax()))

        step = DirectDecodeStep(loaded.model, hidden, growth=8)  # grows within the follow-up's prefill
        logits, state = prefill_text(loaded.model, follow_up, image_grids([size]), step,
                                     cache=_copy(first.cache, start), start=start)
        tokens, steps = _decode(loaded, state, int(logits.argmax()), forced=expected_tokens)
        detach_step(state)

    # Attention over many rows at once sums in another order than transformers' SDPA call: float32 agrees to
    # rounding; bfloat16 rounds again between operations, and int8 or int4 may then round an activation to its next
    # level.
    tolerance = 1e-4 if dtype == "float32" else 0.15 * rounding_scale(dtype)
    torch.testing.assert_close(logits.float(), expected_logits.float(), atol=tolerance, rtol=0.0)
    if dtype == "float32":
        assert tokens == expected_tokens
    for got, want in zip(steps, expected_steps):  # fed the same tokens
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0.0)
    for got, want in zip(state.cache.layers, reference.cache.layers):
        assert got.keys.shape == want.keys.shape and got.keys.dtype == want.keys.dtype
        assert torch.equal(got.values[:, :, :start], want.values[:, :, :start])  # the cached turn, untouched
        torch.testing.assert_close(got.values[:, :, start:].float(), want.values[:, :, start:].float(),
                                   atol=2 * tolerance / 3, rtol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_prefill_of_a_text_prompt_fills_an_empty_cache(tiny_model, dtype):
    """A prompt without images, prefilled by the step from nothing in chunks: transformers' logits, and a cache in
    the dtype transformers would have stored, holding every prompt and answer token."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=dtype, compile="off",
                                     warmup=False))
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages([], "Name three colours.", [0]), [],
                             loaded.image_token_id)
    with torch.inference_mode():
        expected_logits, reference = prefill(loaded.model, prompt, None, None, True)
        expected_tokens, expected_steps = _decode(loaded, reference, int(expected_logits.argmax()))
        # Prefilled 5 tokens at a time into buffers grown 8 positions at a time: several chunks and growths.
        step = DirectDecodeStep(loaded.model, growth=8, chunk=5)
        logits, state = prefill_text(loaded.model, prompt, None, step)
        tokens, steps = _decode(loaded, state, int(logits.argmax()), forced=expected_tokens)
        detach_step(state)

    tolerance = 1e-4 if dtype == "float32" else 0.15  # as above
    for got, want in zip([logits] + steps, [expected_logits] + expected_steps):
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0.0)
    if dtype == "float32":
        assert tokens == expected_tokens
    assert state.cache.get_seq_length() == prompt.input_ids.shape[1] + STEPS
    assert state.cache.layers[0].keys.dtype == reference.cache.layers[0].keys.dtype == getattr(torch, dtype)


def _prefill_prompt(loaded, picture: Image.Image | None, question: str):
    config = EngineConfig()
    sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels)] if picture else []
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages([], question, [len(sizes)]), sizes,
                             loaded.image_token_id)
    vision = encode_images(loaded.model, patchify_images(loaded.image_processor, [picture], sizes)) if picture else None
    logits, state = prefill(loaded.model, prompt, vision, image_grids(sizes) if sizes else None, True)
    return int(logits.argmax()), state


@pytest.mark.parametrize("dtype, compute", [("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "bfloat16"),
                                            ("int4", "bfloat16")])
def test_a_batch_decodes_each_sequence_as_it_decodes_alone(tiny_model, images_dir, dtype, compute):
    """Three sequences of different lengths (two pictures of other sizes, one text prompt) in one batch: the second
    joins late, the first leaves early. Fed the tokens each chose alone, every row gives the logits it gave alone
    (float32: the same greedy tokens), and each hands back the cache it would have built alone."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=compute, compile="off",
                                     warmup=False))
    step = DirectDecodeStep(loaded.model, hidden_dtype(loaded), growth=8)
    inputs = [(Image.open(images_dir / "coffee.png").convert("RGB"), "What is in it?"),
              (Image.open(images_dir / "chelsea.png").convert("RGB").resize((300, 200)), "Describe it."),
              (None, "Name three colours, please.")]
    joins, leaves = [0, 6, 0], [12, STEPS, STEPS]  # the step index at which each enters and leaves the batch
    with torch.inference_mode():
        alone = []
        for picture, question in inputs:
            token, state = _prefill_prompt(loaded, picture, question)
            attach_step(state, step)
            tokens, logits = _decode(loaded, state, token)
            detach_step(state)
            alone.append((token, tokens, logits, state))

        states, fed, got_logits = [], [], [[] for _ in inputs]
        for picture, question in inputs:
            token, state = _prefill_prompt(loaded, picture, question)
            attach_step(state, step)
            states.append(state)
            fed.append(token)
        for index in range(STEPS):
            active = [i for i in range(len(inputs)) if joins[i] <= index < leaves[i]]
            position = {i: index - joins[i] for i in active}
            logits = decode_batch(step, [states[i] for i in active], [[fed[i]] for i in active])
            for row, i in enumerate(active):
                got_logits[i].append(logits[row:row + 1].float())
                # greedy in float32; the tokens chosen alone elsewhere, so rows stay comparable
                fed[i] = int(logits[row].argmax()) if dtype == "float32" else alone[i][1][position[i]]
        for state in states:
            detach_step(state)

    # int8: a lone token is quantized over its [min, max] in 255 levels (fbgemm's dynamic op), a batch's rows each
    # over +-max in 127: up to twice the rounding of the other int8 cases.
    # int4 rounds each row alone, whatever the batch.
    tolerance = {"float32": 1e-4, "bfloat16": 0.15, "int8": 0.3 * INT8_SCALE, "int4": 0.15}[dtype]
    for i, (_, tokens, logits, reference) in enumerate(alone):
        count = leaves[i] - joins[i]
        if dtype == "float32":
            assert [int(row.argmax()) for row in got_logits[i]] == tokens[:count]
        for got, want in zip(got_logits[i], logits[:count]):
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0.0)
        for got, want in zip(states[i].cache.layers, reference.cache.layers):
            assert got.keys.shape[2] == want.keys.shape[2] - (STEPS - count)
            torch.testing.assert_close(got.keys.float(), want.keys[:, :, :got.keys.shape[2]].float(),
                                       atol=max(tolerance, 1e-4), rtol=0.05)


def test_the_vision_encode_in_pieces_is_the_vision_towers_to_the_bit(tiny_model, images_dir):
    """Two pictures encoded in pieces (a pause before every block) give transformers' image features and deepstack
    features exactly."""
    from engine.model.generate import VisionEncoding

    loaded = load_model(EngineConfig(model=str(tiny_model), compile="off", warmup=False))
    config = EngineConfig()
    pictures = [Image.open(images_dir / name).convert("RGB") for name in ("coffee.png", "chelsea.png")]
    sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels) for picture in pictures]
    patches = patchify_images(loaded.image_processor, pictures, sizes)
    with torch.inference_mode():
        expected = encode_images(loaded.model, patches)
        encoding, pauses = VisionEncoding(loaded.model, patches), 0
        while not encoding.run(0.0):
            pauses += 1
        got = encoding.result
    assert pauses == len(loaded.model.model.visual.blocks)  # the set-up, then a block a piece
    assert len(got.pooler_output) == len(expected.pooler_output) == 2
    for mine, theirs in zip(got.pooler_output, expected.pooler_output):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(got.deepstack_features, expected.deepstack_features):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_step_decodes_alike_on_the_kernel_and_on_the_matmuls(tiny_model, images_dir, dtype):
    """Where the kernel cannot be built, decode attends on PyTorch's matmuls: the same greedy tokens, with
    float32 buffers (the matmuls would widen a bfloat16 cache whole at every step), and the kernel keeps the
    model's bfloat16 cache dtype in its own."""
    loaded = load_model(EngineConfig(model=str(tiny_model), dtype=dtype, compute_dtype=dtype, compile="off",
                                     warmup=False))
    picture = Image.open(images_dir / "coffee.png").convert("RGB")
    results = {}
    for attention in (best_attention()[0], MatmulAttention()):
        step = DirectDecodeStep(loaded.model, None, growth=8, attention=attention)
        assert step.kv_dtype == (getattr(torch, dtype) if attention.reads_bfloat16 else torch.float32)
        with torch.inference_mode():
            token, state = _prefilled(loaded, picture)
            attach_step(state, step)
            tokens, logits = _decode(loaded, state, token)
            detach_step(state)
        results[attention.reads_bfloat16] = tokens, logits
    (kernel_tokens, kernel_logits), (matmul_tokens, matmul_logits) = results[True], results[False]
    assert kernel_tokens == matmul_tokens
    for got, want in zip(kernel_logits, matmul_logits):
        torch.testing.assert_close(got, want, atol=1e-4 if dtype == "float32" else 0.1, rtol=0.0)


"""The model's stages, one function each, in the order a request meets them:
encode_images (or encode_images_in_pieces) -> prefill -> decode_one_token, or decode_batch for several sequences
through the direct step -> a Sampler.

Positions are built here rather than left to the model, so no state is kept inside the model between calls.
Qwen3-VL's rotary positions have four rows: the plain text position, then the 3D (time, height, width) ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from ..inputs.preprocess import ImagePatches, PromptTokens


@dataclass
class DecodeState:
    cache: DynamicCache | None  # None when the KV cache is off: every step re-reads the whole sequence
    rope_delta: int  # 3D position minus text position after the prompt
    tokens: torch.Tensor  # (1, n) every token so far, prompt included
    positions: torch.Tensor  # (4, 1, n) rotary positions of every token so far
    vision: object = None  # encoder outputs, kept for cache-less steps
    mm_token_type_ids: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    generated: list[int] = field(default_factory=list)
    step: object = None  # the DirectDecodeStep that decodes this request, or None: transformers' forward
    kv: object = None  # this request's keys and values in the step's buffers (a SequenceKV) while it decodes there


def encode_images(model, patches: ImagePatches):
    """Vision tower: patches -> one embedding per vision token, plus the deepstack features for early LM layers."""
    return model.model.get_image_features(patches.pixel_values, patches.image_grid_thw, return_dict=True)


def encode_images_in_pieces(model, patches: ImagePatches, piece_seconds: float):
    """encode_images, as a generator that yields between vision blocks once a piece has run `piece_seconds`, and
    returns what encode_images returns: an image admitted beside running answers pauses them a piece at a time, not
    for its whole encode (docs/decisions.md). The blocks are the vision tower's own, in the order of transformers'
    Qwen3VLVisionModel.forward; tests/test_direct_step.py holds the outputs to its to the bit."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    visual, grid_thw = model.model.visual, patches.image_grid_thw
    started = time.perf_counter()
    indices, weights = qwen.get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size,
        kwargs={})
    position_ids = qwen.get_vision_position_ids(grid_thw, visual.spatial_merge_size, kwargs={})
    cu_seqlens, max_seqlen = qwen.get_vision_attention_seqlens(grid_thw, visual.config, kwargs={})
    hidden = visual.patch_embed(patches.pixel_values.type(visual.dtype))
    hidden = hidden + (visual.pos_embed(indices) * weights[:, :, None]).sum(1).to(hidden.dtype)
    rotary = visual.rotary_pos_emb(hidden, position_ids)
    hidden = hidden.reshape(hidden.shape[0], -1)
    deepstack = []
    for index, block in enumerate(visual.blocks):
        if time.perf_counter() - started >= piece_seconds:
            yield
            started = time.perf_counter()
        hidden = block(hidden, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=rotary)
        if index in visual.deepstack_visual_indexes:
            deepstack.append(visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(index)](hidden))
    sizes = (grid_thw.prod(-1) // visual.spatial_merge_size ** 2).tolist()
    return qwen.BaseModelOutputWithDeepstackFeatures(
        last_hidden_state=hidden, pooler_output=torch.split(visual.merger(hidden), sizes),
        deepstack_features=[torch.split(feature, sizes) for feature in deepstack])


def prompt_positions(model, prompt: PromptTokens, image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    spatial, delta = model.model.get_rope_index(
        prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids, image_grid_thw=image_grid_thw
    )
    length = prompt.input_ids.shape[1]
    text = torch.arange(length, dtype=spatial.dtype).view(1, 1, -1)
    return torch.cat([text, spatial], dim=0), int(delta.view(-1)[0])


def next_positions(text_position: int, rope_delta: int, count: int = 1) -> torch.Tensor:
    text = torch.arange(text_position, text_position + count).view(1, 1, -1)
    return torch.cat([text, (text + rope_delta).expand(3, 1, -1)], dim=0)




def next_token_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on the last position only.

    The row is re-laid out with plain strides first: a (1, 1, hidden) view of a longer sequence keeps the long
    stride on its size-1 dimension, and the CPU matmul then takes seconds instead of milliseconds. This is why transformers' logits_to_keep is not used.
    """
    return model.lm_head(hidden[0, -1].unsqueeze(0))


def run_language_model(model, **inputs) -> torch.Tensor:
    """Qwen3-VL minus its LM head: the last hidden states."""
    return model.model(**inputs).last_hidden_state


def prefill(model, prompt: PromptTokens, vision, image_grid_thw, use_cache: bool,
            cache: DynamicCache | None = None, start: int = 0) -> tuple[torch.Tensor, DecodeState]:
    """The language model over the prompt; returns the logits of the last position and the decode state.

    With `cache` holding the prompt's first `start` tokens (a reused conversation prefix), only the rest runs;
    `vision` then covers just the images after `start`. `image_grid_thw` always lists every image of the prompt:
    the 3D positions depend on all of them."""
    pieces = prefill_in_pieces(model, prompt, vision, image_grid_thw, use_cache, cache, start)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def vision_slice(vision, first: int, count: int):
    """The encoder outputs of vision tokens first .. first + count - 1, counted over all of `vision`'s images in
    order, as one image's worth: what a prefill chunk holding just those vision tokens takes."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    embeddings = torch.cat(vision.pooler_output)[first:first + count]
    deepstack = [torch.cat(feature)[first:first + count] for feature in vision.deepstack_features]
    return BaseModelOutputWithDeepstackFeatures(pooler_output=(embeddings,),
                                                deepstack_features=[(feature,) for feature in deepstack])


def prefill_in_pieces(model, prompt: PromptTokens, vision, image_grid_thw, use_cache: bool,
                      cache: DynamicCache | None = None, start: int = 0, chunk: int | Callable[[], int] | None = None):
    """prefill as a generator: with a KV cache, the prompt runs `chunk` tokens at a time (all at once if None; a
    callable is asked before each chunk), each chunk's vision tokens with their slice of the encoder outputs, and the
    generator yields between chunks; it returns what prefill returns. A newcomer's prefill beside running answers
    then pauses them a chunk at a time (docs/decisions.md, "Admission between steps, in pieces")."""
    positions, rope_delta = prompt_positions(model, prompt, image_grid_thw)
    if cache is None and use_cache:
        cache = DynamicCache(config=model.config.get_text_config())
    total = prompt.input_ids.shape[1]
    if chunk is None or not use_cache:
        chunk = total - start
    chunk_tokens = chunk if callable(chunk) else (lambda: chunk)
    image_token = model.config.image_token_id
    placed = 0  # vision tokens handed to earlier chunks
    first = start
    while first < total:
        last = min(first + max(1, chunk_tokens()), total)
        input_ids = prompt.input_ids[:, first:last]
        outputs = vision
        if vision is not None and (first, last) != (start, total):
            count = int((input_ids == image_token).sum())
            outputs = vision_slice(vision, placed, count) if count else None
            placed += count
        hidden = run_language_model(
            model,
            input_ids=input_ids,
            position_ids=positions[:, :, first:last],
            cache=cache,
            use_cache=use_cache,
            mm_token_type_ids=prompt.mm_token_type_ids[:, first:last],
            mm_encoder_outputs={"image": outputs} if outputs is not None else None,
        )
        first = last
        if last < total:
            yield
    state = DecodeState(
        cache=cache,
        rope_delta=rope_delta,
        tokens=prompt.input_ids,
        positions=positions,
        vision=None if use_cache else vision,
        mm_token_type_ids=None if use_cache else prompt.mm_token_type_ids,
        image_grid_thw=None if use_cache else image_grid_thw,
    )
    return next_token_logits(model, hidden), state


def prefill_text(model, prompt: PromptTokens, image_grid_thw, step, cache: DynamicCache | None = None,
                 start: int = 0) -> tuple[torch.Tensor, DecodeState]:
    """prefill, for a prompt whose tokens from `start` on are all text, run by the direct decode `step` (which then
    decodes the answer): a follow-up question after a cached conversation, or a prompt without images. `cache`
    holds the first `start` tokens; the step takes a copy of them and hands everything back at the end."""
    positions, rope_delta = prompt_positions(model, prompt, image_grid_thw)
    if cache is None:
        cache = DynamicCache(config=model.config.get_text_config())
    state = DecodeState(cache=cache, rope_delta=rope_delta, tokens=prompt.input_ids, positions=positions)
    attach_step(state, step)
    return step.extend(state.kv, prompt.input_ids[:, start:], positions[:, :, start:]), state


def attach_step(state: DecodeState, step) -> None:
    """Decode `state` through the direct `step` from here on: its prefilled cache is copied into buffers of its own."""
    state.step, state.kv = step, step.take(state.cache)


def detach_step(state: DecodeState) -> None:
    """Hand the keys and values decoded in the step back to the state's cache (the prefix cache keeps it)."""
    if state.step is not None and state.kv is not None:
        state.step.give_back(state.kv, state.cache, state.tokens.shape[1])
        state.kv = None


def _append_token(state: DecodeState, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    position = state.tokens.shape[1]
    new_token = torch.tensor([[token]], dtype=state.tokens.dtype)
    new_positions = next_positions(position, state.rope_delta)
    state.tokens = torch.cat([state.tokens, new_token], dim=1)
    state.positions = torch.cat([state.positions, new_positions], dim=2)
    return new_token, new_positions


def decode_batch(step, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
    """Feed each state its next token in one step of the direct `step`: B rows through the products, attention per
    sequence -> next logits (B, vocab), row i for states[i]."""
    appended = [_append_token(state, token) for state, token in zip(states, tokens)]
    ids = torch.cat([new_token.view(1) for new_token, _ in appended])
    positions = torch.cat([new_positions for _, new_positions in appended], dim=2)
    return step.batch([state.kv for state in states], ids, positions)


def decode_one_token(model, state: DecodeState, token: int) -> torch.Tensor:
    """Feed one new token; returns the next logits. Through the compiled step when the state has one; without a
    cache, the whole sequence runs again."""
    new_token, new_positions = _append_token(state, token)
    if state.step is not None:
        return state.step(state.kv, new_token, new_positions)
    if state.cache is not None:
        hidden = run_language_model(model, input_ids=new_token, position_ids=new_positions, cache=state.cache,
                                    use_cache=True)
    else:
        state.mm_token_type_ids = torch.cat([state.mm_token_type_ids, torch.zeros_like(new_token, dtype=torch.int32)], 1)
        hidden = run_language_model(
            model,
            input_ids=state.tokens,
            position_ids=state.positions,
            use_cache=False,
            mm_token_type_ids=state.mm_token_type_ids,
            image_grid_thw=state.image_grid_thw,
            mm_encoder_outputs={"image": state.vision} if state.vision is not None else None,
        )
    return next_token_logits(model, hidden)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy when temperature is 0, else temperature and nucleus (top-p) sampling."""
    logits = torch.nan_to_num(logits[0].float(), nan=-1e9, posinf=1e9, neginf=-1e9)
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this step and their log probabilities


@dataclass
class Sampler:
    """One request's choice of the next token: logit bias, presence and frequency penalties over the tokens it has
    generated, then greedy or temperature/top-p `sample`. With `top_logprobs` set (0 to 20) it also keeps each
    chosen token's log probability and the most likely alternatives, from the logits it chose on."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator = field(default_factory=torch.Generator)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None
    counts: dict[int, int] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = torch.nan_to_num(logits[0].float(), nan=-1e9, posinf=1e9, neginf=-1e9)
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            logits[list(ids)] += torch.tensor(values)
        if self.counts and (self.presence_penalty or self.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            seen = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= self.presence_penalty + self.frequency_penalty * seen
        token = sample(logits[None], self.temperature, self.top_p, self.generator)
        if self.top_logprobs is not None:
            log_probs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(log_probs, self.top_logprobs) if self.top_logprobs else None
            self.logprobs.append(TokenLogprob(token, float(log_probs[token]), tuple(
                zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()))
        self.counts[token] = self.counts.get(token, 0) + 1
        return token

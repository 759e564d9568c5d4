"""The model's stages, one function each, in the order a request meets them:
encode_images (or VisionEncoding, in pieces) -> prefill (or ChunkedPrefill) -> decode_one_token, or decode_batch for several sequences
through the direct step (core/sampling.py then picks each token).

Positions are built here rather than left to the model, so no state is kept inside the model between calls.
Qwen3-VL's rotary positions have four rows: the plain text position, then the 3D (time, height, width) ones.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

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
    step: object = None  # the DirectDecodeStep that decodes this request, or None: transformers' forward
    kv: object = None  # this request's keys and values in the step's buffers (a SequenceKV) while it decodes there


def encode_images(model, patches: ImagePatches):
    """Vision tower: patches -> one embedding per vision token, plus the deepstack features for early LM layers."""
    return model.model.get_image_features(patches.pixel_values, patches.image_grid_thw, return_dict=True)


class VisionEncoding:
    """encode_images, resumable between vision blocks: `run(seconds)` runs blocks until a piece has taken `seconds`,
    and returns True once every block ran; `result` then holds what encode_images returns. An image admitted beside
    running answers pauses them a piece at a time, not for its whole encode (docs/decisions.md). The blocks are the
    vision tower's own, in the order of transformers' Qwen3VLVisionModel.forward; tests/test_direct_step.py holds
    the outputs to its to the bit."""

    def __init__(self, model, patches: ImagePatches):
        set_up = time.perf_counter()
        visual, grid_thw = model.model.visual, patches.image_grid_thw
        self.visual, self.grid_thw = visual, grid_thw
        indices, weights = qwen.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size,
            kwargs={})
        position_ids = qwen.get_vision_position_ids(grid_thw, visual.spatial_merge_size, kwargs={})
        self.cu_seqlens, self.max_seqlen = qwen.get_vision_attention_seqlens(grid_thw, visual.config, kwargs={})
        hidden = visual.patch_embed(patches.pixel_values.type(visual.dtype))
        hidden = hidden + (visual.pos_embed(indices) * weights[:, :, None]).sum(1).to(hidden.dtype)
        self.rotary = visual.rotary_pos_emb(hidden, position_ids)
        self.hidden = hidden.reshape(hidden.shape[0], -1)
        self.deepstack: list[torch.Tensor] = []
        self.next_block = 0
        self.blocks = len(visual.blocks)
        self.result = None
        self._carried = time.perf_counter() - set_up  # the set-up's time counts toward the first piece

    def run(self, seconds: float) -> bool:
        visual, started, ran = self.visual, time.perf_counter() - self._carried, 0
        # After the set-up a piece may end before its first block; later pieces run one block at least.
        may_end_at_once, self._carried = self._carried > 0, 0.0
        while self.next_block < len(visual.blocks):
            if (ran or may_end_at_once) and time.perf_counter() - started >= seconds:
                return False
            index, ran = self.next_block, ran + 1
            self.hidden = visual.blocks[index](self.hidden, cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen,
                                               position_embeddings=self.rotary)
            if index in visual.deepstack_visual_indexes:
                merger = visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(index)]
                self.deepstack.append(merger(self.hidden))
            self.next_block += 1
        sizes = (self.grid_thw.prod(-1) // visual.spatial_merge_size ** 2).tolist()
        self.result = qwen.BaseModelOutputWithDeepstackFeatures(
            last_hidden_state=self.hidden, pooler_output=torch.split(visual.merger(self.hidden), sizes),
            deepstack_features=[torch.split(feature, sizes) for feature in self.deepstack])
        return True


def as_pictures(model, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None):
    """The ids and token types the model is given: a clip's pair of frames as a picture. Qwen3-VL places a pair
    (get_rope_index splits a clip into patches of one pair) and embeds it exactly as a picture of one temporal patch,
    so only the id differs; the prompt, and the prefix cache that matches it, keep the video ids."""
    if mm_token_type_ids is None or not bool((mm_token_type_ids == 2).any()):
        return input_ids, mm_token_type_ids
    config = model.config
    return (torch.where(input_ids == config.video_token_id, config.image_token_id, input_ids),
            (mm_token_type_ids > 0).to(mm_token_type_ids.dtype))


def prompt_positions(model, prompt: PromptTokens, image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    input_ids, types = as_pictures(model, prompt.input_ids, prompt.mm_token_type_ids)
    spatial, delta = model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw)
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
    chunked = ChunkedPrefill(model, prompt, vision, image_grid_thw, use_cache, cache, start)
    chunked.run(None)
    return chunked.logits, chunked.state


def vision_slice(vision, first: int, count: int):
    """The encoder outputs of vision tokens first .. first + count - 1, counted over all of `vision`'s images in
    order, as one image's worth: what a prefill chunk holding just those vision tokens takes."""
    embeddings = torch.cat(vision.pooler_output)[first:first + count]
    deepstack = [torch.cat(feature)[first:first + count] for feature in vision.deepstack_features]
    return qwen.BaseModelOutputWithDeepstackFeatures(pooler_output=(embeddings,),
                                                deepstack_features=[(feature,) for feature in deepstack])


@contextmanager
def layer_progress(model, progress, before: int, tokens: int, total: int):
    """While a chunk of `tokens` prompt tokens runs after `before` others: `progress(done, total)` after each decoder
    layer (a hook for the chunk alone, so other forwards pay nothing)."""
    if progress is None:
        yield
        return
    layers = model.model.language_model.layers
    hooks = [layer.register_forward_hook(
        lambda module, args, output, index=index: progress(before + tokens * (index + 1) // len(layers), total))
        for index, layer in enumerate(layers)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class ChunkedPrefill:
    """prefill, resumable between chunks: with a KV cache, `run(tokens)` prefills the next `tokens` of the prompt
    (all that is left if None), each chunk's vision tokens with their slice of the encoder outputs, and returns True
    once the whole prompt ran; `logits` and `state` then hold what prefill returns. A newcomer's prefill beside
    running answers then pauses them a chunk at a time (docs/decisions.md, "Admission between steps, in pieces")."""

    def __init__(self, model, prompt: PromptTokens, vision, image_grid_thw, use_cache: bool,
                 cache: DynamicCache | None = None, start: int = 0):
        self.model, self.prompt, self.vision, self.image_grid_thw = model, prompt, vision, image_grid_thw
        self.use_cache, self.start = use_cache, start
        self.positions, self.rope_delta = prompt_positions(model, prompt, image_grid_thw)
        self.cache = DynamicCache(config=model.config.get_text_config()) if cache is None and use_cache else cache
        self.total = prompt.input_ids.shape[1]
        self.input_ids, self.types = as_pictures(model, prompt.input_ids, prompt.mm_token_type_ids)
        self.first = start  # the next chunk's first token
        self.placed = 0  # vision tokens handed to earlier chunks
        self.logits: torch.Tensor | None = None
        self.state: DecodeState | None = None

    def run(self, tokens: int | None, progress=None) -> bool:
        """`progress(done, total)`, if given, hears after each decoder layer how many of the prompt's tokens from
        `start` are prefilled, a chunk's tokens counting layer by layer."""
        prompt, vision = self.prompt, self.vision
        first = self.first
        last = self.total if tokens is None or not self.use_cache else min(first + max(1, tokens), self.total)
        input_ids = self.input_ids[:, first:last]
        outputs = vision
        if vision is not None and (first, last) != (self.start, self.total):
            count = int((input_ids == self.model.config.image_token_id).sum())
            outputs = vision_slice(vision, self.placed, count) if count else None
            self.placed += count
        with layer_progress(self.model, progress, first - self.start, last - first, self.total - self.start):
            hidden = run_language_model(
                self.model,
                input_ids=input_ids,
                position_ids=self.positions[:, :, first:last],
                cache=self.cache,
                use_cache=self.use_cache,
                mm_token_type_ids=self.types[:, first:last],
                mm_encoder_outputs={"image": outputs} if outputs is not None else None,
            )
        self.first = last
        if last < self.total:
            return False
        use_cache = self.use_cache
        self.state = DecodeState(
            cache=self.cache,
            rope_delta=self.rope_delta,
            tokens=prompt.input_ids,
            positions=self.positions,
            vision=None if use_cache else vision,
            mm_token_type_ids=None if use_cache else prompt.mm_token_type_ids,
            image_grid_thw=None if use_cache else self.image_grid_thw,
        )
        self.logits = next_token_logits(self.model, hidden)
        return True


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


def _append_tokens(state: DecodeState, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    position = state.tokens.shape[1]
    new_tokens = torch.tensor([tokens], dtype=state.tokens.dtype)
    new_positions = next_positions(position, state.rope_delta, len(tokens))
    state.tokens = torch.cat([state.tokens, new_tokens], dim=1)
    state.positions = torch.cat([state.positions, new_positions], dim=2)
    return new_tokens, new_positions


def _append_token(state: DecodeState, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _append_tokens(state, [token])


def decode_batch(step, states: list[DecodeState], runs: list[list[int]], as_runs: bool = False) -> torch.Tensor:
    """Feed each state its next tokens in one step of the direct `step`: a row each through the products, attention
    per sequence -> next logits (B, vocab) after each state's last token, row i for states[i]. A run of several
    tokens (a grammar's forced ones after the sampled one) goes as rows of its own (DirectDecodeStep.runs); so does
    every step of `as_runs`, so that its rows compute alike whether or not forced tokens ride along."""
    appended = [_append_tokens(state, run) for state, run in zip(states, runs)]
    ids = torch.cat([new_tokens.view(-1) for new_tokens, _ in appended])
    positions = torch.cat([new_positions for _, new_positions in appended], dim=2)
    if not as_runs and all(len(run) == 1 for run in runs):
        return step.batch([state.kv for state in states], ids, positions)
    return step.runs([state.kv for state in states], ids, positions, [len(run) for run in runs])


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
        input_ids, types = as_pictures(model, state.tokens, state.mm_token_type_ids)
        hidden = run_language_model(
            model,
            input_ids=input_ids,
            position_ids=state.positions,
            use_cache=False,
            mm_token_type_ids=types,
            image_grid_thw=state.image_grid_thw,
            mm_encoder_outputs={"image": state.vision} if state.vision is not None else None,
        )
    return next_token_logits(model, hidden)

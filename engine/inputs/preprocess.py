"""From a conversation to model inputs: chat template, token ids with image placeholders, normalised patches."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .ocr import enhance_for_ocr
from .limits import fit_to_budget, vision_token_count


@dataclass
class PromptTokens:
    input_ids: torch.Tensor  # (1, L) with one image_token_id per vision token
    mm_token_type_ids: torch.Tensor  # (1, L): 1 where a vision token sits, 0 for text


@dataclass
class ImagePatches:
    pixel_values: torch.Tensor  # (patches, 3 * 2 * 16 * 16)
    image_grid_thw: torch.Tensor  # (images, 3) in 16-pixel patches


def clean_text(text: str) -> str:
    """Valid Unicode for the tokenizer: a lone surrogate (which JSON can carry) becomes U+FFFD instead of an error."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def chat_messages(history, prompt: str, image_counts: list[int], prompt_role: str = "user",
                  video_counts: list[int] | None = None) -> list[dict]:
    """OpenAI-style messages for the chat template. image_counts (and video_counts) give, per user turn in order, its
    images (and clips), which come before its text; the prompt is a user's message, or (`prompt_role` "tool") the
    result of a call the last turn made."""
    messages = []
    counts = iter(image_counts)
    clips = iter(video_counts or [0] * len(image_counts))
    for turn in history:
        text = clean_text(turn.text)
        if turn.role == "user":
            content = ([{"type": "image"}] * next(counts) + [{"type": "video"}] * next(clips)
                       + [{"type": "text", "text": text}])
        elif turn.role in ("system", "tool"):
            content = text
        else:
            content = [{"type": "text", "text": text}] if text else ""
        message = {"role": turn.role, "content": content}
        if turn.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": clean_text(call.name),
                                                                        "arguments": clean_text(call.arguments)}}
                                     for call in turn.tool_calls]
        messages.append(message)
    if prompt_role == "tool":
        messages.append({"role": "tool", "content": clean_text(prompt)})
    else:
        messages.append({"role": "user", "content": [{"type": "image"}] * next(counts)
                         + [{"type": "video"}] * next(clips) + [{"type": "text", "text": clean_text(prompt)}]})
    return messages


def template_tools(tools) -> list[dict] | None:
    """The tools as the chat template lists them, OpenAI's function definitions; None when there are none."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": json.loads(tool.parameters)}} for tool in tools]


# The chat template's mark for a clip; Qwen3-VL's processor writes each pair of frames in its place, timestamped.
VIDEO_WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"


def video_text(plan) -> str:
    """A clip as Qwen3-VL's processor writes it: per pair of frames `<t seconds>` (the pair's mean time, one
    decimal), then its vision tokens between vision_start and vision_end."""
    pads = "<|video_pad|>" * plan.tokens_per_patch
    return "".join(f"<{time:.1f} seconds><|vision_start|>{pads}<|vision_end|>" for time in plan.patch_times)


def tokenize_prompt(tokenizer, messages: list[dict], resized_sizes: list[tuple[int, int]], image_token_id: int,
                    tools: list[dict] | None = None, videos=(), video_token_id: int | None = None) -> PromptTokens:
    """Apply the chat template, then widen each image placeholder to that image's number of vision tokens and write
    each clip (`videos`: their VideoPlans, in order) as its timestamped pairs of frames.

    Images are widened in id space (not by repeating the placeholder string), which keeps tokenization cost
    independent of image size; a clip's timestamps are text and are tokenized with it, as the processor does.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    for plan in videos:
        text = text.replace(VIDEO_WRAPPER, video_text(plan), 1)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    placeholder_positions = np.flatnonzero(ids == image_token_id)
    if len(placeholder_positions) != len(resized_sizes):
        raise ValueError(
            f"prompt has {len(placeholder_positions)} image placeholders for {len(resized_sizes)} images"
        )
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[placeholder_positions] = [vision_token_count(size) for size in resized_sizes]
    expanded = np.repeat(ids, repeats)
    input_ids = torch.from_numpy(expanded).unsqueeze(0)
    types = (input_ids == image_token_id).to(torch.int32)
    if video_token_id is not None:
        types += 2 * (input_ids == video_token_id).to(torch.int32)
    return PromptTokens(input_ids=input_ids, mm_token_type_ids=types)


def image_grids(resized_sizes: list[tuple[int, int]]) -> torch.Tensor | None:
    """(images, 3) grid of 16-pixel patches per image, from the sizes alone: what the 3D positions need."""
    if not resized_sizes:
        return None
    return torch.tensor([[1, height // 16, width // 16] for width, height in resized_sizes], dtype=torch.int64)


def patchify_images(image_processor, images: list, resized_sizes: list[tuple[int, int]]) -> ImagePatches:
    """Resize with PIL (C, on uint8) to the budgeted sizes, then normalise and cut into patches in one numpy pass.
    An item may be a pair of a clip's frames: one temporal patch of two frames where a picture repeats itself."""
    resized = [
        image if isinstance(image, tuple) or image.size == size else image.resize(size, resample=Image.BICUBIC)
        for image, size in zip(images, resized_sizes)
    ]
    pictures = [frame for item in resized for frame in (item if isinstance(item, tuple) else (item,))]
    features = image_processor(images=pictures, do_resize=False, return_tensors="pt")
    values, grids = features["pixel_values"], features["image_grid_thw"]
    if len(pictures) == len(resized):
        return ImagePatches(pixel_values=values, image_grid_thw=grids)
    # Each picture's patches hold it twice over time (channels, 2 frames, 16, 16): a pair takes its first frame's
    # picture and its second's.
    per_picture = torch.split(values, grids.prod(-1).tolist())
    parts, grid_rows, index = [], [], 0
    for item in resized:
        first = per_picture[index]
        if isinstance(item, tuple):
            second = per_picture[index + 1]
            pair = first.view(first.shape[0], 3, 2, -1).clone()
            pair[:, :, 1] = second.view(second.shape[0], 3, 2, -1)[:, :, 0]
            first = pair.view(first.shape[0], -1)
        parts.append(first)
        grid_rows.append(grids[index])
        index += len(item) if isinstance(item, tuple) else 1
    return ImagePatches(pixel_values=torch.cat(parts), image_grid_thw=torch.stack(grid_rows))


def single_image_inputs(loaded, image, resized: tuple[int, int], text: str) -> tuple[PromptTokens, ImagePatches]:
    """One question about one image, outside the engine (the bench's baseline and drift runs, `tune`):
    `loaded` is a LoadedModel, `resized` the size the image is fitted to."""
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages((), text, [1]), [resized], loaded.image_token_id)
    return prompt, patchify_images(loaded.image_processor, [image], [resized])


@dataclass
class PreparedInput:
    prompt: PromptTokens
    sizes: list[tuple[int, int]]  # each vision item's size: a picture within the image token budget, a clip's frames
    keys: tuple[str, ...]  # each vision item's identity for the prefix cache: content hash, enhancement, size
    items: list  # the vision items in prompt order: pictures, and pairs of a clip's frames
    picture_sizes: tuple[tuple[int, int], ...]  # each picture as the model sees it, for the record
    vision_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.input_ids.shape[1]


def ocr_pictures(state) -> list:
    return [enhance_for_ocr(image.image) for image in state.images]


def vision_items(state, pictures: list, sizes: list, user_turns: list) -> tuple[list, list, list]:
    """The conversation's pictures and its clips' pairs of frames in the order the prompt holds them (per user turn
    its pictures, then its clips), with each one's size and prefix-cache key."""
    request = state.request
    items, item_sizes, keys = [], [], []
    pictures_left, clips_left = iter(zip(state.images, pictures, sizes)), iter(state.videos)
    for images, videos in user_turns:
        for _ in range(images):
            image, picture, (width, height) = next(pictures_left)
            items.append(picture)
            item_sizes.append((width, height))
            keys.append(f"{image.sha256}/{int(request.enhance_for_ocr)}/{width}x{height}")
        for _ in range(videos):
            clip = next(clips_left)
            for patch in range(len(clip.plan.patch_times)):
                items.append((clip.frames[2 * patch], clip.frames[2 * patch + 1]))
                item_sizes.append(clip.plan.size)
                keys.append(f"{clip.key}/{patch}")
    return items, item_sizes, keys


def prepare_input(state, pictures: list, loaded, config) -> PreparedInput:
    """Template and tokens of the conversation of `state` (core/request_state.py) with its `pictures` fitted to the
    image budget and its clips' frames as planned, and what they count."""
    request = state.request
    sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels) for picture in pictures]
    user_turns = [(len(turn.images), len(turn.videos)) for turn in request.history if turn.role == "user"]
    user_turns.append((len(request.images), len(request.videos)))
    messages = chat_messages(request.history, request.prompt, [images for images, _ in user_turns],
                             request.prompt_role, [videos for _, videos in user_turns])
    tools = template_tools(request.tools if request.tool_choice != "none" else ())
    prompt = tokenize_prompt(loaded.tokenizer, messages, sizes, loaded.image_token_id, tools,
                             [clip.plan for clip in state.videos], loaded.video_token_id)
    items, item_sizes, keys = vision_items(state, pictures, sizes, user_turns)
    prepared = PreparedInput(prompt, item_sizes, tuple(keys), items, tuple(sizes),
                             sum(vision_token_count(size) for size in item_sizes))
    return prepared

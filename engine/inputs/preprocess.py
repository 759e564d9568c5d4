"""From a conversation to model inputs: chat template, token ids with image placeholders, normalised patches."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .ocr import enhance_for_ocr
from .limits import check_length, fit_to_budget, vision_token_count


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


def chat_messages(history, prompt: str, image_counts: list[int], prompt_role: str = "user") -> list[dict]:
    """OpenAI-style messages for the chat template. image_counts gives, per user turn in order, its image count;
    the prompt is a user's message, or (`prompt_role` "tool") the result of a call the last turn made."""
    messages = []
    counts = iter(image_counts)
    for turn in history:
        text = clean_text(turn.text)
        if turn.role == "user":
            content = [{"type": "image"}] * next(counts) + [{"type": "text", "text": text}]
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
                         + [{"type": "text", "text": clean_text(prompt)}]})
    return messages


def template_tools(tools) -> list[dict] | None:
    """The tools as the chat template lists them, OpenAI's function definitions; None when there are none."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                              "parameters": json.loads(tool.parameters)}} for tool in tools]


def tokenize_prompt(tokenizer, messages: list[dict], resized_sizes: list[tuple[int, int]], image_token_id: int,
                    tools: list[dict] | None = None) -> PromptTokens:
    """Apply the chat template, then widen each image placeholder to that image's number of vision tokens.

    Widening in id space (not by repeating the placeholder string) keeps tokenization cost independent of image size.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
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
    return PromptTokens(input_ids=input_ids, mm_token_type_ids=(input_ids == image_token_id).to(torch.int32))


def image_grids(resized_sizes: list[tuple[int, int]]) -> torch.Tensor | None:
    """(images, 3) grid of 16-pixel patches per image, from the sizes alone: what the 3D positions need."""
    if not resized_sizes:
        return None
    return torch.tensor([[1, height // 16, width // 16] for width, height in resized_sizes], dtype=torch.int64)


def patchify_images(image_processor, images: list[Image.Image], resized_sizes: list[tuple[int, int]]) -> ImagePatches:
    """Resize with PIL (C, on uint8) to the budgeted sizes, then normalise and cut into patches in one numpy pass."""
    resized = [
        image if image.size == size else image.resize(size, resample=Image.BICUBIC)
        for image, size in zip(images, resized_sizes)
    ]
    features = image_processor(images=resized, do_resize=False, return_tensors="pt")
    return ImagePatches(pixel_values=features["pixel_values"], image_grid_thw=features["image_grid_thw"])


def single_image_inputs(loaded, image, resized: tuple[int, int], text: str) -> tuple[PromptTokens, ImagePatches]:
    """One question about one image, outside the engine (the bench's baseline and drift runs, `tune`):
    `loaded` is a LoadedModel, `resized` the size the image is fitted to."""
    prompt = tokenize_prompt(loaded.tokenizer, chat_messages((), text, [1]), [resized], loaded.image_token_id)
    return prompt, patchify_images(loaded.image_processor, [image], [resized])


@dataclass
class PreparedInput:
    prompt: PromptTokens
    sizes: list[tuple[int, int]]  # each picture's size within the image token budget
    keys: tuple[str, ...]  # each picture's identity for the prefix cache: content hash, enhancement, size


def ocr_pictures(job) -> list:
    return [enhance_for_ocr(image.image) for image in job.images]


def prepare_input(job, pictures: list, loaded, config, context_length: int) -> PreparedInput:
    """Template and tokens of `job`'s conversation with its `pictures` fitted to the image budget; raises
    PromptTooLong before any compute when it cannot fit."""
    request = job.request
    sizes = [fit_to_budget(*picture.size, config.min_pixels, config.max_pixels) for picture in pictures]
    image_counts = [len(turn.images) for turn in request.history if turn.role == "user"]
    messages = chat_messages(request.history, request.prompt, image_counts + [len(request.images)],
                             request.prompt_role)
    tools = template_tools(request.tools if request.tool_choice != "none" else ())
    prompt = tokenize_prompt(loaded.tokenizer, messages, sizes, loaded.image_token_id, tools)
    trace = job.trace
    trace.resized_sizes = tuple(sizes)
    trace.vision_tokens = sum(vision_token_count(size) for size in sizes)
    trace.prompt_tokens = prompt.input_ids.shape[1]
    check_length(trace.prompt_tokens, trace.max_new_tokens, config.max_input_tokens, context_length)
    keys = tuple(f"{image.sha256}/{int(request.enhance_for_ocr)}/{w}x{h}" for image, (w, h) in zip(job.images, sizes))
    return PreparedInput(prompt, sizes, keys)

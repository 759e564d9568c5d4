"""The limits a request must keep, checked before any model compute: its text, messages and images, each source's
bytes, each picture's size within the image token budget, and the memory it would take."""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image

from ..errors import InsufficientMemory, InvalidImage, InvalidPrompt, PromptTooLong
from ..config import PIXELS_PER_VISION_TOKEN
from .memory import available_bytes, estimate_request_bytes


def control_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (<|im_start|>, <|image_pad|>, ...): in a user's text they would act as
    template structure, not words."""
    added = [token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special]
    return tuple(sorted(set(tokenizer.all_special_tokens) | set(added)))


# No text of this tokenizer's family packs more characters than this into one token on average: a longer text
# cannot fit the prompt limit, so it is refused from its length, before it is tokenized.
MAX_CHARS_PER_TOKEN = 16
# A message costs the chat template at least this many tokens.
MIN_TOKENS_PER_MESSAGE = 4


def max_messages(config) -> int:
    """The most messages a conversation can carry within the prompt limit."""
    return config.max_input_tokens // MIN_TOKENS_PER_MESSAGE


def request_texts(request) -> list[str]:
    """Every text the prompt will carry: the messages, the calls earlier turns made, and the tools offered."""
    return message_texts(request) + tool_texts(request)


def message_texts(request) -> list[str]:
    """The conversation's texts: the messages and the calls earlier turns made."""
    texts = [request.prompt] + [turn.text for turn in request.history]
    return texts + [part for turn in request.history for call in turn.tool_calls for part in (call.name, call.arguments)]


def tool_texts(request) -> list[str]:
    return [part for tool in request.tools for part in (tool.name, tool.description, tool.parameters)]


def text_at_fault(request) -> str:
    """The part of a request a too-long prompt is blamed on, as the API names it: the tools when their definitions
    outweigh the conversation, else the messages."""
    tools = sum(len(text) for text in tool_texts(request))
    return "tools" if tools > sum(len(text) for text in message_texts(request)) else "messages"


def check_size(request, config) -> None:
    """Refuse, from counts alone and before any tokenizing or decoding, a request whose text, messages or images
    cannot fit: what a huge prompt would otherwise cost is paid before the limit could refuse it."""
    chars = sum(len(text) for text in request_texts(request))
    limit = config.max_input_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise PromptTooLong(f"The text is {chars:,} characters; no text over {limit:,} fits the prompt limit of "
                            f"{config.max_input_tokens:,} tokens. Shorten it.", text_at_fault(request))
    messages = len(request.history) + 1
    if messages > max_messages(config):
        raise PromptTooLong(f"The conversation has {messages:,} messages; no more than {max_messages(config):,} fit "
                            "the prompt limit.")
    images = len(request.images) + sum(len(turn.images) for turn in request.history)
    if images > config.max_images:
        raise InvalidImage(f"The request carries {images:,} images; at most {config.max_images} are read per request.")


def check_text(request, tokens: tuple[str, ...]) -> None:
    """Refuse, before any work, text that carries a control token: typed into a prompt, `<|im_end|>` would end the
    user's turn and `<|image_pad|>` would claim an image."""
    for texts, about in ((message_texts(request), "messages"), (tool_texts(request), "tools")):
        for text in texts:
            found = next((token for token in tokens if token in text), None)
            if found is not None:
                raise InvalidPrompt(f"The text contains {found!r}, one of the model's control tokens, which only the "
                                    "chat template may write. Remove it and ask again.", about)


def check_length(prompt_tokens: int, max_new_tokens: int, max_input_tokens: int, context_length: int,
                 about: str = "messages") -> None:
    """`about`: the part of the request a prompt over the limit is blamed on (`text_at_fault`)."""
    if prompt_tokens > max_input_tokens:
        raise PromptTooLong(
            f"The prompt is {prompt_tokens} tokens (text, earlier turns, tool definitions and images); the limit is "
            f"{max_input_tokens}. Shorten the conversation or the tools, use fewer or smaller images, "
            "or lower the image token budget.", about)
    if prompt_tokens + max_new_tokens > context_length:
        raise PromptTooLong(
            f"The prompt ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds the model's context "
            f"of {context_length} tokens.", "max_tokens")


def check_memory(model_config, sizes, prompt_tokens: int, max_new_tokens: int, compute_dtype: str,
                 float32_decode_cache: bool, limit_bytes: int, reserved_bytes: int = 0) -> None:
    """Refuse a request whose activations and keys and values would not fit beside the weights, with the room the
    answers running now will still take (`reserved_bytes`: their keys and values yet to grow) set aside."""
    patches = sum(width * height // 256 for width, height in sizes)
    value_bytes = 4 if compute_dtype == "float32" else 2
    need = estimate_request_bytes(model_config, patches, prompt_tokens, max_new_tokens, value_bytes,
                                  float32_decode_cache=float32_decode_cache)
    room = (limit_bytes or available_bytes()) - reserved_bytes
    if need > room:
        busy = (f" ({reserved_bytes / 2**30:.1f} GiB of it is held for the answers running now: try again when "
                "they end)") if reserved_bytes else ""
        raise InsufficientMemory(
            f"This request needs about {need / 2**30:.1f} GiB beyond the model's weights and "
            f"{max(room, 0) / 2**30:.1f} GiB is available{busy}. Use fewer or smaller images, a lower image token "
            "budget, fewer new tokens, or bfloat16."
        )


MERGED_PATCH = 32  # pixels per side of one vision token

def read_source(source, max_bytes: int) -> tuple[bytes | None, Image.Image | None, str]:
    """An image source's bytes (or the PIL image handed in) and its name, within the byte limit."""
    if isinstance(source, Image.Image):
        return None, source, "image"
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        name = "upload"
    elif isinstance(source, (str, Path)):
        path = Path(source)
        name = path.name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise InvalidImage(f"{name}: cannot read the file ({exc.strerror or exc})") from None
        if size > max_bytes:
            raise InvalidImage(f"{name}: file is {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB limit")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InvalidImage(f"{name}: cannot read the file ({exc.strerror or exc})") from None
    elif hasattr(source, "read"):
        data = source.read(max_bytes + 1)
        name = getattr(source, "name", "upload")
    else:
        raise InvalidImage(f"unsupported image input of type {type(source).__name__}")
    if len(data) == 0:
        raise InvalidImage(f"{name}: the file is empty")
    if len(data) > max_bytes:
        raise InvalidImage(f"{name}: file is over the {max_bytes / 1e6:.0f} MB limit")
    return data, None, name


def fit_to_budget(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (width, height) the model sees: multiples of 32, aspect kept, pixel count within the budget.

    Same rule as Qwen2-VL's smart_resize, so the resized size and the token count agree with the reference processor.
    """
    factor = MERGED_PATCH
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


def vision_token_count(resized: tuple[int, int]) -> int:
    width, height = resized
    return (width * height) // PIXELS_PER_VISION_TOKEN

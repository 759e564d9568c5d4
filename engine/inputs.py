"""Input processing: a request's pictures, chat template and tokens, and the limits it must keep, before any model
compute. The engine calls it inside its preprocess stage; nothing here touches the model's weights."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InsufficientMemory, InvalidImage, InvalidPrompt, PromptTooLong
from .images import enhance_for_ocr, fit_to_budget, vision_token_count
from .memory import available_bytes, estimate_request_bytes
from .preprocess import PromptTokens, chat_messages, tokenize_prompt


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
    messages = chat_messages(request.history, request.prompt, image_counts + [len(request.images)])
    prompt = tokenize_prompt(loaded.tokenizer, messages, sizes, loaded.image_token_id)
    trace = job.trace
    trace.resized_sizes = tuple(sizes)
    trace.vision_tokens = sum(vision_token_count(size) for size in sizes)
    trace.prompt_tokens = prompt.input_ids.shape[1]
    check_length(trace.prompt_tokens, trace.max_new_tokens, config.max_input_tokens, context_length)
    keys = tuple(f"{image.sha256}/{int(request.enhance_for_ocr)}/{w}x{h}" for image, (w, h) in zip(job.images, sizes))
    return PreparedInput(prompt, sizes, keys)


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


def check_size(request, config) -> None:
    """Refuse, from counts alone and before any tokenizing or decoding, a request whose text, messages or images
    cannot fit: what a huge prompt would otherwise cost is paid before the limit could refuse it."""
    chars = len(request.prompt) + sum(len(turn.text) for turn in request.history)
    limit = config.max_input_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise PromptTooLong(f"The text is {chars:,} characters; no text over {limit:,} fits the prompt limit of "
                            f"{config.max_input_tokens:,} tokens. Shorten it.")
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
    for text in [request.prompt] + [turn.text for turn in request.history]:
        found = next((token for token in tokens if token in text), None)
        if found is not None:
            raise InvalidPrompt(f"The text contains {found!r}, one of the model's control tokens, which only the chat "
                                "template may write. Remove it and ask again.")


def check_length(prompt_tokens: int, max_new_tokens: int, max_input_tokens: int, context_length: int) -> None:
    if prompt_tokens > max_input_tokens:
        raise PromptTooLong(
            f"The prompt is {prompt_tokens} tokens (text, earlier turns and images); the limit is "
            f"{max_input_tokens}. Shorten the conversation, use fewer or smaller images, "
            "or lower the image token budget."
        )
    if prompt_tokens + max_new_tokens > context_length:
        raise PromptTooLong(
            f"The prompt ({prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds the model's context "
            f"of {context_length} tokens."
        )


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

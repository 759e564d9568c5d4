"""OpenAI chat-completions requests to engine requests, and engine results back to OpenAI's response shapes."""
from __future__ import annotations

from pathlib import Path

from engine import ChatRequest, RequestMetrics, Turn
from engine.inputs.documents import Document, is_pdf

from . import structured
from .errors import ApiError, unsupported


def _content(content, fetch_image, max_pages: int | None = None, fetch_video=None) -> tuple[str, tuple, tuple]:
    """A message's text and its attachments: images as bytes, PDF `file` parts as Documents (PDF data URLs in
    image_url parts are found by their content downstream), and video clips (`video_url` parts, as vLLM takes them)
    as bytes."""
    if isinstance(content, str):
        return content, (), ()
    if not isinstance(content, list):
        raise ApiError(400, "message content must be a string or a list of parts", code="invalid_type", param="messages")
    texts, images, videos = [], [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            source = part.get("image_url")
            url = source.get("url") if isinstance(source, dict) else source
            if not isinstance(url, str):
                raise ApiError(400, "image_url parts need an image_url.url string", param="messages")
            data = fetch_image(url)
            images.append(Document(data, "document.pdf", max_pages=max_pages) if is_pdf(data) else data)
        elif kind == "file":
            images.append(_file_part(part.get("file"), fetch_image, max_pages))
        elif kind == "video_url" and fetch_video is not None:
            source = part.get("video_url")
            url = source.get("url") if isinstance(source, dict) else source
            if not isinstance(url, str):
                raise ApiError(400, "video_url parts need a video_url.url string", param="messages")
            videos.append(fetch_video(url))
        else:
            raise ApiError(400, f"unsupported content part {kind!r}: use text, image_url, video_url and file parts",
                           param="messages")
    return "\n".join(texts), tuple(images), tuple(videos)


def _file_part(file, fetch_image, max_pages: int | None):
    """OpenAI's `file` part, `{"file": {"filename": ..., "file_data": "data:application/pdf;base64,..."}}`: PDFs only."""
    if not isinstance(file, dict) or not isinstance(file.get("file_data"), str):
        raise ApiError(400, "file parts need file.file_data, a data: URL (uploaded file ids are not kept here)",
                       param="messages")
    name = file.get("filename") if isinstance(file.get("filename"), str) else "document.pdf"
    data_url = file["file_data"]
    if not data_url.startswith("data:"):
        raise ApiError(400, "file.file_data must be a data: URL (data:application/pdf;base64,...)", param="messages")
    data = fetch_image(data_url)
    if not is_pdf(data):
        raise ApiError(400, f"{name[:100]}: file parts take PDF documents; send pictures as image_url parts",
                       code="invalid_image", param="messages")
    return Document(data, name[:100], max_pages=max_pages)


def _number(body: dict, name: str, kind, low, high, inclusive_low=True):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be a {kind.__name__}", code="invalid_type", param=name)
    if not value == value or not low <= value <= high or (not inclusive_low and value == low):  # NaN fails too
        raise ApiError(400, f"{name} must be between {low} and {high}", code="invalid_value", param=name)
    return kind(value)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    """A JSON boolean: the string "false" is not one (it would be truthy)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", code="invalid_type", param=name)
    return value


def stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), checked before the request is queued."""
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", code="invalid_type", param="stream_options")
    return stream, _flag(options, "include_usage")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def check_unsupported(body: dict) -> None:
    """What a single-stream CPU server does not do is refused by name, never silently ignored."""
    if body.get("n") not in (None, 1):
        raise unsupported("n", "n > 1 is not supported: one answer per request (send the request again)")


ATTACHMENT_PARTS = ("image_url", "file")


def _count_attachments(messages: list) -> int:
    return sum(1 for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") in ATTACHMENT_PARTS)


def video_settings(body: dict) -> tuple[float | None, int | None]:
    """(fps, frames at most) from vLLM's spellings: `mm_processor_kwargs: {"fps": 2}` and
    `media_io_kwargs: {"video": {"num_frames": 32}}`; any other key there is refused by name, never ignored."""
    processor = body.get("mm_processor_kwargs") or {}
    media = body.get("media_io_kwargs") or {}
    if not isinstance(processor, dict) or not isinstance(media, dict) or not isinstance(media.get("video", {}), dict):
        raise ApiError(400, "mm_processor_kwargs and media_io_kwargs.video must be objects", code="invalid_type",
                       param="mm_processor_kwargs")
    for name, given, known in (("mm_processor_kwargs", processor, {"fps"}), ("media_io_kwargs", media, {"video"}),
                               ("media_io_kwargs.video", media.get("video", {}), {"num_frames"})):
        unknown = sorted(set(given) - known)
        if unknown:
            raise unsupported(name, f"{name} takes {', '.join(sorted(known))} here, not {', '.join(unknown)}")
    return (_number(processor, "fps", float, 0, 30, inclusive_low=False),
            _number(media.get("video", {}), "num_frames", int, 4, 768))


def to_chat_request(body: dict, fetch_image, max_tokens_cap: int, allow_ignore_eos: bool,
                    max_images: int = 16, max_messages: int | None = None, fetch_video=None) -> ChatRequest:
    """The engine request an OpenAI body stands for. `fetch_image(url)` gives an image_url's bytes; `max_tokens_cap`
    is the server's answer length cap; ignore_eos is refused unless the operator allows it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    # Counted before any is parsed or decoded: a body of 100,000 tiny images is refused in microseconds.
    if max_messages is not None and len(messages) > max_messages:
        raise ApiError(400, f"{len(messages):,} messages; no more than {max_messages:,} fit the prompt limit",
                       code="too_many_messages", param="messages")
    attachments = _count_attachments(messages)
    if attachments > max_images:
        raise ApiError(400, f"{attachments:,} images and files; at most {max_images} per request",
                       code="too_many_images", param="messages")
    max_pages = _number(body, "max_pages", int, 1, 1000)  # vlscope's extension: at most this many pages a document
    video_fps, video_max_frames = video_settings(body)
    turns = [_turn(message, fetch_image, max_pages, fetch_video) for message in messages]
    last = turns[-1]
    if last.role not in ("user", "tool"):
        raise ApiError(400, "the last message must come from the user, or be a tool's result", param="messages")
    max_tokens = _max_tokens(body, "max_completion_tokens", max_tokens_cap)
    max_tokens = max_tokens or _max_tokens(body, "max_tokens", max_tokens_cap)
    ignore_eos = _flag(body, "ignore_eos")  # vLLM's extension, for fixed-length benchmarks
    if ignore_eos and not allow_ignore_eos:
        raise ApiError(400, "ignore_eos is not enabled on this server (VLSCOPE_API_ALLOW_IGNORE_EOS)",
                       code="unsupported_parameter", param="ignore_eos")
    top_logprobs = _number(body, "top_logprobs", int, 0, 20)
    if _flag(body, "logprobs"):
        top_logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    tools, tool_choice, parallel_tool_calls = structured.tools(body)
    schema, strict = structured.json_schema(body)
    return ChatRequest(
        prompt=last.text, images=last.images, videos=last.videos, history=tuple(turns[:-1]),
        prompt_role=last.role, video_fps=video_fps, video_max_frames=video_max_frames,
        json_schema=schema, strict=strict, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        max_new_tokens=max_tokens, temperature=_number(body, "temperature", float, 0, 2),
        top_p=_number(body, "top_p", float, 0, 1, inclusive_low=False), source="api",
        ignore_eos=ignore_eos,
        stop=_stop(body.get("stop")), seed=_number(body, "seed", int, -2**63, 2**64 - 1),
        presence_penalty=_number(body, "presence_penalty", float, -2, 2) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", float, -2, 2) or 0.0,
        logit_bias=_logit_bias(body.get("logit_bias")), top_logprobs=top_logprobs,
    )


def _turn(message, fetch_image, max_pages: int | None, fetch_video=None) -> Turn:
    """One message as a turn of the conversation: its text and images, an assistant's calls, a tool's result."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(400, "each message needs a role of system, developer, user, assistant or tool",
                       param="messages")
    role = ROLES[message["role"]]
    content = message.get("content", "")
    if content is None and role in ("assistant", "tool"):  # an assistant turn of calls alone
        content = ""
    text, images, videos = _content(content, fetch_image, max_pages, fetch_video)
    if (images or videos) and role != "user":
        raise ApiError(400, "only user messages may carry images and videos", param="messages")
    calls = structured.assistant_calls(message) if role == "assistant" else ()
    tool_call_id = message.get("tool_call_id", "") if role == "tool" else ""
    if not isinstance(tool_call_id, str):
        raise ApiError(400, "a tool message's tool_call_id must be a string", code="invalid_type", param="messages")
    return Turn(role, text, images, videos, calls, tool_call_id)


def _max_tokens(body: dict, name: str, cap: int) -> int | None:
    value = _number(body, name, int, 1, 2**31)
    if value is not None and value > cap:
        raise ApiError(400, f"{name} is {value}; this server answers at most {cap} tokens (VLSCOPE_MAX_NEW_TOKENS)",
                       code="invalid_value", param=name)
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", code="invalid_value",
                       param="stop")
    return tuple(stops)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    try:
        if not isinstance(value, dict) or len(value) > 300:
            raise ValueError
        pairs = tuple((int(token), float(bias)) for token, bias in value.items())
        if not all(0 <= token < 2**31 and -100 <= bias <= 100 for token, bias in pairs):
            raise ValueError
    except (TypeError, ValueError):
        raise ApiError(400, "logit_bias must map up to 300 token ids to numbers from -100 to 100",
                       code="invalid_value", param="logit_bias") from None
    return pairs


def logprobs_content(entries, token_text) -> list[dict]:
    """OpenAI's logprobs.content list for TokenLogprob entries; token_text(id) gives a token's text."""
    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def served_model_name(model: str, configured: str = "") -> str:
    """The id clients send back: the setting, else the hub id, else the model folder's name (never a path)."""
    if configured:
        return configured
    path = Path(model)
    return path.name if path.is_absolute() or model.startswith((".", "~")) or len(path.parts) > 2 else model


def model_entry(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "vlscope"}


def finish_reason(metrics: RequestMetrics, called: bool = False) -> str:
    """stop or length; tool_calls when an answer that stopped made calls."""
    reason = metrics.finish_reason or ("length" if metrics.output_tokens >= metrics.max_new_tokens else "stop")
    return "tool_calls" if called and reason == "stop" else reason


def usage(metrics: RequestMetrics) -> dict:
    return {"prompt_tokens": metrics.prompt_tokens, "completion_tokens": metrics.output_tokens,
            "total_tokens": metrics.prompt_tokens + metrics.output_tokens}


# What a record holds that a client has no use for and an attacker would: the server's process id, its memory,
# the model's path on disk, and the stored prompt and answer.
PRIVATE_FIELDS = ("prompt", "answer", "pid", "model", "rss_before_bytes", "rss_peak_bytes", "rss_after_bytes",
                  "weight_bytes", "decode_weight_bytes")


def public_metrics(metrics: RequestMetrics) -> dict:
    """The stage timings, token counts and settings a client may see."""
    record = metrics.to_dict()
    for name in PRIVATE_FIELDS:
        record.pop(name, None)
    return record


def completion(model: str, text: str | None, metrics: RequestMetrics, logprobs: list[dict] | None = None,
               tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
    return {
        "id": f"chatcmpl-{metrics.id}", "object": "chat.completion", "created": int(metrics.submitted_at),
        "model": model,
        "choices": [{"index": 0, "message": message,
                     "logprobs": None if logprobs is None else {"content": logprobs},
                     "finish_reason": finish_reason(metrics, bool(tool_calls))} | schema_flag(metrics)],
        "usage": usage(metrics), "metrics": public_metrics(metrics),
    }


def schema_flag(metrics: RequestMetrics) -> dict:
    """An answer to a schema without `strict` that breaks what its grammar could not hold says so on its choice, in
    vlscope's `schema_violations` (clients ignore fields they do not know); a valid answer carries nothing."""
    return {"schema_violations": list(metrics.schema_violations)} if metrics.schema_violations else {}


def chunk(request_id: str, model: str, created: int, delta: dict | None, finish: str | None = None,
          logprobs: list[dict] | None = None, flag: dict | None = None, **extra) -> dict:
    """A streamed chunk; `delta` None makes the final usage chunk, which has no choices (as OpenAI sends it). `flag`:
    fields of the last choice (`schema_flag`)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": None if logprobs is None else {"content": logprobs}}
                                        | (flag or {})]
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, **extra}

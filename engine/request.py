"""What a caller sends (ChatRequest) and the small typed events a request's stream yields before its metrics."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

# A path, raw bytes, or a PIL image.
ImageSource = Union[str, Path, bytes, Any]
# A video clip: a path or raw bytes (mp4, webm, mov, mkv, animated GIF).
VideoSource = Union[str, Path, bytes]


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant turn made: its arguments as the JSON text the model wrote."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is its JSON Schema, as JSON text. A function defined without one
    takes no arguments: they are `{}` (OpenAI's reading), not any object."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}, "additionalProperties": false}'
    strict: bool = True  # as `ChatRequest.strict`, for this function's arguments


@dataclass(frozen=True)
class Turn:
    """One earlier message of a conversation. User turns may carry the images and clips they were about; assistant
    turns the calls they made; tool turns carry a call's result."""

    role: str  # "system", "user", "assistant" or "tool"
    text: str
    images: tuple[ImageSource, ...] = ()
    videos: tuple[VideoSource, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


TOOL_CHOICES = ("none", "auto", "required")  # or a tool's name: that function is called, once


@dataclass(frozen=True)
class ChatRequest:
    prompt: str
    images: tuple[ImageSource, ...] = ()
    history: tuple[Turn, ...] = ()
    videos: tuple[VideoSource, ...] = ()  # clips, read after the images in the same message
    video_fps: float | None = None  # frames sampled a second; None: the engine's setting
    video_max_frames: int | None = None  # at most this many frames a clip (even, 4 or more); None: 768
    max_new_tokens: int | None = None  # None: the engine's setting
    temperature: float | None = None
    top_p: float | None = None
    enhance_for_ocr: bool = False
    source: str = "python"  # who asked: cli, app, api, bench...
    warmup: bool = False
    reuse_cache: bool = True  # False: start cold, as a new conversation would (benchmarks)
    ignore_eos: bool = False  # True: always generate max_new_tokens (benchmarks compare equal lengths)
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings, which is not included
    seed: int | None = None  # same seed and settings: the same sampled answer
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the answer
    frequency_penalty: float = 0.0  # times how often it is in the answer
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    top_logprobs: int | None = None  # None: no log probabilities; 0-20: the chosen token's and that many others'
    # The answer is JSON valid against this JSON Schema (JSON text); '{"type": "object"}' asks for any JSON object.
    json_schema: str | None = None
    # True: the schema is held exactly or refused. False (OpenAI's reading of a schema without `strict`): held to the
    # closest grammar (keywords no grammar holds are left out), and a finished answer that breaks them is flagged.
    strict: bool = True
    tools: tuple[Tool, ...] = ()  # functions offered to the model, in its prompt
    tool_choice: str = "auto"  # TOOL_CHOICES or a tool's name; required and a name constrain the answer to calls
    parallel_tool_calls: bool = True
    prompt_role: str = "user"  # "tool": the prompt is a call's result, to which the model answers

    def __post_init__(self) -> None:
        for turn in self.history:
            if turn.role not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"turn role must be 'system', 'user', 'assistant' or 'tool', not {turn.role!r}")
        if self.prompt_role not in ("user", "tool"):
            raise ValueError(f"prompt_role must be 'user' or 'tool', not {self.prompt_role!r}")

    @property
    def calls_only(self) -> bool:
        """The answer must be tool calls: tool_choice is required or names a function."""
        return bool(self.tools) and self.tool_choice not in ("none", "auto")


def default_answer_tokens(config, synthetic: bool) -> int:
    """The answer length a request that sets none gets."""
    if synthetic and config.synthetic_max_new_tokens:
        return min(config.max_new_tokens, config.synthetic_max_new_tokens)
    return config.max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How a request's answer is drawn and how long it may grow, settled once at intake from the request and the
    engine's settings (as vLLM's SamplingParams): everything after reads these, never the settings again."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    top_logprobs: int | None
    ignore_eos: bool
    stop: tuple[str, ...]

    @classmethod
    def settle(cls, request: ChatRequest, config, synthetic: bool = False) -> SamplingParams:
        """The request's own values where it set them, else the engine's settings (`config`); `synthetic` weights
        answer noise up to the cap, so their default length is the lower synthetic_max_new_tokens."""
        return cls(max_new_tokens=request.max_new_tokens or default_answer_tokens(config, synthetic),
                   temperature=config.temperature if request.temperature is None else request.temperature,
                   top_p=config.top_p if request.top_p is None else request.top_p,
                   seed=request.seed, presence_penalty=request.presence_penalty,
                   frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias,
                   top_logprobs=request.top_logprobs, ignore_eos=request.ignore_eos, stop=request.stop)


@dataclass(frozen=True)
class Queued:
    """The request waits; `position` requests are ahead of it (0: it runs next)."""

    position: int


@dataclass(frozen=True)
class StageStarted:
    """A stage of the request begins: lets a UI say what the CPU is busy with."""

    name: str


@dataclass(frozen=True)
class StageProgress:
    """How far a long stage is: `done` of `total` pieces (the vision tower's blocks, the prompt's tokens), so a UI
    shows progress through a wait of seconds instead of one still line."""

    name: str
    done: int
    total: int
    unit: str  # what a piece is, in words: "blocks", "prompt tokens"


@dataclass(frozen=True)
class TextChunk:
    text: str
    logprobs: tuple = ()  # TokenLogprob of the tokens behind this text, when the request asked for them

"""An engine whose model runs elsewhere: any OpenAI-compatible server (vLLM, llama.cpp's server, Ollama, another
vlscope). Same interface as Engine, so the chat page and the API work unchanged; the metrics hold what the client
can measure, plus the server's own timings when it reports them (vlscope's `metrics`, llama.cpp's `timings`)."""
from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
import threading
import time

import httpx

from .config import EngineConfig
from .client import RequestHandle, StreamingMixin, take_in
from .core.request_state import RequestState
from .errors import (
    Busy,
    GenerationFailed,
    InvalidImage,
    InvalidVideo,
    ModelUnavailable,
    PromptTooLong,
    VlscopeError,
)
from .inputs.video import request_videos
from .records.metrics import RequestMetrics, current_rss
from .request import TOOL_CHOICES, ChatRequest, TextChunk
from .records.info import EngineInfo
from .records.store import MetricsStore, open_store
from .records.stages import CANCELLED, DECODE, ERROR, OK, REFUSED, SERVER_FIRST_TOKEN, UPLOAD
from .records.trace import RequestTrace
from .structured.compiler import check_schema, check_tools
from .structured.tool_calls import call_text

log = logging.getLogger(__name__)


def _constrain(request: ChatRequest, config: EngineConfig) -> None:
    """A schema and tools go on to the remote server, which holds its answer to them; they are checked here first,
    as the local engine checks them."""
    if request.tools:
        check_tools(request.tools, config)
    if request.json_schema is not None:
        check_schema(request.json_schema, "the response format's schema", config.max_schema_depth)
    return None


def _tool_choice(choice: str):
    return choice if choice in TOOL_CHOICES else {"type": "function", "function": {"name": choice}}


def _unanswered_call(request: ChatRequest) -> str:
    """The id of the call a tool's result in the prompt answers: the last assistant turn's first call that no tool
    turn after it answered (the prompt carries no id of its own)."""
    answered: set[str] = set()
    for turn in reversed(request.history):
        if turn.role == "tool":
            answered.add(turn.tool_call_id)
        elif turn.role == "assistant" and turn.tool_calls:
            return next((call.id for call in turn.tool_calls if call.id not in answered), "")
    return ""


class RemoteEngine(StreamingMixin):
    def __init__(self, config: EngineConfig, store: MetricsStore | None = None, progress=None):
        self.config = config
        self.store = store if store is not None else open_store(config)
        self.base_url = config.remote_url.rstrip("/")
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, read=600.0), headers=self._headers())
        self._in_flight = 0
        self._lock = threading.Lock()
        started = time.perf_counter()
        (progress or (lambda f, m: None))(0.5, f"Connecting to {self.base_url}")
        try:
            listed = self._client.get(f"{self.base_url}/models")
            listed.raise_for_status()
            names = [m.get("id") for m in listed.json().get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            raise ModelUnavailable(f"The remote server at {self.base_url} did not answer /models ({exc}). "
                                   "Check VLSCOPE_REMOTE_URL and that the server is running.") from None
        self.model_name = config.remote_model or (names[0] if names else "default")
        self.info = EngineInfo(model=f"{self.model_name} @ {self.base_url}", synthetic=False, dtype="remote",
                               threads=0, weight_bytes=0, load_seconds=time.perf_counter() - started,
                               context_length=262144, compute_dtype=None)

    serves_logprobs = False

    def token_text(self, token: int) -> str:
        raise GenerationFailed("a remote backend's token ids cannot be read here")

    def server_metrics(self) -> str | None:
        """The server's /metrics text (a vlscope cluster's labels each replica), or None where it has none."""
        origin = self.base_url.removesuffix("/v1")
        try:
            response = self._client.get(f"{origin}/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    def cluster_records(self, since: float, limit: int) -> tuple[list[RequestMetrics], int] | None:
        """A vlscope cluster's records of every replica (its front's /metrics/records), newest first, and how many
        the window holds; None where the server keeps none to give."""
        origin = self.base_url.removesuffix("/v1")
        try:
            response = self._client.get(f"{origin}/metrics/records", params={"since": since, "limit": limit},
                                        timeout=10.0)
            body = response.json() if response.status_code == 200 else None
            return [RequestMetrics.from_dict(record) for record in body["records"]], int(body["total"])
        except (httpx.HTTPError, ValueError, TypeError, KeyError):
            return None

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.config.remote_api_key}"} if self.config.remote_api_key else {}

    @property
    def queue_depth(self) -> int:
        return self._in_flight

    @property
    def active_sequences(self) -> int:
        """Requests in flight to the remote server (it batches them as it does)."""
        return self._in_flight

    def batch_limit(self) -> int:
        return self.config.max_queue + 1

    def submit(self, request: ChatRequest, cancelled: threading.Event | None = None) -> RequestHandle:
        if request_videos(request):
            raise InvalidVideo("video clips are read by a local model only: this server fronts a remote one")
        state = RequestState(request, self.info, self.config, self.store, cancelled)
        take_in(state, self.config, self._check_room, constrain=_constrain)
        try:
            with self._lock:
                self._check_room()
                self._in_flight += 1
        except Busy as exc:
            state.trace.finish(REFUSED, exc)
            raise
        threading.Thread(target=self._run, args=(state,), name="vlscope-remote", daemon=True).start()
        return RequestHandle(state)

    def close(self) -> None:
        self._client.close()

    def _check_room(self) -> None:
        """The same bound as the local queue: one running, max_queue waiting (here, at the remote server)."""
        if self._in_flight > self.config.max_queue:
            raise Busy(f"{self._in_flight} requests are in flight to the remote server, the limit is "
                       f"{self.config.max_queue + 1}. Try again in a moment.")

    # ---- internals ----------------------------------------------------------------------------------------------

    def _messages(self, state: RequestState) -> list[dict]:
        images = iter(state.images)

        def content(text: str, count: int):
            if not count:
                return text
            parts = []
            for _ in range(count):
                buffer = io.BytesIO()
                next(images).image.save(buffer, format="PNG")
                parts.append({"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}})
            return parts + [{"type": "text", "text": text}]

        def message(role: str, text: str, count: int, calls=(), call_id: str = "") -> dict:
            sent = {"role": role, "content": content(text, count)}
            if calls:
                sent["tool_calls"] = [{"id": call.id or f"call_{index}", "type": "function",
                                       "function": {"name": call.name, "arguments": call.arguments}}
                                      for index, call in enumerate(calls)]
            return sent | ({"tool_call_id": call_id} if role == "tool" else {})

        request = state.request
        messages = [message(t.role, t.text, len(t.images), t.tool_calls, t.tool_call_id) for t in request.history]
        return messages + [message(request.prompt_role, request.prompt, len(request.images),
                                   call_id=_unanswered_call(request))]

    def _run(self, state: RequestState) -> None:
        trace = state.trace
        trace.start()
        error: VlscopeError | None = None
        status = OK
        request, params = state.request, state.params
        body = {"model": self.model_name, "messages": self._messages(state), "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p}
        if params.ignore_eos:
            body["ignore_eos"] = True  # understood by vLLM, llama.cpp and vlscope
        if params.stop:
            body["stop"] = list(params.stop)
        if request.json_schema is not None:  # the remote server holds its answer to the schema
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": json.loads(request.json_schema), "strict": request.strict}}
        if request.tools:  # the remote server holds its calls to the tools' schemas; they come back as calls
            body["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": json.loads(tool.parameters),
                "strict": tool.strict}}
                for tool in request.tools]
            body["tool_choice"] = _tool_choice(request.tool_choice)
            body["parallel_tool_calls"] = request.parallel_tool_calls
        if params.seed is not None:
            body["seed"] = params.seed
        if params.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(params, name):
                body[name] = getattr(params, name)
        rss_before = current_rss()
        try:
            trace.announce(UPLOAD)
            sent = time.perf_counter()
            with self._client.stream("POST", f"{self.base_url}/chat/completions", json=body) as response:
                trace.add(UPLOAD, time.perf_counter() - sent)
                if response.status_code != 200:
                    response.read()
                    raise _remote_error(response)
                status = self._read_stream(state, trace, response)
        except VlscopeError as exc:
            status, error = (REFUSED if isinstance(exc, (InvalidImage, PromptTooLong, Busy)) else ERROR), exc
        except httpx.HTTPError as exc:
            status, error = ERROR, GenerationFailed(f"the remote server failed: {type(exc).__name__}")
        except Exception as exc:  # whatever the remote sent, the request ends with an error and a record
            log.exception("request %s: the remote server's answer could not be read", state.id)
            status, error = ERROR, GenerationFailed(f"the remote server's answer could not be read: "
                                                    f"{type(exc).__name__}")
        finally:
            with self._lock:
                self._in_flight -= 1
        rss = current_rss()
        trace.rss_bytes = (rss_before, max(rss_before, rss), rss)
        try:
            trace.finish(status, error)
        except Exception:  # the record is written whatever the remote sent: without its figures, as an error
            log.exception("request %s: its record could not be built; writing it without the server's figures", state.id)
            trace.server_metrics = None
            trace.finish(ERROR, error or GenerationFailed("the remote server's answer could not be recorded"))

    def _read_stream(self, state: RequestState, trace: RequestTrace, response) -> str:
        started = time.perf_counter()
        chunk_times: list[float] = []
        dropped: list[str] = []
        try:
            return self._read_lines(state, trace, response, started, chunk_times, dropped)
        finally:
            if dropped:
                log.warning("request %s: dropped from the remote server's answer: %s", state.id, "; ".join(dropped[:5]))
                trace.server_metrics = dict(trace.server_metrics or {}, dropped=sorted(set(dropped))[:10])

    def _read_lines(self, state: RequestState, trace: RequestTrace, response, started: float, chunk_times: list[float],
                    dropped: list[str]) -> str:
        calls = RemoteCalls()
        for line in response.iter_lines():
            if state.cancelled.is_set():
                return CANCELLED  # leaving the with-block closes the connection: the server stops too
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                data = json.loads(line[6:])
            except ValueError:
                raise GenerationFailed("the remote server sent a malformed stream line") from None
            if not isinstance(data, dict):
                raise GenerationFailed("the remote server sent a stream line that is not an object")
            if "error" in data:
                error = data["error"]
                if isinstance(error, dict):
                    raise error_from(400, str(error.get("message", "")), error.get("code"))
                raise error_from(400, str(error), None)
            choices = data.get("choices") or []
            for choice in choices if isinstance(choices, list) else []:
                if not isinstance(choice, dict):
                    raise GenerationFailed("the remote server sent a choice that is not an object")
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
                if text is not None and not isinstance(text, str):
                    dropped.append(f"content of type {type(text).__name__}")
                    text = None
                called = calls.read(delta.get("tool_calls") if isinstance(delta, dict) else None, dropped)
                if text or called:
                    chunk_times.append(time.perf_counter())
                    if len(chunk_times) == 1:
                        trace.first_token()
                        trace.announce(DECODE)
                if text:
                    state.events.put(TextChunk(calls.text(finished=True) + text))
                finish = choice.get("finish_reason")
                if finish in ("stop", "length", "tool_calls"):  # the server's word, from its own answers
                    trace.finish_reason = "length" if finish == "length" else "stop"
                    if calls.pending:
                        state.events.put(TextChunk(calls.text(finished=finish != "length")))
            usage = data.get("usage")
            if isinstance(usage, dict):
                prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
                if prompt is None or completion is None:
                    dropped.append("usage with counts that are not numbers")
                trace.prompt_tokens = prompt or trace.prompt_tokens
                trace.output_tokens = completion or trace.output_tokens
            reported = data.get("metrics") or data.get("timings")
            if reported is not None:
                trace.server_metrics = server_metrics(reported, dropped) or trace.server_metrics
        if calls.pending:  # a stream that ended without a finish reason: the calls as far as they came
            state.events.put(TextChunk(calls.text(finished=False)))
        if len(chunk_times) > 1:
            trace.add(DECODE, chunk_times[-1] - chunk_times[0])
            trace.decode_tokens_per_s = (len(chunk_times) - 1) / (chunk_times[-1] - chunk_times[0])
        trace.add(SERVER_FIRST_TOKEN, (chunk_times[0] if chunk_times else time.perf_counter()) - started)
        trace.output_tokens = trace.output_tokens or len(chunk_times)
        trace.vision_tokens = int(_number((trace.server_metrics or {}).get("vision_tokens")) or 0)
        return OK


class RemoteCalls:
    """The remote server's streamed calls (`delta.tool_calls`: a call's name with its first delta, its arguments over
    later ones, by index), gathered until they are whole."""

    def __init__(self):
        self.calls: dict[int, list[str]] = {}  # index: [name, arguments so far]

    @property
    def pending(self) -> bool:
        return bool(self.calls)

    def read(self, deltas, dropped: list[str]) -> bool:
        """Take a delta's calls in; whether it carried any."""
        if deltas is None:
            return False
        if not isinstance(deltas, list):
            dropped.append("tool_calls that are not a list")
            return False
        for delta in deltas:
            function = delta.get("function") if isinstance(delta, dict) else None
            index = delta.get("index", 0) if isinstance(delta, dict) else None
            if not isinstance(function, dict) or isinstance(index, bool) or not isinstance(index, int):
                dropped.append("a tool call delta without an index and a function")
                continue
            call = self.calls.setdefault(index, ["", ""])
            name, arguments = function.get("name"), function.get("arguments")
            call[0] += name if isinstance(name, str) and not call[0] else ""
            call[1] += arguments if isinstance(arguments, str) else ""
        return bool(deltas)

    def text(self, finished: bool) -> str:
        """The gathered calls as the model's own blocks, and forgotten; the last one cut when not `finished`."""
        ordered = [self.calls[index] for index in sorted(self.calls)]
        self.calls.clear()
        return "\n".join(call_text(name, arguments or "{}" if finished else arguments,
                                   finished or number < len(ordered) - 1)
                         for number, (name, arguments) in enumerate(ordered))


STAGE_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def server_metrics(value, dropped: list[str]) -> dict | None:
    """A remote server's own figures (vlscope's `metrics`, llama.cpp's `timings`) as the record keeps them: numbers,
    and `stages` as stage name -> seconds with plain names. Anything else is dropped and named in `dropped`: the
    remote is as untrusted as any client."""
    if value is None:
        return None
    if not isinstance(value, dict):
        dropped.append(f"metrics of type {type(value).__name__}")
        return None
    kept: dict = {}
    for key, item in list(value.items())[:100]:
        if key == "stages":
            if not isinstance(item, dict):
                dropped.append("metrics.stages (not an object)")
                continue
            kept["stages"] = {name: seconds for name, seconds in ((n, _number(s)) for n, s in item.items())
                              if isinstance(name, str) and STAGE_NAME.fullmatch(name) and seconds is not None}
            if len(kept["stages"]) < len(item):
                dropped.append(f"{len(item) - len(kept['stages'])} stage(s) with an odd name or a non-number")
        elif isinstance(key, str) and STAGE_NAME.fullmatch(key) and _number(item) is not None:
            kept[key] = item
        elif key in ("synthetic",) and isinstance(item, bool):
            kept[key] = item
    return kept


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9 else None


def _remote_error(response: httpx.Response) -> VlscopeError:
    try:
        error = response.json().get("error", {})
        message, code = error.get("message") or response.text, error.get("code")
    except ValueError:
        message, code = response.text[:300], None
    return error_from(response.status_code, message, code)


def error_from(status: int, message: str, code: str | None) -> VlscopeError:
    """The engine error a remote server's OpenAI-style error stands for, so callers handle both alike."""
    if status == 429:
        return Busy(f"the remote server is busy: {message}")
    if status in (400, 413):
        if code == "prompt_too_long":
            return PromptTooLong(message)
        return InvalidImage(message) if code in ("invalid_image", "image_too_large") else GenerationFailed(message)
    if status in (401, 403):
        return ModelUnavailable(f"the remote server refused the API key ({status}): {message}")
    return GenerationFailed(f"the remote server answered {status}: {message}")

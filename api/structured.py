"""The OpenAI request's structured-answer fields, `response_format`, `tools`, `tool_choice` and `parallel_tool_calls`,
and the calls of earlier assistant turns, as pydantic models (vLLM's protocol.py), read into the engine's terms."""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import Tool, ToolCall

from .errors import ApiError

NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaSpec(_Lenient):
    name: str = Field(default="answer", pattern=NAME)
    description: str = ""
    schema_: Union[dict, bool] = Field(alias="schema")
    # true: held exactly, or refused. Absent or false: held to the closest grammar, and a finished answer that breaks
    # what the grammar could not hold is flagged (`schema_violations`), as OpenAI reads `strict`.
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionSpec(_Lenient):
    name: str = Field(pattern=NAME)
    description: str = ""
    parameters: dict | None = None  # None: the function takes no arguments (engine.Tool's default)
    strict: bool | None = None


class ToolSpec(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Lenient):
    name: str
    arguments: str


class AssistantToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


def _parsed(model, value, param: str):
    """`value` as `model`, or a 400 that names the field at fault."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in (param, *first["loc"]))
        raise ApiError(400, f"{where}: {first['msg']}", code="invalid_value", param=where) from None


def json_schema(body: dict) -> tuple[str | None, bool]:
    """(the JSON Schema the answer must follow, as JSON text with its properties in the client's order, or None for
    free text; whether it is strict)."""
    value = body.get("response_format")
    if value is None:
        return None, True
    response_format = _parsed(ResponseFormat, value, "response_format")
    if response_format.type == "text":
        return None, True
    if response_format.type == "json_object":
        return '{"type": "object"}', True
    if response_format.json_schema is None:
        raise ApiError(400, "response_format of type json_schema needs a json_schema object with a schema",
                       code="invalid_value", param="response_format")
    spec = response_format.json_schema
    return json.dumps(spec.schema_, ensure_ascii=False), bool(spec.strict)


def tools(body: dict) -> tuple[tuple[Tool, ...], str, bool]:
    """(tools, tool_choice, parallel_tool_calls): tool_choice is none, auto, required or a tool's name."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ApiError(400, f"{legacy} is OpenAI's deprecated form: send tools and tool_choice",
                           code="unsupported_parameter", param=legacy)
    listed = body.get("tools")
    if listed is None:
        listed = []
    if not isinstance(listed, list):
        raise ApiError(400, "tools must be a list of function definitions", code="invalid_type", param="tools")
    specs = [_parsed(ToolSpec, item, f"tools[{index}]") for index, item in enumerate(listed)]
    offered = tuple(Tool(spec.function.name, spec.function.description)
                    if spec.function.parameters is None else
                    Tool(spec.function.name, spec.function.description,
                         json.dumps(spec.function.parameters, ensure_ascii=False), bool(spec.function.strict))
                    for spec in specs)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = _parsed(NamedToolChoice, choice, "tool_choice").function.name
        if name not in {tool.name for tool in offered}:
            raise ApiError(400, f"tool_choice names {name[:64]!r}, which is not among the tools",
                           code="invalid_value", param="tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", code="invalid_value", param="tool_choice")
    if choice != "none" and choice != "auto" and not offered:
        raise ApiError(400, "tool_choice needs tools", code="invalid_value", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", code="invalid_type",
                       param="parallel_tool_calls")
    return offered, choice, parallel


def assistant_calls(message: dict) -> tuple[ToolCall, ...]:
    """The calls an earlier assistant message made, as the model will see them again."""
    listed = message.get("tool_calls")
    if not listed:
        return ()
    if not isinstance(listed, list):
        raise ApiError(400, "an assistant message's tool_calls must be a list", code="invalid_type", param="messages")
    calls = [_parsed(AssistantToolCall, item, "messages") for item in listed]
    return tuple(ToolCall(call.function.name, call.function.arguments, call.id) for call in calls)

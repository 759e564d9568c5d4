"""A finished answer checked against a schema its grammar held only in part (a schema sent without `strict`, whose
keywords no grammar holds were left out of it): what the answer breaks, in words, for its record and the response."""
from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema

from .tool_calls import split_calls

MAX_VIOLATIONS = 5  # named in a record; an answer that breaks more says how many


def _violations(value, schema: dict | bool, prefix: str) -> list[str]:
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    found = []
    for error in validator.iter_errors(value):
        where = "/".join(str(part) for part in error.absolute_path)
        found.append(f"{prefix}{where or '(the whole value)'}: {error.message[:200]}")
    return found


@dataclass(frozen=True)
class AnswerCheck:
    """The schemas an answer is checked against: the response format's, or each function's parameters (by name)."""

    what: str  # "json_schema" or "tool_calls"
    schemas: tuple[tuple[str, str], ...]  # (name, schema as JSON text); one unnamed for a response format

    def violations(self, answer: str) -> tuple[str, ...]:
        if self.what == "json_schema":
            pairs = [("", answer, self.schemas[0][1])]
        else:
            by_name = dict(self.schemas)
            calls = split_calls(answer, frozenset(by_name))[1]
            pairs = [(f"{call.name}: ", call.arguments, by_name[call.name]) for call in calls]
        found = []
        for prefix, text, schema in pairs:
            try:
                found += _violations(json.loads(text), json.loads(schema), prefix)
            except ValueError:
                found.append(f"{prefix}not JSON")
        if len(found) > MAX_VIOLATIONS:
            found = found[:MAX_VIOLATIONS - 1] + [f"and {len(found) - MAX_VIOLATIONS + 1} more"]
        return tuple(found)

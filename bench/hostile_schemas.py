"""Schemas a hostile client sends as a response format or a tool's parameters: each is cheap to send and, taken
naively, costs the server a crash, minutes of compile, gigabytes kept, or a failure mid-answer. The hostile tests
and `python -m bench.soak --hostile` share them."""
from __future__ import annotations


def deep_pattern(groups: int = 600) -> dict:
    """A string whose pattern nests `groups` groups: Python's regex parser recurses once per group."""
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": "(" * groups + "a" + ")" * groups}},
            "required": ["s"]}


def required_self(key: str = "a") -> dict:
    """An object that must contain itself: no finite answer exists."""
    return {"type": "object", "properties": {key: {"$ref": "#"}}, "required": [key]}


def repeated_repeats(letter: str = "q", count: int = 1000) -> dict:
    """A bounded string of a regex whose expansion is a million states (^(q{1000}){1000}$)."""
    return {"type": "object", "required": ["s"],
            "properties": {"s": {"type": "string", "pattern": f"^({letter}{{{count}}}){{{count}}}$"}}}


def many_pattern_properties(count: int = 600) -> dict:
    """An object of `count` patternProperties: the grammar holds every pattern and its complement."""
    return {"type": "object", "patternProperties": {f"^p{index}_[a-z]+$": {"type": "string", "maxLength": 4}
                                                    for index in range(count)}}


def late_explosion(count: int = 400) -> dict:
    """A choice first, then a string whose regex explodes only once the answer reaches it: the grammar builds, and
    gives out while the answer is written."""
    return {"type": "object", "required": ["k", "s"],
            "properties": {"k": {"enum": ["x", "y"]},
                           "s": {"type": "string", "pattern": f"^(q{{{count}}}){{{count}}}$"}}}

"""Whether a text is JSON cut short: a recursive-descent reader that tells "ran out of text" from "went wrong",
written apart from the engine's grammar so that tests check the engine against an independent reader."""
from __future__ import annotations


class _End(Exception):
    """The text ended where more JSON could follow."""


class _Bad(Exception):
    """The text cannot be the start of any JSON value."""


def is_json_prefix(text: str) -> bool:
    """True when some continuation of `text` is one JSON value (the whole value counts too)."""
    reader = _Reader(text)
    try:
        reader.value()
        reader.space()
        return reader.at == len(text)
    except _End:
        return True
    except _Bad:
        return False


class _Reader:
    def __init__(self, text: str):
        self.text, self.at = text, 0

    def peek(self) -> str:
        if self.at >= len(self.text):
            raise _End
        return self.text[self.at]

    def take(self, expected: str | None = None) -> str:
        char = self.peek()
        if expected is not None and char not in expected:
            raise _Bad(f"{char!r} at {self.at}, wanted one of {expected!r}")
        self.at += 1
        return char

    def space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\n\r":
            self.at += 1

    def value(self) -> None:
        self.space()
        char = self.peek()
        if char == "{":
            self.container("}", member=True)
        elif char == "[":
            self.container("]", member=False)
        elif char == '"':
            self.string()
        elif char in "-0123456789":
            self.number()
        else:
            word = next((w for w in ("true", "false", "null") if w[0] == char), None)
            if word is None:
                raise _Bad(char)
            for letter in word:
                self.take(letter)

    def container(self, close: str, member: bool) -> None:
        self.take()
        self.space()
        if self.peek() == close:
            self.take()
            return
        while True:
            if member:
                self.space()
                self.string()
                self.space()
                self.take(":")
            self.value()
            self.space()
            if self.take("," + close) == close:
                return

    def string(self) -> None:
        self.take('"')
        while True:
            char = self.take()
            if char == '"':
                return
            if char == "\\":
                escape = self.take('"\\/bfnrtu')
                if escape == "u":
                    for _ in range(4):
                        self.take("0123456789abcdefABCDEF")
            elif ord(char) < 0x20:
                raise _Bad("control character in a string")

    def number(self) -> None:
        if self.peek() == "-":
            self.take()
        if self.take("0123456789") != "0":
            self.digits()
        if self.at < len(self.text) and self.text[self.at] == ".":
            self.take()
            self.take("0123456789")
            self.digits()
        if self.at < len(self.text) and self.text[self.at] in "eE":
            self.take()
            if self.peek() in "+-":
                self.take()
            self.take("0123456789")
            self.digits()

    def digits(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isdigit():
            self.at += 1

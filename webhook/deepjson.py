"""A JSON decoder without recursion, for the documents pydantic-core's parser refuses as nested too deeply
(it stops at 200 levels; Kubernetes stores objects nested up to 10,000, e.g. opaque driver parameters).

It keeps its own stack of open containers, so its depth is bounded by `max_depth` and the body's size, not by
the C or Python stack. It is slower than pydantic-core's parser, and so used only after that one refused a
document for its depth. Same results: objects as dicts (the last of duplicate keys wins), integers as int,
other numbers as float; NaN and Infinity refused.
"""

from __future__ import annotations

import re
from json.decoder import scanstring
from typing import Any

# kube-apiserver's JSON decoder (sigs.k8s.io/json) refuses documents nested deeper.
KUBERNETES_MAX_DEPTH = 10_000

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class DeepJSONError(ValueError):
    pass


class _Parser:
    def __init__(self, text: str, max_depth: int) -> None:
        self.text, self.max_depth = text, max_depth
        self.pos = 0

    def fail(self, what: str) -> DeepJSONError:
        return DeepJSONError(f"{what} at character {self.pos}")

    def skip(self) -> str:
        """Skips whitespace; the next character, or '' at the end."""
        match = _WHITESPACE.match(self.text, self.pos)
        self.pos = match.end() if match else self.pos
        return self.text[self.pos : self.pos + 1]

    def key(self) -> str:
        if self.skip() != '"':
            raise self.fail("expected a string key")
        value, self.pos = scanstring(self.text, self.pos + 1, True)
        if self.skip() != ":":
            raise self.fail("expected ':'")
        self.pos += 1
        return value

    def scalar(self, char: str) -> Any:
        text = self.text
        if char == '"':
            value, self.pos = scanstring(text, self.pos + 1, True)
            return value
        for literal, value in _LITERALS.items():
            if text.startswith(literal, self.pos):
                self.pos += len(literal)
                return value
        match = _NUMBER.match(text, self.pos)
        if match is None:
            raise self.fail("expected a value")
        self.pos = match.end()
        if match.group(1) is None and match.group(2) is None:
            return int(match.group())
        value = float(match.group())
        if value in (float("inf"), float("-inf")):
            raise self.fail("number out of range")
        return value

    def parse(self) -> Any:
        # Each open container with, for an object, the key its next value goes under.
        stack: list[tuple[dict[str, Any] | list[Any], str]] = []
        while True:
            char = self.skip()
            value: Any
            if char in ("{", "["):
                if len(stack) >= self.max_depth:
                    raise self.fail(f"nested deeper than {self.max_depth} levels")
                self.pos += 1
                close = "}" if char == "{" else "]"
                if self.skip() != close:
                    if char == "{":
                        stack.append(({}, self.key()))
                    else:
                        stack.append(([], ""))
                    continue
                self.pos += 1
                value = {} if char == "{" else []
            else:
                value = self.scalar(char)
            # A value is complete: put it into its container, closing every container that ends here.
            while True:
                if not stack:
                    if self.skip():
                        raise self.fail("extra data after the document")
                    return value
                container, key = stack[-1]
                if isinstance(container, dict):
                    container[key] = value
                else:
                    container.append(value)
                char = self.skip()
                self.pos += 1
                if char == ",":
                    if isinstance(container, dict):
                        stack[-1] = (container, self.key())
                    break
                if char != ("}" if isinstance(container, dict) else "]"):
                    self.pos -= 1
                    raise self.fail("expected ',' or the end of the container")
                stack.pop()
                value = container


def loads(body: bytes, max_depth: int = KUBERNETES_MAX_DEPTH) -> Any:
    """Decodes UTF-8 JSON `body`; DeepJSONError (a ValueError) says what is wrong and where."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DeepJSONError(f"not UTF-8: {exc}") from None
    try:
        return _Parser(text, max_depth).parse()
    except ValueError as exc:  # scanstring's errors: bad escapes, control characters, unterminated strings
        raise exc if isinstance(exc, DeepJSONError) else DeepJSONError(str(exc)) from None

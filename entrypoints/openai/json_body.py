"""Request bodies parsed as JSON within limits, so that no hostile body reaches pydantic or the
engine: nesting depth, integer length, NaN/Infinity, floats that overflow and strings that are not
valid UTF-8 (lone surrogate escapes) are each a 400, naming the field where there is one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from dsv4ray.entrypoints.openai.errors import bad_request

MAX_JSON_DEPTH = 64  # a request needs 4 levels (messages, a message, content parts, a part)
MAX_INT_DIGITS = 40  # int64 needs 19; longer ones are refused before Python parses them
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LONG_DIGITS = re.compile(r"\d{" + str(MAX_INT_DIGITS + 1) + ",}")


def load_json(text: str) -> Any:
    """json.loads within limits: nesting at most ``MAX_JSON_DEPTH`` (checked before parsing, so
    no recursion limit is reached); NaN, Infinity, numbers that overflow a float and integers
    of more than ``MAX_INT_DIGITS`` digits parse to ``_BadLiteral`` markers that
    ``find_bad_value`` reports with their field."""
    skeleton = _JSON_STRING.sub('""', text)  # brackets and digits inside strings do not count
    if _nesting_depth(skeleton) > MAX_JSON_DEPTH:
        raise bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    hooks = {"parse_constant": _constant, "parse_float": _float}
    if _LONG_DIGITS.search(skeleton):  # the slow hook only when an integer may be too long
        hooks["parse_int"] = _int
    try:
        return json.loads(text, **hooks)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _nesting_depth(skeleton: str) -> int:
    brackets = _NOT_BRACKET.sub("", skeleton).encode("ascii")
    if len(brackets) <= MAX_JSON_DEPTH:
        return len(brackets)
    # a running sum of +1 per opening and -1 per closing bracket, in C: bodies may be 1 MiB
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


class _BadLiteral:
    """A JSON number this server refuses, kept in place so the error can name its field."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _constant(name: str) -> _BadLiteral:
    return _BadLiteral(f"{name} is not valid JSON (numbers must be finite)")


def _float(literal: str) -> float | _BadLiteral:
    value = float(literal)
    return value if math.isfinite(value) else _BadLiteral(f"{literal[:20]} overflows a float")


def _int(literal: str) -> int | _BadLiteral:
    num_digits = len(literal.lstrip("-"))
    if num_digits > MAX_INT_DIGITS:
        return _BadLiteral(f"an integer of {num_digits} digits (at most {MAX_INT_DIGITS})")
    return int(literal)


def find_bad_value(data: dict) -> tuple[str, str] | None:
    """(field path, reason) of a value that must not reach the engine: a ``_BadLiteral``, or a
    string or key that is not valid UTF-8 (a lone surrogate from a ``\\ud800`` escape). The path
    joins keys and list indices with dots (``messages.0.content``); a bad key names its
    parent ("" at the top level)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return path, "the string is not valid UTF-8 (a lone surrogate escape?)"
        elif isinstance(value, _BadLiteral):
            return path, value.reason
        elif isinstance(value, dict):
            if not all(_is_utf8(key) for key in value):
                return path, "a key is not valid UTF-8 (a lone surrogate escape?)"
            stack.extend((_join(path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list) and not all(type(v) is int for v in value):
            stack.extend((_join(path, str(i)), v) for i, v in reversed(list(enumerate(value))))
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

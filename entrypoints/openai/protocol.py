"""The OpenAI wire format at the HTTP edge: request models, their sampling parameters, errors.

Pydantic lives here and nowhere deeper: a parsed request becomes a plain ``SamplingParams`` and a
prompt, and every failure becomes an ``APIError`` that renders OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Fields the API defines but this server does
not implement (``n`` > 1, ``echo``, penalties, ``logit_bias``, ...) are refused by name rather than
silently ignored; unknown extra fields are ignored, as OpenAI-compatible servers do.
Extensions: ``top_k``, ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids`` (the choice
then carries the generated ``token_ids``; each stream chunk carries its new ones).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dsv4ray.engine.sampling import MAX_LOGPROBS, SamplingParams

MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 1024  # every plan of the request carries them to the last stage
INT64_MAX = 2**63 - 1  # seeds and ids travel to the stages as msgpack int64s
MAX_JSON_DEPTH = 64  # a request needs 4 levels (messages, a message, content parts, a part)
MAX_INT_DIGITS = 40  # int64 needs 19; longer ones are refused before Python parses them
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LONG_DIGITS = re.compile(r"\d{" + str(MAX_INT_DIGITS + 1) + ",}")


class APIError(Exception):
    """An HTTP error with OpenAI's body; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class _Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; JSON types must match the API's
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        items = [stop] if isinstance(stop, str) else stop
        if stop is not None and (
            not isinstance(items, list)
            or not 0 < len(items) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in items)
        ):
            raise ValueError(f"stop must be a string or a list of 1 to {MAX_STOP_STRINGS} strings")
        return stop

    def check_supported(self) -> None:
        if self.n != 1:
            raise bad_request("only n = 1 is supported", "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise bad_request(f"{name} is not supported (use 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream = true", "stream_options")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE}]", "temperature")
        for name, values in (
            ("seed", [self.seed or 0]),
            ("top_k", [self.top_k]),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            if any(not -INT64_MAX <= v <= INT64_MAX for v in values):
                raise bad_request(f"{name} must fit in a signed 64-bit integer", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """OpenAI's defaults for omitted fields (temperature 1, top_p 1); a bad value is a 400
        naming the field (SamplingParams' messages start with it)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                logprobs=logprobs,
                ignore_eos=self.ignore_eos,
            )
        except ValueError as exc:
            raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None


class CompletionRequest(_GenerationRequest):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int]:
        """A string or a token-id list; a batch of exactly one of those is unwrapped."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("one prompt per request: batches of several prompts are not supported")
        raise ValueError("prompt must be a string or a non-empty list of token ids")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of = 1 is supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_request(model_cls: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
    """Body bytes -> a validated request. Invalid UTF-8, malformed or too deeply nested JSON,
    NaN/Infinity, overlong integers, lone surrogate escapes and bad fields are 400s."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 ({exc.reason})") from None
    data = load_json(text)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    bad = find_bad_value(data)
    if bad is not None:
        path, reason = bad
        raise bad_request(f"{path}: {reason}" if path else reason, path or None)
    try:
        request = model_cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check_supported()
    return request


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


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    # union members add their type to the location ("content.str"); users know only fields
    loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = "a required field is missing"
    return bad_request(f"{'.'.join(loc)}: {msg}", loc[0] if loc else None)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

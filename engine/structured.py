"""Structured output: a request's constraint (``SamplingParams.structured_output``) as a grammar
of llguidance, the library whose matcher the last stage advances token by token and whose
token mask it applies before each draw (worker/sampling/grammar.py).

    {"json": schema}        the output is JSON that the schema accepts (a dict or its text)
    {"json_object": True}   the output is a JSON object
    {"regex": pattern}      the output matches the regular expression
    {"choice": [a, b, ...]} the output is one of the strings
    {"grammar": lark}       the output is a sentence of the Lark grammar

With ``"after_token": id`` beside the kind, the constraint applies to what follows the first
such token drawn (a thinking answer's ``</think>``: its reasoning is free).

A schema is read as JSON Schema reads it (an object may hold properties it does not name unless
``additionalProperties`` is false). JSON comes out in one line, items separated by ", " and keys
by ": " (``JSON_LAYOUT``; a schema's ``x-guidance`` options, llguidance's, may ask for another).
The grammar is compiled and checked when the request arrives, so a bad one is the request's
ValueError (a 400 over HTTP), never a stage's failure.
"""

from __future__ import annotations

import functools
import json
import re

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar(spec: dict) -> str:
    """The llguidance grammar of a constraint; ValueError naming what is wrong. A request's
    constraint is compiled where it is checked (HTTP layer, engine) and again by the last stage;
    the same constraint text compiles once per process (agents resend one tool list per turn)."""
    try:
        key = json.dumps(spec, allow_nan=False)  # key order kept: it orders the JSON written
    except (TypeError, ValueError):  # not JSON: compiled uncached, its error named there
        return _compile(spec)
    return _compiled(key)


@functools.lru_cache(maxsize=256)
def _compiled(key: str) -> str:
    return _compile(json.loads(key))


def _compile(spec: dict) -> str:
    from llguidance import LLMatcher

    kind = next(k for k in spec if k != "after_token")
    value = spec[kind]
    if kind == "json":
        text = grammar_from_schema(value)
    elif kind == "json_object":
        text = grammar_from_schema({"type": "object"})
    elif kind == "regex":
        text = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        text = LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
    else:
        text = LLMatcher.grammar_from_lark(value)
    problem = LLMatcher.validate_grammar(text)
    if problem:
        raise ValueError(f"structured_output.{kind} is not a grammar this server can follow: "
                         f"{problem}"[:500])  # fmt: skip
    return text


def schema_dict(schema) -> dict:
    """A ``json`` constraint's schema as a dict (it may come as its text); ValueError naming
    it when it is neither."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_output.json is not JSON: {exc.msg}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_output.json must be a JSON schema object")
    return schema


def grammar_from_schema(schema) -> str:
    from llguidance import LLMatcher

    schema = schema_dict(schema)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise ValueError(f"structured_output.json: {exc}"[:500]) from None

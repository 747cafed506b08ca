"""Jinja chat templates rendered the way transformers renders them: a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks``, loop controls (``break`` / ``continue``), the
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, and the globals
``raise_exception`` and ``strftime_now``. A template that raises, or fails to render, raises
``ChatTemplateError`` (a ValueError) with the template's message."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template refused the messages or could not render them."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses the tag to
    mark assistant tokens for training masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from None


def render(source: str, **context) -> str:
    try:
        return compile_template(source).render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None

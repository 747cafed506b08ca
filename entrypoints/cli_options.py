"""Command-line flags generated from EngineConfig, so that every engine option is a flag.

Each field becomes ``--field-name`` (``max_num_batched_tokens`` -> ``--max-num-batched-tokens``);
booleans also get ``--no-field-name``. The help text is the field's comment in engine/config.py
(on its line, else the comment lines above it), so a field added there shows up here with its
words. Flags left out stay out of the options, and the config's defaults apply.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize

from dsv4ray.cache.formats import DTYPES as KV_DTYPES
from dsv4ray.cache.hicache import WRITE_POLICIES
from dsv4ray.engine.config import INTERNAL_OPTIONS, EngineConfig

# conventional spellings beside the generated one (vLLM and SGLang users type these)
ALIASES = {
    "pp_size": ("--pp", "--pipeline-parallel-size", "-pp"),
    "prefill_pp_size": ("--prefill-pp",),
}
CHOICES = {"kv_cache_dtype": KV_DTYPES, "hicache_write_policy": WRITE_POLICIES}
# model: a positional argument or --model, per subcommand; draft_rings: set for prefill engines
NOT_FLAGS = ("model", *INTERNAL_OPTIONS)


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FLAGS]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, in an "engine options" group."""
    group = parser.add_argument_group("engine options (EngineConfig; defaults in brackets)")
    comments = field_comments(EngineConfig)
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs = _value_kwargs(f)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = comments.get(f.name) or f"EngineConfig.{f.name}"
        group.add_argument(
            flag,
            *ALIASES.get(f.name, ()),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f"{help_text} [{default}]".replace("%", "%%"),
            **kwargs,
        )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (by field name)."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}


def _value_kwargs(f: dataclasses.Field) -> dict:
    """How a field's value is parsed, from its annotation (a string under postponed
    annotations): bools are on/off flags, ints and floats parse as such, ``str | bool`` takes
    true/false or text, anything else a JSON value or else text."""
    names = {part.strip() for part in str(f.type).split("|")} - {"None"}
    if names == {"bool"}:
        return {"action": argparse.BooleanOptionalAction}
    kwargs = {"metavar": f.name.upper()}
    if f.name in CHOICES:
        return {"choices": list(CHOICES[f.name])}
    if names == {"int"}:
        kwargs["type"] = int
    elif names == {"float"}:
        kwargs["type"] = float
    elif names == {"str", "bool"}:
        kwargs["type"] = _str_or_bool
    elif names != {"str"}:
        kwargs["type"] = _json_or_text
    return kwargs


def _str_or_bool(text: str) -> str | bool:
    return {"true": True, "false": False}.get(text.lower(), text)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its line, else the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether the line is only it)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.strip().startswith("#")
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    (klass,) = ast.parse(source).body
    found = {}
    for node in klass.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text, alone = comments.get(node.end_lineno, ("", True))
        if not text or alone:
            above, line = [], node.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            text = " ".join(above)
        found[node.target.id] = text
    return found

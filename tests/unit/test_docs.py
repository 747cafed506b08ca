"""The documentation holds together: every relative link in README.md and docs/ reaches a file
(and a heading, for #anchors), every ``dsv4ray`` command in their bash blocks parses with the real
command-line parser (so a documented flag that the CLI drops fails here), and the README stays
short."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from dsv4ray.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_BYTES = 15_000

FENCE = re.compile(r"^(```|~~~)(.*)$")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
SEPARATORS = {"&&", "||", ";", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the lines outside fenced blocks, [(language, lines) of each fenced block])."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if block is None and fence:
            block = (fence.group(2).strip().lower(), [])
        elif block is not None and fence and not fence.group(2).strip():
            blocks.append(block)
            block = None
        elif block is not None:
            block[1].append(line)
        else:
            prose.append(line)
    assert block is None, "a fenced block is not closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = text.lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"
    )  # letters, numbers, spaces, hyphens, underscores
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def relative_links(path: Path) -> list[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    text = INLINE_CODE.sub("", "\n".join(prose))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def link_problem(source: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``source``) does not resolve, or None."""
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    if not dest.exists():
        return f"{target}: no such file"
    if not dest.is_relative_to(ROOT):
        return f"{target}: outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{target}: no heading #{anchor} in {_rel(dest)}"
    return None


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_relative_link_resolves(path):
    problems = [p for t in relative_links(path) if (p := link_problem(path, t))]
    assert not problems, "\n".join(problems)


def test_the_link_check_catches_a_missing_file_and_a_missing_heading():
    assert link_problem(README, "docs/index.md") is None
    assert link_problem(README, "docs/no-such-page.md") is not None
    assert link_problem(README, "docs/guide/serving.md#metrics-and-the-dashboard") is None
    assert link_problem(README, "docs/guide/serving.md#no-such-heading") is not None
    assert slug("Prefill/decode disaggregation over Mooncake") == (
        "prefilldecode-disaggregation-over-mooncake"
    )
    assert slug("On GPUs: CUDA graphs, `fused` kernels") == "on-gpus-cuda-graphs-fused-kernels"


def shell_commands(lines: list[str], lang: str) -> list[str]:
    """The block's command lines, backslash continuations joined (console: '$ ' lines only)."""
    commands, pending = [], ""
    for raw in lines:
        line = raw.rstrip()
        if lang == "console":
            if not pending and not line.startswith("$ "):
                continue  # output
            if not pending:
                line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append(pending + line)
        pending = ""
    if pending:
        commands.append(pending)
    return [c.strip() for c in commands if c.strip()]


def dsv4ray_argv(command: str) -> list[list[str]]:
    """The argument lists of every dsv4ray invocation in a shell command line: `dsv4ray ...`,
    `python -m dsv4ray ...`, after environment assignments or `--` (ray job submit)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    found, segment = [], []
    for word in [*words, ";"]:
        if word not in SEPARATORS:
            segment.append(word)
            continue
        while segment and ASSIGNMENT.match(segment[0]):
            segment.pop(0)
        for i, word in enumerate(segment):
            if word == "dsv4ray" and _invokes(segment[:i]):
                found.append(segment[i + 1 :])
                break
        segment = []
    return found


def _invokes(head: list[str]) -> bool:
    """Whether the words before a `dsv4ray` make it the command: nothing, a `--` that ends
    another command's options, or `python -m`."""
    if not head or head[-1] == "--":
        return True
    return len(head) >= 2 and head[-1] == "-m" and Path(head[-2]).name.startswith("python")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(file, command line, dsv4ray argv) of every dsv4ray command in the docs' shell blocks."""
    found = []
    for path in DOCS:
        _, blocks = split_fences(path.read_text(encoding="utf-8"))
        for lang, lines in blocks:
            if lang not in SHELL_LANGS:
                continue
            for command in shell_commands(lines, lang):
                for argv in dsv4ray_argv(command):
                    found.append((_rel(path), command, argv))
    return found


def strict_parser() -> argparse.ArgumentParser:
    """The real parser with abbreviations off everywhere: a documented `--prefill-pp` must be a
    flag of its own, not a prefix that happens to match a longer one."""
    parser = build_parser()
    stack = [parser]
    while stack:
        p = stack.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return parser


def parse_problem(argv: list[str]) -> str | None:
    """Why the real CLI refuses argv, or None when it parses (nothing runs)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            strict_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("-h" in argv or "--help" in argv):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {exc.code}"
    return None


COMMANDS = documented_commands()


@pytest.mark.parametrize(
    "where,command,argv", COMMANDS, ids=[f"{w}: {c[:60]}" for w, c, _ in COMMANDS]
)
def test_every_documented_command_parses(where, command, argv):
    problem = parse_problem(argv)
    assert problem is None, f"{where}: {command}\n{problem}"


def test_the_docs_show_every_subcommand():
    assert {argv[0] for _, _, argv in COMMANDS if argv} >= {"generate", "job", "serve", "make-tiny"}


def test_the_parse_check_refuses_unknown_and_abbreviated_flags():
    assert parse_problem(["serve", ".tiny", "--pp", "2"]) is None
    assert parse_problem(["serve", ".tiny", "--no-such-flag"]) is not None
    assert parse_problem(["serve", ".tiny", "--speculative-num"]) is not None  # an abbreviation
    assert parse_problem(["job", "--input", "in.jsonl"]) is not None  # --output is required
    assert dsv4ray_argv("RAY_ADDRESS=h:6379 dsv4ray serve m -pp 2 --accelerator gpu") == [
        ["serve", "m", "-pp", "2", "--accelerator", "gpu"]
    ]
    assert dsv4ray_argv("ray job submit --address x -- dsv4ray job --replicas 4  # note") == [
        ["job", "--replicas", "4"]
    ]
    assert dsv4ray_argv(".venv/bin/python -m dsv4ray make-tiny --out d && echo dsv4ray") == [
        ["make-tiny", "--out", "d"]
    ]
    assert dsv4ray_argv("pip install dsv4ray") == []
    assert shell_commands(["a \\", "  b", "c"], "bash") == ["a    b", "c"]
    assert shell_commands(["$ dsv4ray serve", "output"], "console") == ["dsv4ray serve"]


def test_the_readme_is_short():
    size = README.stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


def option_table() -> dict[str, str]:
    """{option: default cell} of the "LLM options" table in docs/guide/configuration.md."""
    text = (ROOT / "docs" / "guide" / "configuration.md").read_text()
    section = text.split("## LLM options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M)
    return {name: cell.strip() for name, cell in rows}


def matches_default(cell: str, value) -> bool:
    """Whether a table cell states this default: strings quoted in code, numbers by value,
    other values (None, True, False) as Python writes them."""
    if isinstance(value, str):
        return cell == f'`"{value}"`'
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(cell.replace(",", "")) == value
    return cell == str(value)


def test_the_configuration_table_lists_every_option_with_its_default():
    import dataclasses

    from dsv4ray.engine.config import EngineConfig

    table = option_table()
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    from dsv4ray.engine.config import INTERNAL_OPTIONS

    set_by_the_engine = set(INTERNAL_OPTIONS)  # not user options: explained below the table
    assert set(table) == set(fields) - set_by_the_engine
    for name, cell in table.items():
        default = fields[name].default
        if default is dataclasses.MISSING:
            assert cell == "(required)", name
        else:
            assert matches_default(cell, default), (name, cell, default)

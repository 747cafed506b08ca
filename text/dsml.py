"""DeepSeek-V4's tool-call language (DSML): tools rendered into the system prompt, calls
rendered into an assistant turn, generated calls parsed back, and the grammar that forces a call.

A call block, as the model writes it after its answer's text (``\\n\\n`` before the block)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A ``string="true"`` value is the string as is; a ``string="false"`` one is JSON. Invokes are
joined by a newline, as are the parameters of one invoke (an invoke without parameters has an
empty line). Tool results come back in a user turn as ``<tool_result>...</tool_result>`` blocks.

``CallParser`` reads generated text as it streams: text before a block is text, each complete
invoke is a call (checked by the caller's ``check``), and anything it cannot read as a call, from
that invoke on, is given back as text, as it was generated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

CALLS_START, CALLS_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
INVOKE_OPEN, INVOKE_END = '<｜DSML｜invoke name="', "</｜DSML｜invoke>"
PARAM_OPEN, PARAM_END = '<｜DSML｜parameter name="', "</｜DSML｜parameter>"
BEFORE_CALLS = "\n\n"  # between an answer's text and its call block
NL = "\n"
_PARAM_HEAD = re.compile(r'<｜DSML｜parameter name="([^"\n>]*)" string="(true|false)">')
_INVOKE_HEAD = re.compile(r'<｜DSML｜invoke name="([^"\n>]+)">')

_TOOLS_TEXT = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), \
pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), \
you MUST output your complete reasoning inside <think>...</think> \
BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: list[dict]) -> str:
    """The system prompt's tool section; functions: OpenAI ``function`` objects."""
    return _TOOLS_TEXT.replace("{schemas}", "\n".join(to_json(f) for f in functions))


def render_calls(calls: list[tuple[str, dict]]) -> str:
    """(name, arguments) pairs -> a call block."""
    invokes = []
    for name, arguments in calls:
        params = [
            f'{PARAM_OPEN}{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else to_json(value)}{PARAM_END}"
            for key, value in arguments.items()
        ]
        invokes.append(f'{INVOKE_OPEN}{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}")
    return f"{CALLS_START}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


def render_result(content: str) -> str:
    return f"<tool_result>{content}</tool_result>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class CallParser:
    """Generated text -> events: ``("text", str)`` and ``("call", ToolCall)``, in order.

    check(name, arguments) -> the arguments to keep, or a string saying why the call is not
    valid (then the call and everything after it is text). Whitespace before a block is dropped
    with it; ``finish`` gives back what is still held (an unfinished block, as text).
    """

    def __init__(self, check: Callable[[str, dict], dict | str]) -> None:
        self._check = check
        self._state = "text"  # "text" | "block" | "raw" (all further text is text)
        self._held = ""  # text: a possible start of a block; block: its unread rest
        self._block_raw = ""  # block: the block's text so far (given back if no call came)
        self.num_calls = 0
        self.problem: str | None = None  # why the last unreadable block was given back

    def push(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        self._held += text
        while True:
            if self._state == "raw":
                self._emit_text(events, self._take_all())
                return events
            if self._state == "text" and not self._scan_text(events):
                return events
            if self._state == "block" and not self._scan_block(events):
                return events

    def finish(self) -> list[tuple]:
        """The end of the text: what is held back is text (an unfinished block included)."""
        events: list[tuple] = []
        if self._state == "block":
            if not self._block_raw and not self._held.strip():
                self._held = ""  # after its last call only the block's line breaks: no text
            self._give_back(events, "the call block is not finished")
        self._emit_text(events, self._take_all())
        return events

    def _scan_text(self, events: list) -> bool:
        """Emits text up to a block's start; True when a block starts."""
        found = self._held.find(CALLS_START)
        if found >= 0:
            before = self._held[:found]
            self._emit_text(events, before.rstrip())
            self._block_raw = before[len(before.rstrip()) :] + CALLS_START
            self._held = self._held[found + len(CALLS_START) :]
            self._state = "block"
            return True
        keep = _partial_len(self._held, CALLS_START)
        head = self._held[: len(self._held) - keep]
        text = head.rstrip()  # whitespace is held: it is dropped if a block follows
        self._emit_text(events, text)
        self._held = self._held[len(text) :]
        return False

    def _scan_block(self, events: list) -> bool:
        """Reads invokes; True when the block ended (or was given back) and scanning goes on."""
        while True:
            rest = self._held.lstrip()
            skipped = len(self._held) - len(rest)
            if rest.startswith(CALLS_END):
                self._consume(skipped + len(CALLS_END))
                self._state = "text"
                return True
            if rest.startswith(INVOKE_OPEN):
                read = _read_invoke(rest)
                if read is None:
                    return False  # the invoke is not finished
                length, call = read
                if isinstance(call, ToolCall):
                    checked = self._check(call.name, call.arguments)
                    call = ToolCall(call.name, checked) if isinstance(checked, dict) else checked
                if not isinstance(call, ToolCall):
                    self._give_back(events, call)
                    return True
                self._consume(skipped + length)
                self.num_calls += 1
                events.append(("call", call))
                continue
            if CALLS_END.startswith(rest) or INVOKE_OPEN.startswith(rest):
                return False  # a tag may be arriving
            self._give_back(events, "the call block holds something other than invokes")
            return True

    def _consume(self, length: int) -> None:
        self._block_raw = ""  # after a call, only the unread rest would be given back
        self._held = self._held[length:]

    def _give_back(self, events: list, why: str) -> None:
        """An unreadable call: the block's unread text (all of it if no call came) is text."""
        self.problem = why
        self._emit_text(events, self._block_raw + self._take_all())
        self._block_raw = ""
        self._state = "raw"

    def _take_all(self) -> str:
        text, self._held = self._held, ""
        return text

    @staticmethod
    def _emit_text(events: list, text: str) -> None:
        if not text:
            return
        if events and events[-1][0] == "text":
            events[-1] = ("text", events[-1][1] + text)
        else:
            events.append(("text", text))


def _read_invoke(text: str) -> tuple[int, ToolCall | str] | None:
    """An invoke at the start of ``text`` -> (its length, the call or why it is unreadable);
    None while it is unfinished. A value is read up to its own end tag, so it may hold an
    invoke's end tag."""
    head = _head(_INVOKE_HEAD, text)
    if head is _WAIT:
        return None
    if head is None:
        return len(text), "an invoke's name is unreadable"
    pos, arguments = head.end(), {}
    while True:
        rest = text[pos:].lstrip()
        pos = len(text) - len(rest)
        if rest.startswith(INVOKE_END):
            return pos + len(INVOKE_END), ToolCall(head.group(1), arguments)
        if not rest.startswith(PARAM_OPEN):
            if INVOKE_END.startswith(rest) or PARAM_OPEN.startswith(rest):
                return None
            return len(text), "an invoke holds something other than parameters"
        param = _head(_PARAM_HEAD, rest)
        if param is _WAIT:
            return None
        if param is None:
            return len(text), "a parameter's name or string flag is unreadable"
        end = rest.find(PARAM_END, param.end())
        if end < 0:
            return None
        name, raw = param.group(1), rest[param.end() : end]
        if name in arguments:
            return len(text), f"parameter {name!r} is given twice"
        try:
            arguments[name] = raw if param.group(2) == "true" else json.loads(raw)
        except json.JSONDecodeError:
            return len(text), f"parameter {name!r} is not JSON"
        pos += end + len(PARAM_END)


_WAIT = object()


def _head(pattern: re.Pattern, text: str):
    """A tag's head at the start of ``text``: its match once its ``>`` has come, None if it is
    unreadable, _WAIT before."""
    close = text.find(">")
    if close < 0:
        return _WAIT
    match = pattern.match(text)
    return match if match and match.end() == close + 1 else None


def _partial_len(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_AS_TEXT, _AS_JSON = '" string="true">', '" string="false">'  # a parameter head's ending


def no_call_grammar() -> str:
    """A Lark grammar (llguidance's dialect) of an answer without a call block: any text in which
    ``CALLS_START`` never appears (tool_choice "none": the tools are in the prompt, no call is
    made). The answer may end wherever the model ends it."""
    return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{_re(CALLS_START)}.*)/"


def call_grammar(functions: list[dict], one_call: bool, layout: dict) -> str:
    """A Lark grammar (llguidance's dialect) of an answer that is a call block and nothing else:
    one invoke (``one_call``) or more, of the given functions, each with the parameters its
    schema declares (required ones always, in the schema's order), string values as text and
    others as JSON of their schema (``layout``: llguidance's JSON layout options). A thinking
    answer's reasoning comes before it, unconstrained (engine/structured.py's after_token)."""
    return "\n".join(["start: calls", *_block_rules(functions, one_call, layout)])


def calls_or_json_grammar(functions: list[dict], one_call: bool, layout: dict,
                          schema: dict) -> str:  # fmt: skip
    """A Lark grammar of an answer that is either a call block (as ``call_grammar``) or JSON
    that ``schema`` accepts (tools the model may call beside a structured final answer)."""
    answer = to_json({"x-guidance": layout, **schema}).replace("\n", " ")
    rules = _block_rules(functions, one_call, layout)
    return "\n".join(["start: calls | answer", f"answer: %json {answer}", *rules])


def _block_rules(functions: list[dict], one_call: bool, layout: dict) -> list[str]:
    """The rules of ``calls``: a call block, the answer's text before it left out."""
    invokes = '(invoke "\\n")' + ("" if one_call else "+")
    rules = [
        f"calls: {_lit(BEFORE_CALLS + CALLS_START + NL)} {invokes} {_lit(CALLS_END)}",
        "invoke: " + " | ".join(f"f{i}" for i in range(len(functions))),
        f"text[lazy]: /(.|\\n)*{_re(PARAM_END)}/",  # a string value and its end tag
        f'any_param: {_lit(PARAM_OPEN)} /[^"\\n>]+/ ({_lit(_AS_TEXT)} text'
        f" | {_lit(_AS_JSON)} %json {{}} {_lit(PARAM_END)})",
    ]
    for i, function in enumerate(functions):
        args, params = _args_rule(i, function.get("parameters") or {}, layout)
        head = _lit(INVOKE_OPEN + function["name"] + '">' + NL)
        rules.append(f"f{i}: {head} {args} {_lit(INVOKE_END)}")
        rules.extend(params)
    return rules


def parameters_of(schema: dict) -> dict[str, dict] | None:
    """The parameters a call writes for an object schema, in order: its declared properties
    (a boolean subschema true as any value; false ones are left out: no value fits them), then
    required names it does not declare, whose values are those of additionalProperties (any
    value when that is not a schema); None when the schema declares none."""
    props = schema.get("properties")
    if not isinstance(props, dict) and not schema.get("required"):
        return None
    props = props if isinstance(props, dict) else {}
    out = {name: {} if prop is True else prop for name, prop in props.items() if prop is not False}
    extra = schema.get("additionalProperties")
    for name in schema.get("required") or ():
        if name not in props:
            out[name] = extra if isinstance(extra, dict) else {}
    return out


def _args_rule(index: int, schema: dict, layout: dict) -> tuple[str, list[str]]:
    """The arguments of function ``index``: each parameter followed by a newline (a lone newline
    when there are none), and the rules of its parameters."""
    params = parameters_of(schema)
    if params is None:  # no declared parameters: any, if the schema allows them
        closed = schema.get("additionalProperties") is False
        return ('"\\n"' if closed else '((any_param "\\n")+ | "\\n")'), []
    required = set(schema.get("required") or ())
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    seq, rules = [], []
    for j, (name, prop) in enumerate(params.items()):
        rule = f"f{index}_p{j}"
        rules.append(f"{rule}: {_param_rule(name, {**prop, **shared}, layout)}")
        seq.append(f'{rule} "\\n"' if name in required else f'({rule} "\\n")?')
    body = " ".join(seq) or '"\\n"'
    return (body if required or not seq else f'({body} | "\\n")'), rules


# what a schema may hold for its strings to be written as text (string="true"): anything else
# (a pattern, a length, const, anyOf / allOf / oneOf, $ref, ...) the text form cannot keep to, so
# its values are JSON, which the grammar's %json holds to the schema (the parser reads a
# string="false" value as JSON)
_TEXT_KEYS = {"type", "enum", "description", "title", "default", "examples", "format", "$defs",
              "definitions"}  # fmt: skip


def _param_rule(name: str, schema: dict, layout: dict) -> str:
    """A parameter as text (a string schema) or JSON (any other, or a string schema with
    checks the text form cannot keep), or either (no type)."""
    head = PARAM_OPEN + name
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    forms = []
    as_text = set(schema) <= _TEXT_KEYS
    if (kinds is None or "string" in kinds) and as_text:
        strings = [v for v in schema.get("enum") or () if isinstance(v, str)]
        value = f"({' | '.join(map(_lit, strings))}) {_lit(PARAM_END)}" if strings else "text"
        forms.append(f"{_lit(head + _AS_TEXT)} {value}")
    if kinds is None or any(k != "string" for k in kinds) or not as_text:
        as_json = to_json({**schema, "x-guidance": layout}).replace("\n", " ")
        forms.append(f"{_lit(head + _AS_JSON)} %json {as_json} {_lit(PARAM_END)}")
    return " | ".join(forms)


def _re(text: str) -> str:
    """``text`` inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)

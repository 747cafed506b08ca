"""Tool calls for the chat entrypoints (the OpenAI server, batch jobs, ``LLM.chat``): a request's
tools in OpenAI's shape, checked; the functions the chat format renders; the grammar that forces
a call when the choice asks for one; the answer's calls parsed (text/dsml.py) and their
arguments checked against their tool's schema.

    tools                [{"type": "function", "function": {"name", "description",
                          "parameters" (a JSON schema of an object), "strict"}}]
    tool_choice          "auto" (the default with tools: the model decides; beside a JSON
                          structured output, a grammar allows a call block or that JSON),
                          "none" (the tools rendered, as context, and a grammar keeps any call
                          block out of the answer), "required" (a call block and nothing else,
                          forced by a grammar; no stop strings), {"type": "function",
                          "function": {"name"}} (one call of that function, forced)
    parallel_tool_calls  false: at most one call (forced choices make one; with "auto", calls
                          after the first are dropped)

Arguments always are checked against their schema (``strict`` asks for nothing more): a call
whose arguments do not validate, of a tool the request does not have, or unreadable, is given
back as text with the rest of the answer (calls before it in its block are kept), and an answer
without calls finishes as "stop".
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.structured import JSON_LAYOUT, grammar, schema_dict
from dsv4ray.text import dsml

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
CHOICES = ("none", "auto", "required")
_TOOL_KEYS, _FUNCTION_KEYS = {"type", "function"}, {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ChatTools:
    functions: tuple[dict, ...]  # OpenAI function objects
    choice: str = "auto"  # "none" | "auto" | "required" | "function" (``named``)
    named: str | None = None
    parallel: bool = True

    @classmethod
    def from_request(cls, tools, tool_choice=None, parallel_tool_calls=None) -> ChatTools | None:
        """OpenAI's fields -> ChatTools, None when there is nothing to do; ValueError whose
        message starts with the field at fault."""
        functions = tuple(_function(i, t) for i, t in enumerate(_list(tools)))
        names = [f["name"] for f in functions]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise ValueError(f"tools: the function name {sorted(twice)[0]!r} is used twice")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError("parallel_tool_calls must be true or false")
        choice, named = _choice(tool_choice, names)
        if not functions:
            return None
        return cls(functions, choice, named, parallel_tool_calls is not False)

    def prompt_functions(self) -> list[dict]:
        """The functions the chat format renders into the system prompt."""
        return [dict(f) for f in self.functions]

    @property
    def forces_call(self) -> bool:
        return self.choice in ("required", "function")

    def structured_output(self) -> dict | None:
        """The grammar of a forced call (required or named choice), of an answer without one
        (none), None for auto. ValueError naming the tool whose schema no grammar follows."""
        if self.choice == "auto":
            return None
        if self.choice == "none":
            return {"grammar": dsml.no_call_grammar()}
        funcs = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        one = self.choice == "function" or not self.parallel
        return self._checked({"grammar": dsml.call_grammar(funcs, one, JSON_LAYOUT)})

    def calls_or(self, spec: dict) -> dict:
        """tool_choice auto beside a structured output: the answer is a call block or the JSON
        the structured output asks for (OpenAI's: the final answer keeps to response_format,
        and the model may call tools before it)."""
        kind = next(k for k in spec if k != "after_token")
        if kind not in ("json", "json_object"):
            raise ValueError(f"structured_output: beside tools the model may call (tool_choice "
                             f"auto) the answer's constraint must be JSON, not {kind}")  # fmt: skip
        schema = {"type": "object"} if kind == "json_object" else schema_dict(spec["json"])
        text = dsml.calls_or_json_grammar(list(self.functions), not self.parallel, JSON_LAYOUT,
                                          schema)  # fmt: skip
        return self._checked({"grammar": text}, answer=True)

    def _checked(self, spec: dict, answer: bool = False) -> dict:
        """spec, once the grammar compiler took it; else a ValueError naming the first tool
        whose own call grammar it refuses, or (``answer``: beside a structured output) the
        structured output when every tool's is fine."""
        try:
            grammar(spec)
        except ValueError as exc:
            for i, function in enumerate(self.functions):
                try:
                    grammar({"grammar": dsml.call_grammar([function], True, JSON_LAYOUT)})
                except ValueError as own:
                    raise ValueError(f"tools.{i}.function.parameters: no call grammar follows "
                                     f"this schema: {own}"[:500]) from None  # fmt: skip
            if answer:
                raise ValueError(f"structured_output.json: no grammar follows this schema beside "
                                 f"the tools' calls: {exc}"[:500]) from None  # fmt: skip
            raise ValueError(f"tools: no call grammar follows these tools: {exc}"[:500]) from None
        return spec

    def parser(self) -> dsml.CallParser:
        return dsml.CallParser(self.check)

    def check(self, name: str, arguments: dict) -> dict | str:
        """The arguments to keep, or why the call is not valid."""
        if self.choice == "none":
            return "tool_choice is none"
        function = next((f for f in self.functions if f["name"] == name), None)
        if function is None:
            return f"the request has no tool named {name!r}"
        schema = function.get("parameters")
        if not schema:
            return arguments
        problem = _invalid(schema, arguments)
        if problem is None:
            return arguments
        coerced = _coerced(schema, arguments)
        return coerced if _invalid(schema, coerced) is None else f"{name}: {problem}"

    def answer(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str]:
        """An answer's text -> (content, OpenAI tool calls, finish_reason)."""
        parser, content, calls = self.parser(), [], []
        for kind, value in parser.push(text) + parser.finish():
            if kind == "text":
                content.append(value)
            elif self.parallel or not calls:
                calls.append(openai_call(value))
        text = "".join(content)
        return (text or None) if calls else text, calls, finish(finish_reason, len(calls))


def constrained(
    params: SamplingParams, tools: ChatTools | None, reasons: bool, think_end_id: int | None
) -> SamplingParams:
    """The answer's constraint: the params' own structured_output, else a forced call's; when
    the answer reasons first (thinking), it applies after ``</think>``. ValueError naming the
    field at fault."""
    own = params.structured_output
    if tools is not None and tools.forces_call and own is not None:
        raise ValueError("tool_choice: a forced call and a structured output "
                         "(response_format) cannot both constrain the answer")  # fmt: skip
    if tools is not None and tools.forces_call and params.stop:
        raise ValueError("stop: a forced call (tool_choice required or a named function) is a "
                         "call block and nothing else, which stop strings would cut")  # fmt: skip
    if tools is not None and tools.choice == "auto" and own is not None:
        own = tools.calls_or(own)  # a call block or the answer the structured output asks for
    forced = tools.structured_output() if tools is not None and own is None else None
    spec = own or forced
    if spec is None:
        return params
    if reasons:
        if think_end_id is None and spec is forced and tools.choice == "none":
            return params  # none: a call the answer makes anyway is given back as text
        if think_end_id is None:
            raise ValueError("response_format: a constrained answer in thinking mode needs "
                             "</think> to be one token of the vocabulary")  # fmt: skip
        spec = {**spec, "after_token": think_end_id}
    return dataclasses.replace(params, structured_output=spec)


def finish(finish_reason: str | None, num_calls: int) -> str | None:
    """An answer that made calls and stopped finishes as "tool_calls"."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def openai_call(call: dsml.ToolCall) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False),
        },
    }


def _list(tools) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {type: function, function: {...}} objects")
    return tools


def _function(index: int, tool) -> dict:
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"{where}: a tool must be {{type: 'function', function: {{...}}}}")
    _known(where, tool, _TOOL_KEYS)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function: a required object is missing")
    where += ".function"
    _known(where, function, _FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    if not isinstance(function.get("description", ""), str):
        raise ValueError(f"{where}.description must be a string")
    if not isinstance(function.get("strict", False), bool):
        raise ValueError(f"{where}.strict must be true or false")
    _check_schema(f"{where}.parameters", function.get("parameters"))
    for param in dsml.parameters_of(function.get("parameters") or {}) or ():
        if set(param) & set('">\n'):
            raise ValueError(f"{where}.parameters: the parameter name {param!r} cannot be "
                             "written in a call (it holds a quote, > or a line break)")  # fmt: skip
    return {k: v for k, v in function.items() if v is not None}


def _known(where: str, obj: dict, keys: set) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: this server does not implement this field")


def _check_schema(where: str, schema) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ValueError(f"{where} must be the JSON schema of an object")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON schema: {exc.message}"[:300]) from None


def _choice(tool_choice, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {list(CHOICES)} or a named function")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        return tool_choice, None
    if not isinstance(tool_choice, dict):
        raise ValueError("tool_choice must be a string or {type: 'function', function: {name}}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must be a string or {type: 'function', function: {name}}")
    _known("tool_choice", tool_choice, _TOOL_KEYS)
    _known("tool_choice.function", function, {"name"})
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    return "function", name


def _invalid(schema: dict, arguments: dict) -> str | None:
    import jsonschema

    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments)
    )
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or 'arguments'}: {error.message}"[:300]


def _coerced(schema: dict, arguments: dict) -> dict:
    """Values written as strings (``string="true"``) where the schema wants another type, read
    as JSON when they parse."""
    props = dsml.parameters_of(schema) or {}
    out = dict(arguments)
    for name, value in arguments.items():
        kinds = props.get(name, {}).get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        if isinstance(value, str) and kinds and "string" not in kinds:
            try:
                out[name] = json.loads(value)
            except json.JSONDecodeError:
                pass
    return out

"""The DeepSeek-V4 chat format, for checkpoints that ship no jinja template (the release ships an
``encoding`` Python module instead). Written from the format's definition:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>

- The bos token opens the conversation once. A system message's text stands where the message
  stands, with no role token.
- A user (or developer) message is ``<｜User｜>`` + its text; consecutive user messages merge into
  one, their texts joined by a blank line. When an assistant message follows it,
  or it ends the conversation and a generation prompt is wanted, ``<｜Assistant｜>`` follows, then
  ``<think>`` (thinking mode, from the last user message on) or ``</think>`` (no thinking).
- An assistant message is its text then ``<｜end▁of▁sentence｜>``. In thinking mode, one after the
  last user message is preceded by its ``reasoning_content`` and ``</think>``.
- Thinking mode drops history by default (``drop_thinking``): assistant messages before the last
  user message lose their reasoning, and developer messages before it are left out. With
  ``drop_thinking`` false every turn keeps its reasoning and opens with ``<think>``.

- Prefix completion: a last assistant message with ``prefix`` true ends the prompt without
  ``<｜end▁of▁sentence｜>``, so the answer continues its text; in thinking mode an empty text
  leaves its reasoning open (no ``</think>``), so the answer continues the reasoning.

- Tools (text/dsml.py): the functions are rendered after the first message's text when it is a
  system message (a blank line between), else as a system message of their own before it. An
  assistant message's ``tool_calls`` follow its text after a blank line, as a DSML call block.
  ``tool`` messages become a user turn of ``<tool_result>`` blocks (in the order of the calls
  they answer, by ``tool_call_id``); consecutive ones and a user message after them share the
  turn, joined by blank lines. With tools, thinking mode keeps every turn's reasoning.

- ``reasoning_effort`` "max" in thinking mode puts the format's maximum-effort instruction
  (REASONING_EFFORT_MAX) right after the bos token; "high" (or none) adds nothing.

Options come as ``chat_template_kwargs``: ``thinking`` (bool, default False; ``enable_thinking``
is the same switch under the name other servers use), ``drop_thinking`` (bool, default True) and
``reasoning_effort`` (None, "high" or "max"); other keys are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsv4ray.text import dsml

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
# the format's instruction for reasoning_effort "max" (thinking mode): part of what the model saw
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
REASONING_EFFORTS = (None, "high", "max")
_ROLES = ("system", "user", "developer", "assistant", "tool")
_USER_ROLES = ("user", "developer")


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = False
    drop_thinking: bool = True
    reasoning_effort: str | None = None

    def __post_init__(self) -> None:
        for name in ("thinking", "drop_thinking"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"chat_template_kwargs.{name} must be true or false, got "
                    f"{getattr(self, name)!r}"
                )
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"chat_template_kwargs.reasoning_effort must be one of {list(REASONING_EFFORTS)}"
                f", got {self.reasoning_effort!r}"
            )

    @classmethod
    def from_kwargs(cls, kwargs: dict | None) -> ChatOptions:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"thinking", "enable_thinking", "drop_thinking",
                                        "reasoning_effort"})  # fmt: skip
        if unknown:
            raise ValueError(
                f"chat_template_kwargs key {unknown[0]!r} is not understood by the DeepSeek-V4 "
                "chat format (it takes 'thinking' or 'enable_thinking', 'drop_thinking' and "
                "'reasoning_effort')"
            )
        if "enable_thinking" in kwargs:
            enabled = kwargs.pop("enable_thinking")
            if kwargs.setdefault("thinking", enabled) != enabled:
                raise ValueError("chat_template_kwargs.thinking and enable_thinking disagree")
        return cls(**kwargs)


def thinking_asked(chat_template_kwargs: dict | None) -> bool:
    """Whether chat_template_kwargs turn thinking on, by ``thinking`` or its other name
    ``enable_thinking`` (a jinja template's kwargs may hold any other keys)."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("thinking", kwargs.get("enable_thinking")) is True


def encode_messages(
    messages: list[dict],
    options: ChatOptions | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    """Chat messages -> the prompt text (special tokens as text; the tokenizer maps them).
    tools: OpenAI function objects ({"name", "description", "parameters"}) to render."""
    options = options or ChatOptions()
    for i, msg in enumerate(messages[:-1]):
        if isinstance(msg, dict) and msg.get("prefix"):
            raise ValueError(f"messages[{i}].prefix: only the last message can be a prefix")
    messages = [_checked(i, m) for i, m in enumerate(messages)]
    messages = _merge_users(_with_tools(_tool_turns(messages), tools))
    drop = options.thinking and options.drop_thinking and not tools
    if drop:
        messages = _drop_history(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in _USER_ROLES), default=-1)
    parts = [BOS]
    if options.thinking and options.reasoning_effort == "max":
        parts.append(REASONING_EFFORT_MAX)
    for i, msg in enumerate(messages):
        with_reasoning = options.thinking and (not drop or i > last_user)
        if msg.get("prefix"):
            parts.append(_render_prefix(msg, with_reasoning))
            break  # the prefix is the last message (``_checked``)
        parts.append(_render(msg, with_reasoning))
        next_role = messages[i + 1]["role"] if i + 1 < len(messages) else None
        opens_answer = next_role == "assistant" or (next_role is None and add_generation_prompt)
        if msg["role"] in _USER_ROLES and opens_answer:
            think = options.thinking and (not drop or i >= last_user)
            parts.append(ASSISTANT + (THINK_START if think else THINK_END))
    return "".join(parts)


def _checked(index: int, msg: dict) -> dict:
    role = msg.get("role") if isinstance(msg, dict) else None
    if role not in _ROLES:
        raise ValueError(
            f"messages[{index}]: role {role!r} is not rendered by the DeepSeek-V4 chat format "
            f"(roles: {list(_ROLES)})"
        )
    for key in ("content", "reasoning_content"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            raise ValueError(f"messages[{index}].{key} must be a string")
    if msg.get("prefix") and (role != "assistant" or msg.get("tool_calls")):
        raise ValueError(f"messages[{index}].prefix: only an assistant message without "
                         "tool_calls can be a prefix")  # fmt: skip
    if msg.get("tool_calls"):
        if role != "assistant":
            raise ValueError(f"messages[{index}].tool_calls: only assistant messages make calls")
        return {**msg, "tool_calls": _calls(index, msg["tool_calls"])}
    return msg


def _calls(index: int, tool_calls) -> list[tuple[str, dict, str | None]]:
    """OpenAI tool calls -> (name, arguments, id); arguments may be JSON text or an object."""
    calls = []
    for j, call in enumerate(tool_calls if isinstance(tool_calls, list) else [None]):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where} must be {{id, type: 'function', function: {{name, "
                             "arguments}}}")  # fmt: skip
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object")
        calls.append((function["name"], arguments, call.get("id")))
    return calls


def _tool_turns(messages: list[dict]) -> list[dict]:
    """Tool messages -> user messages of ``<tool_result>`` blocks, each run of them in the
    order of the calls of the assistant message before it."""
    out: list[dict] = []
    order: dict = {}  # tool_call_id -> the position of its call
    run: list[dict] = []
    for msg in [*messages, None]:
        if msg is not None and msg["role"] == "tool":
            run.append(msg)
            continue
        run.sort(key=lambda m: order.get(m.get("tool_call_id"), len(order)))
        out.extend({"role": "user", "content": dsml.render_result(m.get("content") or "")}
                   for m in run)  # fmt: skip
        run = []
        if msg is not None:
            if msg.get("tool_calls"):
                order = {call_id: k for k, (_, _, call_id) in enumerate(msg["tool_calls"])}
            out.append(msg)
    return out


def _with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The functions rendered into the first message when it is a system one, else into a
    system message of their own before it."""
    if not tools:
        return messages
    section = dsml.render_tools(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [
            {**first, "content": (first.get("content") or "") + "\n\n" + section},
            *messages[1:],
        ]
    return [{"role": "system", "content": "\n\n" + section}, *messages]


def _merge_users(messages: list[dict]) -> list[dict]:
    merged: list[dict] = []
    for msg in messages:
        if msg["role"] == "user" and merged and merged[-1]["role"] == "user":
            text = (merged[-1].get("content") or "") + "\n\n" + (msg.get("content") or "")
            merged[-1] = {**merged[-1], "content": text}
        else:
            merged.append(msg)
    return merged


def _drop_history(messages: list[dict]) -> list[dict]:
    """Thinking mode's history: before the last user message, assistant messages lose their
    reasoning and developer messages go."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] in _USER_ROLES), default=-1)
    kept = []
    for i, msg in enumerate(messages):
        if i >= last_user or msg["role"] in ("system", "user"):
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


def _render(msg: dict, with_reasoning: bool) -> str:
    content = msg.get("content") or ""
    if msg["role"] == "system":
        return content
    if msg["role"] in _USER_ROLES:
        return USER + content
    reasoning = (msg.get("reasoning_content") or "") + THINK_END if with_reasoning else ""
    if msg.get("tool_calls"):
        calls = [(name, arguments) for name, arguments, _ in msg["tool_calls"]]
        content += dsml.BEFORE_CALLS + dsml.render_calls(calls)
    return reasoning + content + EOS


def _render_prefix(msg: dict, with_reasoning: bool) -> str:
    """The start of the answer: its reasoning (closed only when text follows) and its text."""
    content = msg.get("content") or ""
    if not with_reasoning:
        return content
    reasoning = msg.get("reasoning_content") or ""
    return reasoning + THINK_END + content if content else reasoning


def prefix_state(messages: list[dict], thinking: bool) -> str:
    """Where a generated answer starts in thinking mode: "start" (a fresh answer), "reasoning"
    (it continues a prefix's open reasoning) or "content" (it continues a prefix's text)."""
    last = messages[-1] if messages else {}
    if not last.get("prefix"):
        return "start"
    return "content" if last.get("content") or not thinking else "reasoning"


def split_reasoning(text: str) -> tuple[str, str]:
    """Text generated in thinking mode -> (reasoning_content, content): the reasoning runs up to
    the first ``</think>`` (a leading ``<think>`` is not part of it); while no ``</think>`` has
    been generated, all of the text is reasoning."""
    if text.startswith(THINK_START):
        text = text[len(THINK_START) :]
    reasoning, found, content = text.partition(THINK_END)
    return (reasoning, content) if found else (text, "")

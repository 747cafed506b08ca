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

Options come as ``chat_template_kwargs``: ``thinking`` (bool, default False) and ``drop_thinking``
(bool, default True); other keys are refused by name. Tool calls (the release's DSML blocks) are
not rendered: messages with ``tools``, ``tool_calls`` or the ``tool`` role are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
_ROLES = ("system", "user", "developer", "assistant")
_USER_ROLES = ("user", "developer")


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = False
    drop_thinking: bool = True

    def __post_init__(self) -> None:
        for name in ("thinking", "drop_thinking"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"chat_template_kwargs.{name} must be true or false, got "
                    f"{getattr(self, name)!r}"
                )

    @classmethod
    def from_kwargs(cls, kwargs: dict | None) -> ChatOptions:
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"thinking", "drop_thinking"})
        if unknown:
            raise ValueError(
                f"chat_template_kwargs key {unknown[0]!r} is not understood by the DeepSeek-V4 "
                "chat format (it takes 'thinking' and 'drop_thinking')"
            )
        return cls(**kwargs)


def encode_messages(
    messages: list[dict], options: ChatOptions | None = None, add_generation_prompt: bool = True
) -> str:
    """Chat messages -> the prompt text (special tokens as text; the tokenizer maps them)."""
    options = options or ChatOptions()
    for i, msg in enumerate(messages[:-1]):
        if isinstance(msg, dict) and msg.get("prefix"):
            raise ValueError(f"messages[{i}].prefix: only the last message can be a prefix")
    messages = _merge_users([_checked(i, m) for i, m in enumerate(messages)])
    drop = options.thinking and options.drop_thinking
    if drop:
        messages = _drop_history(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in _USER_ROLES), default=-1)
    parts = [BOS]
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
            f"(roles: {list(_ROLES)}; tool messages are not supported)"
        )
    for key in ("tools", "tool_calls"):
        if msg.get(key):
            raise ValueError(f"messages[{index}].{key}: tool calls are not supported")
    for key in ("content", "reasoning_content"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            raise ValueError(f"messages[{index}].{key} must be a string")
    if msg.get("prefix") and role != "assistant":
        raise ValueError(f"messages[{index}].prefix: only an assistant message can be a prefix")
    return msg


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

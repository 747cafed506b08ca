"""Request models of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes), at the HTTP edge.

``/tokenize`` takes a ``prompt`` (a string, tokenized as ``/v1/completions`` tokenizes it;
``add_special_tokens: false`` leaves out the bos token) or ``messages`` (rendered as
``/v1/chat/completions`` renders them, with ``chat_template_kwargs`` and ``tools``).
``/detokenize`` takes ``tokens``. Both are parsed like the generation requests
(``protocol.parse_request``): strict types, unknown fields refused by name. ``model`` may be
left out (then the served model), as vLLM allows; any other model is a 404 as on the other
routes.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dsv4ray.entrypoints.openai.errors import bad_request
from dsv4ray.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, _Request

PROMPT_ONLY = ("add_special_tokens",)
CHAT_ONLY = ("chat_template_kwargs", "add_generation_prompt", "tools", "tool_choice")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # rendered into the prompt as a chat request renders them
    tool_choice: Any = None

    def check_supported(self) -> None:
        if self.prompt is None and self.messages is None:
            raise bad_request("a prompt or messages is required", "prompt")
        if self.prompt is not None and self.messages is not None:
            raise bad_request("give a prompt or messages, not both", "messages")
        given = self.model_fields_set
        wrong = [n for n in (CHAT_ONLY if self.messages is None else PROMPT_ONLY) if n in given]
        if wrong:
            other = "messages" if self.messages is None else "a prompt"
            raise bad_request(f"{wrong[0]} only goes with {other}", wrong[0])
        if not self.add_generation_prompt:
            raise bad_request(
                "only add_generation_prompt = true is supported (messages are rendered as "
                "/v1/chat/completions renders them)",
                "add_generation_prompt",
            )
        if self.messages is not None:
            self.as_chat().check_supported()  # the messages' own refusals (tool_calls, ...)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is: the server renders it with the same code."""
        return ChatCompletionRequest.model_construct(
            model=self.model or "",
            messages=self.messages,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=None,
        )


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        """Nothing past the types: the server checks the ids against the vocabulary."""

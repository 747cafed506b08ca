"""What a caller gets back per request: RequestOutput with RequestMetrics (msgpack-friendly).

``to_dict`` gives only msgpack-native values (lists, str-keyed dicts, numbers, None); logprobs, a
list with one {token_id: logprob} dict per generated token, travels as lists of [token_id, logprob]
pairs because msgpack map keys are strings here. ``from_dict`` inverts it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class RequestMetrics:
    """num_cached_tokens counts prompt tokens reused from the prefix cache (device + host);
    num_host_cached_tokens the part of them loaded from the host tier; kv_transfer_s the time a
    prefill engine's stages spent writing the request's KV and remote_prefill_s the time that
    engine took from receiving the request to its answer (prefill/decode pairs). Times in
    seconds from the request's arrival: queue_s to the first step that runs it, ttft_s to its
    first token, e2e_s to its end."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    kv_transfer_s: float | None = None
    remote_prefill_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestMetrics:
        return cls(**data)


@dataclass
class RequestOutput:
    """One request's result. finish_reason is None while the request still runs (streaming);
    error says why a request was aborted (None otherwise). content and tool_calls are set by a
    chat call given tools (``LLM.chat``): the answer's text without its reasoning and call
    block (None when it made calls and said nothing else), and its calls in OpenAI's shape
    ({"id", "type": "function", "function": {"name", "arguments": JSON text}})."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None
    # SamplingParams.prompt_logprobs: per prompt position, None for the first token, else
    # [[token id, logprob, rank], ...]: the prompt's token first, then the top ones not it
    prompt_logprobs: list[list | None] | None = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}"
            )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            logprobs = [[[tok, lp] for tok, lp in step.items()] for step in self.logprobs]
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
            "error": self.error,
            "content": self.content,
            "tool_calls": self.tool_calls,
            "prompt_logprobs": self.prompt_logprobs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestOutput:
        fields = dict(data)
        if fields.get("logprobs") is not None:
            fields["logprobs"] = [
                {int(tok): float(lp) for tok, lp in step} for step in fields["logprobs"]
            ]
        fields["metrics"] = RequestMetrics.from_dict(fields.get("metrics") or {})
        return cls(**fields)

"""Checks the engine makes before a request or a checkpoint reaches it."""

from __future__ import annotations

from dsv4ray.config import ModelConfig
from dsv4ray.engine.sampling import check_text
from dsv4ray.engine.structured import grammar


class RequestError(ValueError):
    """A request the engine refuses. field: the SamplingParams field at fault (None: the prompt
    or the request as a whole), which an API names in its error; it survives pickling (a Ray
    call's error carries it from the engine's process)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return type(self), (str(self), self.field)


def check_request_id(req_id: object) -> None:
    if not isinstance(req_id, str) or not req_id:
        raise ValueError(f"request id must be a non-empty string, got {req_id!r}")
    check_text("request id", req_id)


def without_request_id(message: str, req_id: str) -> str:
    """An engine refusal's message without the ``request 'id': `` it opens with: for callers
    that name the request their own way (its place in a call, its input line)."""
    return message.removeprefix(f"request {req_id!r}: ")


def check_sampling(params, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: logit_bias and stop ids and structured_output's
    after_token inside the vocabulary, and a grammar that compiles (engine/structured.py)."""
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        raise RequestError(
            f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
            "logit_bias",
        )
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise RequestError(
            f"stop_token_ids token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
            "stop_token_ids",
        )
    if params.structured_output is not None:
        after = params.structured_output.get("after_token")
        if after is not None and after >= vocab_size:
            raise RequestError(f"structured_output.after_token {after} is outside the "
                               f"vocabulary [0, {vocab_size})", "structured_output")  # fmt: skip
        grammar(params.structured_output)


def check_paged_shapes(cfg: ModelConfig) -> ModelConfig:
    """The page layouts and kernels assume the release's head shapes."""
    for name, want in (("head_dim", 512), ("qk_rope_head_dim", 64), ("index_head_dim", 128)):
        if getattr(cfg, name) != want:
            raise ValueError(
                f"the paged engine needs {name} = {want} (its page layouts and "
                f"kernels), the checkpoint has {getattr(cfg, name)}"
            )
    return cfg

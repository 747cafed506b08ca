"""SamplingParams: how one request samples and when it stops (validated, frozen, msgpack-able).

``SamplingParams()`` is greedy (temperature 0.0) and generates 16 tokens. The HTTP server, not this
class, fills omitted fields with OpenAI's defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
INT64 = 2**63  # seeds and ids travel in msgpack-encoded plans as signed 64-bit integers
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (dividing by them overflows fp32)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
# a repetition penalty lies in [0.01, 100]: dividing a logit by a smaller one can leave fp32's
# range, and the row then has nothing finite to draw
MAX_REPETITION = 100.0
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


STRUCTURED_KINDS = {"json": (dict, str), "json_object": (bool,), "regex": (str,),
                    "choice": (list, tuple), "grammar": (str,)}  # fmt: skip


def _check_structured(spec: object) -> None:
    """One kind of constraint with a value of its type, and maybe ``after_token`` (the grammar
    itself is checked where it is compiled: engine/structured.py)."""
    if spec is None:
        return
    kinds = [k for k in spec if k != "after_token"] if isinstance(spec, Mapping) else []
    if len(kinds) != 1 or kinds[0] not in STRUCTURED_KINDS or len(spec) - len(kinds) > 1:
        raise ValueError(f"structured_output must hold one of {sorted(STRUCTURED_KINDS)} (and "
                         f"maybe after_token), got {spec!r}"[:300])  # fmt: skip
    after = spec.get("after_token")
    if after is not None and (not isinstance(after, int) or isinstance(after, bool) or after < 0):
        raise ValueError(f"structured_output.after_token must be a token id, got {after!r}")
    kind, value = kinds[0], spec[kinds[0]]
    if not isinstance(value, STRUCTURED_KINDS[kind]) or value in ("", False):
        raise ValueError(f"structured_output.{kind} is empty or of the wrong type: {value!r}"[:300])
    if kind == "choice" and not (value and all(isinstance(c, str) and c for c in value)):
        raise ValueError("structured_output.choice must be a list of non-empty strings")


def check_text(name: str, text: str) -> None:
    """ValueError naming the field unless text is valid Unicode that UTF-8 can carry (a lone
    surrogate, e.g. from a JSON escape, cannot travel in a plan or be tokenised)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid text: {exc.reason} at index {exc.start}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    max_tokens      tokens to generate (>= 1; None: up to the context, stored as 2**63 - 1)
    temperature     0 = greedy (so is anything below 1e-5; it is stored as 0.0)
    top_p           nucleus mass in (0, 1]; however small, the most likely token stays
    top_k           -1 = off (so is 0, as vLLM takes it; stored as -1), else >= 1
    seed            per-request generator seed (None = the engine picks one; so does -1, as
                    vLLM takes it; stored as None)
    stop            strings that end the output (normalised to a tuple; valid UTF-8 text)
    stop_token_ids  token ids that end the output (normalised to a tuple)
    logprobs        None, or top logprobs per token (0..20; 0 = only the sampled token's)
    prompt_logprobs None, or the logprob and rank of every prompt token after the first, with
                    the top logprobs at its position (0..20), computed in the prefill (the
                    request computes its whole prompt: no prefix-cache hit)
    ignore_eos      keep generating past the model's eos token
    presence_penalty    [-2, 2]: subtracted from the logit of every token generated so far
    frequency_penalty   [-2, 2]: subtracted once per time a token was generated so far
    repetition_penalty  [0.01, 100] (1 = off): logits of tokens in the prompt or generated so
                        far are divided by it where positive, multiplied where negative
    min_p           [0, 1]: tokens less likely than min_p times the likeliest are dropped (after
                    temperature; greedy ignores it)
    min_tokens      the eos and stop_token_ids cannot be drawn before this many tokens (unless
                    nothing else can: a structured_output answer already complete ends)
    logit_bias      {token id: bias in [-100, 100]} added to the logits (up to 1024 ids; kept
                    as sorted (id, bias) pairs)
    structured_output   None, or what the output must match, one of {"json": a JSON schema
                    (a dict or its text)}, {"json_object": True}, {"regex": pattern},
                    {"choice": [strings]}, {"grammar": a Lark grammar} (engine/structured.py),
                    with "after_token": a token id, from the token after the first such one
                    drawn (the end of a thinking answer's reasoning)
    Logprobs are those of the model's raw logits, before any of these.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    structured_output: dict[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", INT64 - 1)
        if _is_int(self.top_k) and self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if _is_int(self.seed) and self.seed == -1:
            object.__setattr__(self, "seed", None)
        self._check_lengths()
        self._check_sampling()
        self._check_controls()
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "logit_bias", self._normalise_bias(self.logit_bias))
        _check_structured(self.structured_output)
        temperature = float(self.temperature)
        object.__setattr__(self, "temperature", 0.0 if temperature < GREEDY_BELOW else temperature)
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalise_ids(self.stop_token_ids))

    def _check_lengths(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < INT64:
            raise ValueError(
                f"max_tokens must be an int in [1, 2**63 - 1], got {self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_sampling(self) -> None:
        temp = self.temperature
        if not _is_number(temp) or not math.isfinite(temp) or temp < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temp!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and not 1 <= self.top_k < INT64):
            raise ValueError(f"top_k must be -1 or 0 (off) or an int >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -INT64 <= self.seed < INT64):
            raise ValueError(f"seed must be None or a 64-bit signed int, got {self.seed!r}")

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], "
                                 f"got {value!r}")  # fmt: skip
        rep = self.repetition_penalty
        if not _is_number(rep) or not 1 / MAX_REPETITION <= rep <= MAX_REPETITION:
            raise ValueError(
                f"repetition_penalty must be in [{1 / MAX_REPETITION}, {MAX_REPETITION}], got "
                f"{rep!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got "
                f"{self.min_tokens!r}"
            )

    @staticmethod
    def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...]:
        if bias is None:
            return ()
        if isinstance(bias, (list, tuple)):  # to_dict's pairs
            pairs = all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias)
            if not pairs:
                raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}"[:300])
            bias = dict(bias)
        if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to "
                             f"biases, got {bias!r}"[:300])  # fmt: skip
        out = {}
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token < INT64:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {value!r} for token {token}")  # fmt: skip
            out[token] = float(value)
        return tuple(sorted(out.items()))

    @property
    def penalizes(self) -> bool:
        """Whether sampling reads the request's tokens so far (the penalties)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)  # fmt: skip

    @property
    def reads_history(self) -> bool:
        """Whether sampling follows the request's tokens: penalties count them, a grammar
        consumes them (a preempted request's stages replay them)."""
        return self.penalizes or self.structured_output is not None

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for item in items:
            if not isinstance(item, str) or not item:
                raise ValueError(f"stop strings must be non-empty strings, got {item!r}")
            check_text("stop", item)
        return tuple(items)

    @staticmethod
    def _normalise_ids(ids: object) -> tuple[int, ...]:
        if ids is None:
            return ()
        valid = isinstance(ids, (list, tuple)) and all(_is_int(i) and 0 <= i < INT64 for i in ids)
        if not valid:
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        return tuple(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """msgpack-native fields (tuples as lists; from_dict restores them)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["stop"] = list(self.stop)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of to_dict; an unknown key is a ValueError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown SamplingParams fields: {unknown}")
        return cls(**data)

"""The OpenAI wire format at the HTTP edge: request models and their sampling parameters.

Pydantic lives here and nowhere deeper: a parsed request becomes a plain ``SamplingParams`` and a
prompt; bodies are parsed within limits (``json_body``) and every failure is an ``APIError``
(``errors``) with OpenAI's error body. No field is silently ignored: fields the API
defines but this server does not implement (``suffix``, the deprecated ``functions`` and
``function_call``, ...) are a 400 naming them unless they hold the value that asks for nothing
(``functions: []``, ...), and so is any field the API does not define, at the top level, in
``stream_options`` or in a message (``typical_p``, ``guided_json``, a typo). ``INFORMATIONAL``
fields (``user``, ``metadata``, ``store``, ...) do not change what is generated and are accepted.
``tools``, ``tool_choice`` and ``parallel_tool_calls`` are entrypoints/tool_calls.py's; an
assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` go to the chat format.
Inside a message, ``function_call``, ``audio`` and a ``name`` (the chat format renders none) are
refused; ``refusal``, ``annotations`` and ``parsed``, and a tool call's ``index`` and
``function.parsed_arguments`` (a client echoing an earlier answer back, as the openai client keeps
a streamed or parsed one) are accepted and not part of the prompt. A null asks for an optional
field's default (the openai client sends unset options as null). ``reasoning_effort`` ("none",
"minimal": no thinking; "low", "medium", "high", "xhigh": thinking; "max": thinking after the
chat format's maximum-effort instruction) and
``chat_template_kwargs.enable_thinking`` set the chat format's thinking mode, as
``chat_template_kwargs.thinking`` does (values that disagree are a 400). DeepSeek's prefix
completion: the last message may be an assistant message with ``prefix: true``, whose text
(and reasoning) the answer continues. ``stream_options`` takes ``include_usage``,
``continuous_usage_stats`` (every chunk carries the usage so far) and ``include_obfuscation``
(chunks never carry obfuscation padding).
``n`` choices per prompt, several prompts per completions request and ``best_of`` are one
engine request each (entrypoints/openai/server.py); ``echo`` and ``prompt_logprobs`` (vLLM's)
give the prompt's tokens and logprobs back.
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as string keys) go to
the sampler. Extensions: ``top_k``, ``repetition_penalty``, ``min_p``, ``min_tokens`` (as vLLM
takes them), ``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (the choice
then carries the generated ``token_ids``; each stream chunk carries its new ones) and, for chat,
``chat_template_kwargs`` (template variables; the DeepSeek-V4 format takes ``thinking`` and
``drop_thinking``) and an assistant message's ``reasoning_content``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from dsv4ray.engine.sampling import MAX_LOGPROBS, SamplingParams
from dsv4ray.engine.structured import grammar
from dsv4ray.entrypoints.openai.errors import APIError, bad_request
from dsv4ray.entrypoints.openai.json_body import find_bad_value, load_json
from dsv4ray.entrypoints.tool_calls import ChatTools

MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 1024  # every plan of the request carries them to the last stage
INT64_MAX = 2**63 - 1  # seeds and ids travel to the stages as msgpack int64s
MAX_RUNS = 64  # engine requests one response may make: prompts x max(n, best_of)
_FUNCTIONS = "the deprecated function-calling fields are not supported: use tools and tool_choice"
NOT_IMPLEMENTED = {  # OpenAI request fields this server does not implement -> why
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "audio": "only text output is supported",
    "modalities": 'only text output is supported (modalities ["text"])',
    "prediction": "predicted outputs are not supported",
    "verbosity": "it is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
}
# the values of NOT_IMPLEMENTED fields that ask for nothing (None asks for nothing everywhere)
NEUTRAL_VALUES = {
    "functions": [[]],
    "function_call": ["none"],
    "modalities": [["text"]],
}
# fields that do not change what is generated (labels, storage and billing hints): accepted
INFORMATIONAL = ("metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
                 "prompt_cache_retention", "safety_identifier")  # fmt: skip
MESSAGE_NOT_IMPLEMENTED = {
    "function_call": _FUNCTIONS,
    "audio": "audio messages are not supported",
}


class _Request(BaseModel):
    # strict: "5" is not an int and true is not a number; JSON types must match the API's.
    # A field this server does not know, at any depth, is refused by name, never ignored
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_asks_for_the_default(cls, data: Any) -> Any:
        """An explicit null of an optional field is its default, as OpenAI takes it (its SDK
        sends an unset option as null); a required field's null stays a type error."""
        if not isinstance(data, dict):
            return data
        optional = {f.alias or name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class JsonSchemaFormat(_Request):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> dict | None:
        """The engine's constraint (engine/structured.py), None for plain text. ``strict``
        keeps every object to its declared properties, as OpenAI's strict mode does:
        ``additionalProperties`` is false wherever the schema leaves it out."""
        if self.json_schema is not None and self.type != "json_schema":
            raise bad_request(f"response_format.json_schema: only with type json_schema, not "
                              f"{self.type}", "response_format.json_schema")  # fmt: skip
        if self.type == "json_object":
            spec = {"json_object": True}
        elif self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("response_format.json_schema is required with type "
                                  "json_schema", "response_format.json_schema")  # fmt: skip
            schema = self.json_schema.schema_ or {}
            spec = {"json": closed_objects(schema) if self.json_schema.strict else schema}
        else:
            return None
        try:
            grammar(spec)  # a schema the grammar compiler refuses is this field's 400
        except ValueError as exc:
            raise bad_request(str(exc).replace("structured_output.json", "response_format"),
                              "response_format") from None  # fmt: skip
        return spec


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "not", "if", "then", "else", "additionalProperties", "contains")


def closed_objects(schema):
    """A copy of a JSON schema in which every object schema that says nothing of
    ``additionalProperties`` has it false (subschemas at any depth)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # every chunk carries the usage so far
    include_obfuscation: bool = True  # chunks never carry obfuscation padding: nothing to do


class _GenerationRequest(_Request):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None  # extension (vLLM's): the prompt tokens' logprobs
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = -1
    repetition_penalty: float = 1.0  # extensions, as vLLM takes them
    min_p: float = 0.0
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop: Any) -> Any:
        items = [stop] if isinstance(stop, str) else stop
        if stop is not None and (
            not isinstance(items, list)
            or len(items) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in items)
        ):
            raise ValueError(f"stop must be a string or a list of up to {MAX_STOP_STRINGS} "
                             "non-empty strings")  # fmt: skip
        return stop or None  # [] asks for none, as OpenAI takes it

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_RUNS:
            raise bad_request(f"n must be in [1, {MAX_RUNS}]", "n")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream = true", "stream_options")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE}]", "temperature")
        for name, values in (
            ("seed", [self.seed or 0]),
            ("top_k", [self.top_k]),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            if any(not -INT64_MAX - 1 <= v <= INT64_MAX for v in values):
                raise bad_request(f"{name} must fit in a signed 64-bit integer", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_runs(self) -> int:
        """Engine requests per prompt: the choices, or the best_of candidates."""
        return self.n

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """OpenAI's defaults for omitted fields (temperature 1, top_p 1); a bad value is a 400
        naming the field (SamplingParams' messages start with it). logprobs and
        prompt_logprobs: what the engine records (the response may show less)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                min_p=self.min_p,
                min_tokens=self.min_tokens,
                logit_bias=_token_bias(self.logit_bias),
                structured_output=self.response_format and self.response_format.structured_output(),
            )
        except ValueError as exc:
            raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None


class CompletionRequest(_GenerationRequest):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int] | list[str | list[int]]:
        """A string, a token-id list, or a non-empty list of those (several prompts)."""
        if _is_prompt(prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_prompt(p) for p in prompt):
            return prompt
        raise ValueError("prompt must be a string, a non-empty list of token ids, or a "
                         "non-empty list of those")  # fmt: skip

    @property
    def prompts(self) -> list[str | list[int]]:
        return [self.prompt] if _is_prompt(self.prompt) else list(self.prompt)

    @property
    def num_runs(self) -> int:
        return self.best_of or self.n

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_RUNS:
                raise bad_request(f"best_of must be in [n, {MAX_RUNS}]", "best_of")
            if self.stream and self.best_of > self.n:
                raise bad_request("best_of > n cannot stream (the best are known at the end)",
                                  "best_of")  # fmt: skip
        if len(self.prompts) * self.num_runs > MAX_RUNS:
            # the field to change: best_of when it asks for more runs than n, else n, else the
            # prompts themselves
            field = "best_of" if self.num_runs > self.n else "n" if self.n > 1 else "prompt"
            raise bad_request(f"prompts x max(n, best_of) must be at most {MAX_RUNS}", field)
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    @property
    def engine_logprobs(self) -> int | None:
        """What the engine records per token: the asked top n, or the sampled token's alone
        when best_of ranks candidates by their cumulative logprob."""
        if self.logprobs is None and (self.best_of or self.n) > self.n:
            return 0
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or the logprobs of an echoed prompt."""
        asked = [v for v in (self.prompt_logprobs, self.echo and self.logprobs) if _is_int(v)]
        return max(asked) if asked else None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text of an object
    parsed_arguments: Any = None  # the client's parse of arguments (openai's parse helpers)


class MessageToolCall(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCall
    index: int | None = None  # a streamed call's position, kept by clients that join deltas


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning (thinking mode)
    prefix: bool = False  # the last assistant message: the answer goes on from its text
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    # what an answer that a client echoes back may carry: not part of the prompt
    refusal: str | None = None
    annotations: list | None = None
    parsed: Any = None  # the client's parse of the content (openai's parse and stream helpers)

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts join as paragraphs, as the format does
            return "\n\n".join(part.text for part in self.content)
        return self.content or ""

    def template(self) -> dict:
        """The message as the chat format renders it (text/chat_encoding.py)."""
        extra = {"reasoning_content": self.reasoning_content} if self.reasoning_content else {}
        if self.prefix:
            extra["prefix"] = True
        if self.tool_calls:
            echoed = {"index": True, "function": {"parsed_arguments"}}  # client-side fields
            extra["tool_calls"] = [c.model_dump(exclude=echoed) for c in self.tool_calls]
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        return {"role": self.role, "content": self.text(), **extra}


_MESSAGES = TypeAdapter(list[ChatMessage])


def chat_messages(raw) -> list[dict]:
    """OpenAI chat messages (decoded JSON) -> the chat format's messages, checked as a chat
    completion checks them (``LLM.chat``, batch job lines); a ValueError naming the field."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages must be a non-empty list")
    try:
        messages = _MESSAGES.validate_python(raw)
        _check_conversation(messages)
    except ValidationError as exc:
        raise ValueError(_validation_error(exc, prefix=("messages",)).message) from None
    except APIError as exc:
        raise ValueError(exc.message) from None
    return [m.template() for m in messages]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        _check_conversation(self.messages)
        self.template_kwargs()  # a bad thinking option is a 400 naming it
        if self.stream and self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are given in whole chat answers, not in chat "
                              "streams", "prompt_logprobs")  # fmt: skip
        tools = self.chat_tools()
        if tools is not None and tools.forces_call:
            if self.messages[-1].prefix:
                raise bad_request("tool_choice: a forced call cannot continue a prefix message",
                                  "tool_choice")  # fmt: skip
            if self.response_format is not None and self.response_format.type != "text":
                raise bad_request("tool_choice: a forced call and a structured output "
                                  "(response_format) cannot both constrain the answer",
                                  "tool_choice")  # fmt: skip
        for name in ("max_tokens", "max_completion_tokens"):  # both checked, whichever wins
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}", name)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the limit asked for, the field that asked it): max_completion_tokens, OpenAI's
        current name, wins over the deprecated max_tokens when both are sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict]:
        return [m.template() for m in self.messages]

    def chat_tools(self) -> ChatTools | None:
        """The request's tools (None: none, or tool_choice "none"); a bad one is a 400 naming
        its field."""
        try:
            return ChatTools.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as exc:
            raise bad_request(str(exc), str(exc).split(" ", 1)[0].split(":")[0]) from None

    def template_kwargs(self) -> dict:
        """chat_template_kwargs for the chat format: ``enable_thinking`` (the name other
        servers use) and ``reasoning_effort`` become its ``thinking`` switch."""
        kwargs = dict(self.chat_template_kwargs or {})
        asked = {}
        if "enable_thinking" in kwargs:
            asked["chat_template_kwargs.enable_thinking"] = kwargs.pop("enable_thinking")
        if self.reasoning_effort is not None:
            if self.reasoning_effort not in REASONING_EFFORTS:
                raise bad_request(f"reasoning_effort must be one of {sorted(REASONING_EFFORTS)} "
                                  "(the DeepSeek-V4 chat format thinks or does not)",
                                  "reasoning_effort")  # fmt: skip
            asked["reasoning_effort"] = REASONING_EFFORTS[self.reasoning_effort]
            if self.reasoning_effort == "max":  # the format's one effort level with a prompt
                kwargs.setdefault("reasoning_effort", "max")
        if "thinking" in kwargs:
            asked["chat_template_kwargs.thinking"] = kwargs["thinking"]
        for name, value in asked.items():
            if not isinstance(value, bool):
                raise bad_request(f"{name} must be true or false, got {value!r}", name)
        values = set(asked.values())
        if len(values) > 1:
            raise bad_request(f"{' and '.join(asked)} disagree", next(iter(asked)))
        if asked:
            kwargs["thinking"] = next(iter(asked.values()))
        return kwargs

    @property
    def thinking(self) -> bool:
        """Whether the answer is in thinking mode (the template's ``thinking`` variable)."""
        return self.template_kwargs().get("thinking") is True

    @property
    def answer_prefix(self) -> dict | None:
        """The last message when it is an assistant prefix the answer continues."""
        last = self.messages[-1]
        return self.template_messages()[-1] if last.prefix else None


def _is_prompt(prompt: Any) -> bool:
    """One prompt: a string or a non-empty list of token ids."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(_is_int(t) for t in prompt)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, keys are JSON strings) with int ids."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 19:  # "²" is a digit too
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


# reasoning_effort -> thinking mode (OpenAI's values, and the chat format's "max", which also
# puts its maximum-effort instruction before the conversation)
REASONING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                     "xhigh": True, "max": True}  # fmt: skip


def _check_conversation(messages: list[ChatMessage]) -> None:
    calls: set[str] = set()  # the ids of the calls made so far in the conversation
    for i, message in enumerate(messages):
        _check_message(i, message, last=i == len(messages) - 1)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise bad_request(f"messages.{i}.tool_call_id: {message.tool_call_id!r} answers "
                              "no tool call of an earlier assistant message",
                              f"messages.{i}.tool_call_id")  # fmt: skip
        calls.update(call.id for call in message.tool_calls or [])


def _check_message(index: int, message: ChatMessage, last: bool) -> None:
    where = f"messages.{index}"
    for name, why in MESSAGE_NOT_IMPLEMENTED.items():
        if getattr(message, name):
            raise bad_request(f"{where}.{name}: {why}", f"{where}.{name}")
    if message.tool_calls is not None and message.role != "assistant":
        raise bad_request(f"{where}.tool_calls: only assistant messages make tool calls",
                          f"{where}.tool_calls")  # fmt: skip
    if (message.role == "tool") != (message.tool_call_id is not None):
        raise bad_request(f"{where}.tool_call_id: a tool message needs one, other messages "
                          "have none", f"{where}.tool_call_id")  # fmt: skip
    if message.content is None and message.role != "assistant":
        raise bad_request(f"{where}.content: a {message.role} message needs content",
                          f"{where}.content")  # fmt: skip
    said = message.tool_calls or message.reasoning_content is not None
    if message.content is None and message.role == "assistant" and not said:
        raise bad_request(f"{where}.content: an assistant message needs content unless it "
                          "makes tool_calls or carries reasoning_content",
                          f"{where}.content")  # fmt: skip
    if message.name is not None:
        raise bad_request(f"{where}.name: the DeepSeek-V4 chat format renders no participant "
                          "names", f"{where}.name")  # fmt: skip
    if message.prefix and not (last and message.role == "assistant"):
        raise bad_request(f"{where}.prefix: only the last message, an assistant one, can be the "
                          "prefix of the answer", f"{where}.prefix")  # fmt: skip


def parse_request(model_cls: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
    """Body bytes -> a validated request. Invalid UTF-8, malformed or too deeply nested JSON,
    NaN/Infinity, overlong integers, lone surrogate escapes and bad fields are 400s."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 ({exc.reason})") from None
    data = load_json(text)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    bad = find_bad_value(data)
    if bad is not None:
        path, reason = bad
        raise bad_request(f"{path}: {reason}" if path else reason, path or None)
    try:
        request = model_cls.model_validate(_without_neutral_fields(data))
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check_supported()
    return request


def _without_neutral_fields(data: dict) -> dict:
    """``data`` without the NOT_IMPLEMENTED fields that ask for nothing and the INFORMATIONAL
    ones; any other value of a NOT_IMPLEMENTED field is a 400 naming it."""
    kept = {}
    for name, value in data.items():
        if name in NOT_IMPLEMENTED:
            if value is not None and value not in NEUTRAL_VALUES.get(name, []):
                raise bad_request(f"{name}: {NOT_IMPLEMENTED[name]}", name)
        elif name not in INFORMATIONAL:
            kept[name] = value
    return kept


def _validation_error(exc: ValidationError, prefix: tuple[str, ...] = ()) -> APIError:
    # union members add their type to the location ("content.str"); users know only fields.
    # A value that fits no member fails in each: the deepest failure is in the member whose
    # shape the value has (a list of parts with an unknown key, not "content is no string")
    located = [([*prefix, *(str(p) for p in e["loc"] if not _is_type_tag(p))], e)
               for e in exc.errors()]  # fmt: skip
    loc, err = max(located, key=lambda pair: len(pair[0]))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = "a required field is missing"
    elif err["type"] == "extra_forbidden":
        msg = "dsv4ray does not implement this field (unknown fields are refused, not ignored)"
    return bad_request(f"{'.'.join(loc)}: {msg}", ".".join(loc) or None)  # the field's path


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "MessageToolCall"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

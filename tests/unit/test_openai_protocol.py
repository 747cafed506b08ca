"""parse_request without Ray: hostile bodies and fields this server does not implement are each
a 400 naming the field."""

import json
import time

import pytest

from dsv4ray.entrypoints.openai.json_body import MAX_INT_DIGITS, MAX_JSON_DEPTH
from dsv4ray.entrypoints.openai.protocol import (
    INFORMATIONAL,
    NEUTRAL_VALUES,
    NOT_IMPLEMENTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)

GOOD = b'{"model": ".tiny", "prompt": "Hello", "max_tokens": 4'


def rejected(body: bytes, model_cls=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model_cls, body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # the body itself can be sent
    return err


LONE_SURROGATES = [
    (GOOD + rb', "stop": "\ud800"}', "stop"),
    (GOOD + rb', "stop": ["ok", "a\udfffb"]}', "stop.1"),
    (rb'{"model": ".tiny", "prompt": "\udbff"}', "prompt"),
    (rb'{"model": ".tiny", "prompt": ["x\ud800"]}', "prompt.0"),
    (rb'{"model": "\ud800", "prompt": "x"}', "model"),
    (GOOD + rb', "user": "\ud800"}', "user"),
    (GOOD + rb', "stream_options": {"x": "\ud800"}}', "stream_options.x"),
    (GOOD + rb', "unknown_extra": ["\ud800"]}', "unknown_extra.0"),
]


@pytest.mark.parametrize("body, param", LONE_SURROGATES)
def test_lone_surrogates_in_completion_fields_name_the_field(body, param):
    err = rejected(body)
    assert err.param == param and "UTF-8" in err.message


def test_lone_surrogates_in_chat_messages_name_the_message_field():
    head = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, '
    err = rejected(head + rb'{"role": "user", "content": "\ud800"}]}', ChatCompletionRequest)
    assert err.param == "messages.1.content"
    parts = rb'{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}'
    err = rejected(head + parts, ChatCompletionRequest)
    assert err.param == "messages.1.content.0.text"
    err = rejected(head + rb'{"role": "user", "content": "x", "name": "\ud800"}]}',
                   ChatCompletionRequest)  # fmt: skip
    assert err.param == "messages.1.name"


def test_a_lone_surrogate_in_a_key_is_refused():
    assert rejected(GOOD + rb', "\ud800": 1}').param is None
    assert rejected(GOOD + rb', "stream_options": {"\ud800": 1}}').param == "stream_options"


def test_valid_non_ascii_and_paired_surrogate_escapes_pass():
    request = parse_request(CompletionRequest, GOOD + rb', "stop": ["\ud83d\ude00", "\u00e9"]}')
    assert request.stop == ["\U0001f600", "é"]


def test_stop_takes_an_empty_list_as_none_and_refuses_five_or_an_empty_string():
    assert parse_request(CompletionRequest, GOOD + b', "stop": []}').stop is None
    assert rejected(GOOD + b', "stop": ["a", "b", "c", "d", "e"]}').param == "stop"
    assert rejected(GOOD + b', "stop": ["a", ""]}').param == "stop"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": ".tiny", "prompt": ' + b"[" * 100_000,
        b'{"a":' * 5000,
        b'{"model": ".tiny", "prompt": "x", "a": '
        + b"[" * MAX_JSON_DEPTH
        + b"]" * MAX_JSON_DEPTH
        + b"}",
        b"[" * 1_000_000,
    ],
    ids=["100k-brackets", "5k-objects", "depth-65", "1M-brackets"],
)
def test_deep_nesting_is_a_400_before_parsing(body):
    start = time.perf_counter()
    err = rejected(body)
    assert f"deeper than {MAX_JSON_DEPTH}" in err.message
    assert time.perf_counter() - start < 2.0  # checked without recursing


def test_nesting_up_to_the_limit_and_brackets_inside_strings_pass():
    depth = MAX_JSON_DEPTH - 1  # the body object is the first level
    body = b'{"model": ".tiny", "prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
    err = rejected(body)  # past the depth check, the unknown field is what is wrong
    assert err.param == "a" and "deeper" not in err.message
    brackets = json.dumps({"model": ".tiny", "prompt": "[{" * 10_000 + '\\"['}).encode()
    assert parse_request(CompletionRequest, brackets).prompt.startswith("[{[{")


@pytest.mark.parametrize("field", ["max_tokens", "seed", "top_k", "logprobs"])
@pytest.mark.parametrize("num_digits", [MAX_INT_DIGITS + 1, 4301, 50_000])
def test_overlong_integers_name_their_field(field, num_digits):
    body = b'{"model": ".tiny", "prompt": "x", "%s": -%s}' % (field.encode(), b"9" * num_digits)
    err = rejected(body)
    assert err.param == field and f"{num_digits} digits" in err.message


def test_overlong_integer_inside_a_token_list_names_its_index():
    body = b'{"model": ".tiny", "prompt": [1, 2, %s]}' % (b"7" * 5000)
    assert rejected(body).param == "prompt.2"


def test_integers_up_to_the_digit_limit_reach_the_field_checks():
    err = rejected(b'{"model": ".tiny", "prompt": "x", "seed": %s}' % (b"9" * MAX_INT_DIGITS))
    assert err.param == "seed" and "64-bit" in err.message


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "max_tokens"])
def test_non_finite_numbers_are_refused_with_their_field(literal, field):
    body = b'{"model": ".tiny", "prompt": "x", "%s": %s}' % (field.encode(), literal)
    err = rejected(body)
    assert err.param == field


def test_extreme_but_valid_sampling_values_are_accepted():
    for temperature, top_p in [(1e-38, 1.0), (5e-324, 1.0), (1.0, 5e-324), (2.0, 1.0)]:
        body = json.dumps(
            {"model": ".tiny", "prompt": "x", "temperature": temperature, "top_p": top_p}
        ).encode()
        params = parse_request(CompletionRequest, body).sampling_params(4, None)
        assert params.top_p == top_p
        assert params.temperature == (0.0 if temperature < 1e-5 else temperature)  # greedy


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b'{"model": "x", "prompt": ', b"\xff\xfe{}", b"model=x&prompt=y", b"[1, 2]"],
)
def test_malformed_bodies_are_400_without_a_field(body):
    assert rejected(body).param is None


def test_large_token_prompts_parse_quickly():
    body = json.dumps({"model": ".tiny", "prompt": list(range(150_000))}).encode()
    start = time.perf_counter()
    assert len(parse_request(CompletionRequest, body).prompt) == 150_000
    assert time.perf_counter() - start < 2.0


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
REQUESTED = {  # a value of each field that asks for something this server does not do
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"input": {"mode": "block"}},
}


def chat_body(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def test_every_unimplemented_field_has_a_requesting_value():
    assert set(REQUESTED) == set(NOT_IMPLEMENTED)


@pytest.mark.parametrize("field", sorted(REQUESTED))
def test_unimplemented_fields_are_a_400_naming_them(field):
    err = rejected(chat_body(**{field: REQUESTED[field]}), ChatCompletionRequest)
    assert err.param == field and err.message.startswith(f"{field}: ")


@pytest.mark.parametrize("field", sorted(NEUTRAL_VALUES))
def test_unimplemented_fields_that_ask_for_nothing_are_accepted(field):
    for value in [None, *NEUTRAL_VALUES[field]]:
        assert parse_request(ChatCompletionRequest, chat_body(**{field: value})).model == "m"


@pytest.mark.parametrize(
    "field, value",
    [
        ("typical_p", 0.9),
        ("length_penalty", 1.0),
        ("guided_json", {}),
        ("max_token", 5),
        ("best_of", 2),
    ],  # fmt: skip
)
def test_fields_the_api_does_not_define_are_a_400_naming_them(field, value):
    err = rejected(chat_body(**{field: value}), ChatCompletionRequest)
    assert err.param == field and "not implement" in err.message


@pytest.mark.parametrize("key", ["cache_control", "txt"])
def test_unknown_keys_of_a_content_part_are_a_400_naming_them(key):
    part = {"type": "text", "text": "hi", key: {"type": "ephemeral"}}
    err = rejected(chat_body(messages=[{"role": "user", "content": [part]}]), ChatCompletionRequest)
    assert err.param == f"messages.0.content.0.{key}"


def test_informational_fields_are_accepted():
    values = {"metadata": {"team": "a"}, "store": True, "service_tier": "auto",
              "prompt_cache_key": "k", "prompt_cache_options": {"ttl": "1h"},
              "prompt_cache_retention": "24h", "safety_identifier": "u1"}  # fmt: skip
    assert set(values) == set(INFORMATIONAL)
    assert parse_request(ChatCompletionRequest, chat_body(**values, user="u")).user == "u"


@pytest.mark.parametrize("field", ["function_call", "audio"])
def test_message_fields_for_functions_and_audio_are_refused(field):
    message = {"role": "assistant", "content": "x", field: {"id": "1"}}
    messages = [message, {"role": "user", "content": "hi"}]
    err = rejected(chat_body(messages=messages), ChatCompletionRequest)
    assert err.param == f"messages.0.{field}"


def test_a_message_echoed_back_from_an_answer_keeps_its_reasoning_for_the_template():
    answer = {"role": "assistant", "content": "4", "reasoning_content": "2+2", "refusal": None,
              "annotations": [], "tool_calls": None}  # fmt: skip
    request = parse_request(ChatCompletionRequest, chat_body(messages=[answer]))
    assert request.template_messages() == [
        {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    ]
    assert not request.thinking
    thinking = parse_request(
        ChatCompletionRequest, chat_body(chat_template_kwargs={"thinking": True})
    )
    assert thinking.thinking


def test_an_answer_from_the_openai_client_sent_back_as_history_is_accepted():
    """A streamed answer joined by the client keeps each call's index, a parsed one carries
    parsed and parsed_arguments: accepted, none of them reaches the prompt."""
    call = {
        "id": "call_1",
        "type": "function",
        "index": 0,
        "function": {"name": "ping", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}},
    }
    answer = {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None,
              "refusal": None}  # fmt: skip
    messages = [CHAT["messages"][0], answer,
                {"role": "tool", "tool_call_id": "call_1", "content": "pong"}]  # fmt: skip
    request = parse_request(ChatCompletionRequest, chat_body(messages=messages))
    plain = {"id": "call_1", "type": "function",
             "function": {"name": "ping", "arguments": '{"a": 1}'}}  # fmt: skip
    assert request.template_messages()[1] == {"role": "assistant", "content": "",
                                              "tool_calls": [plain]}  # fmt: skip
    bad = dict(call, index="0")
    err = rejected(chat_body(messages=[CHAT["messages"][0], dict(answer, tool_calls=[bad])]),
                   ChatCompletionRequest)  # fmt: skip
    assert err.param == "messages.1.tool_calls.0.index"


NULLABLE_DEFAULTS = {  # request field -> the parsed request's value for null and for omitted
    "n": 1, "stream": False, "frequency_penalty": 0.0, "presence_penalty": 0.0, "top_k": -1,
    "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0, "ignore_eos": False,
    "return_token_ids": False, "logprobs": False,
}  # fmt: skip


@pytest.mark.parametrize("field", sorted(NULLABLE_DEFAULTS))
def test_null_asks_for_the_default(field):
    """OpenAI's client sends an unset option as null: the field's default, never a 400."""
    request = parse_request(ChatCompletionRequest, chat_body(**{field: None}))
    assert getattr(request, field) == NULLABLE_DEFAULTS[field]
    assert request.sampling_params(8, None) == parse_request(
        ChatCompletionRequest, chat_body()
    ).sampling_params(8, None)


def test_null_in_completions_and_stream_options_and_a_required_null():
    body = json.loads(GOOD + b"}")
    request = parse_request(CompletionRequest, json.dumps({**body, "echo": None, "n": None,
                                                           "best_of": None}).encode())  # fmt: skip
    assert (request.echo, request.n) == (False, 1)
    options = {"include_usage": None, "continuous_usage_stats": True}
    request = parse_request(ChatCompletionRequest, chat_body(stream=True, stream_options=options))
    assert not request.include_usage and request.continuous_usage
    assert rejected(chat_body(model=None), ChatCompletionRequest).param == "model"
    assert rejected(chat_body(messages=None), ChatCompletionRequest).param == "messages"
    message = {"role": None, "content": "hi"}
    assert rejected(chat_body(messages=[message]), ChatCompletionRequest).param == "messages.0.role"


def test_vllm_spellings_of_off_reach_the_sampling_parameters():
    params = parse_request(ChatCompletionRequest, chat_body(top_k=0, seed=-1)).sampling_params(
        8, None
    )
    assert (params.top_k, params.seed) == (-1, None)


def test_stream_options_take_include_obfuscation():
    for value in (True, False):
        options = {"include_usage": True, "include_obfuscation": value}
        body = chat_body(stream=True, stream_options=options)
        assert parse_request(ChatCompletionRequest, body).include_usage


@pytest.mark.parametrize(
    "message,param",
    [
        ({"role": "user", "content": "hi", "nmae": "x"}, "messages.0.nmae"),
        ({"role": "user", "content": "hi", "name": "ann"}, "messages.0.name"),
        ({"role": "user", "content": "hi", "tool_call_id": "c1"}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "hi", "prefix": True}, "messages.0.prefix"),
    ],
)
def test_unknown_or_unrendered_message_keys_are_a_400_naming_them(message, param):
    err = rejected(chat_body(messages=[message]), ChatCompletionRequest)
    assert err.param == param


CALL = {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
         "messages.0.content"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "zzz", "content": "pong"}], "messages.2.tool_call_id"),
        ([{"role": "tool", "tool_call_id": "c1", "content": "pong"}], "messages.0.tool_call_id"),
    ],
)  # fmt: skip
def test_messages_without_content_or_answering_no_call_are_a_400_naming_them(messages, param):
    err = rejected(chat_body(messages=messages), ChatCompletionRequest)
    assert err.param == param, err.message


def test_a_tool_message_answers_an_earlier_call_and_an_assistant_call_needs_no_content():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "pong"}]  # fmt: skip
    assert len(parse_request(ChatCompletionRequest, chat_body(messages=messages)).messages) == 3


def test_a_strict_json_schema_keeps_every_object_to_its_properties():
    inner = {"type": "object", "properties": {"b": {"type": "string"}}}
    opened = {"type": "object", "additionalProperties": True}
    schema = {"type": "object", "properties": {"a": inner, "c": {"type": "array", "items": inner}},
              "$defs": {"d": {"properties": {"e": {}}}, "open": opened}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    loose = parse_request(ChatCompletionRequest, chat_body(response_format=fmt))
    assert loose.sampling_params(16, None).structured_output == {"json": schema}
    fmt["json_schema"]["strict"] = True
    strict = parse_request(ChatCompletionRequest, chat_body(response_format=fmt))
    got = strict.sampling_params(16, None).structured_output["json"]
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["items"]["additionalProperties"] is False
    assert got["$defs"]["d"]["additionalProperties"] is False  # properties make it an object
    assert got["$defs"]["open"]["additionalProperties"] is True  # what the schema says stays
    assert "additionalProperties" not in schema  # the request's own schema is left as it was


def test_stream_options_accept_continuous_usage_and_refuse_unknown_keys():
    ok = chat_body(stream=True, stream_options={"include_usage": True,
                                                "continuous_usage_stats": True})  # fmt: skip
    request = parse_request(ChatCompletionRequest, ok)
    assert request.include_usage and request.continuous_usage
    err = rejected(chat_body(stream=True, stream_options={"include_usage": True, "x": 1}),
                   ChatCompletionRequest)  # fmt: skip
    assert err.param == "stream_options.x"


@pytest.mark.parametrize(
    "fields,thinking",
    [
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "xhigh"}, True),
        ({"reasoning_effort": "max"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": False, "thinking": False}}, False),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"thinking": True}}, True),
        ({}, False),
    ],
)
def test_reasoning_effort_and_enable_thinking_set_the_thinking_mode(fields, thinking):
    request = parse_request(ChatCompletionRequest, chat_body(**fields))
    assert request.thinking is thinking
    assert request.template_kwargs().get("thinking", False) is thinking
    assert "enable_thinking" not in request.template_kwargs()
    # only "max" has an instruction of its own in the chat format
    want_effort = "max" if fields.get("reasoning_effort") == "max" else None
    assert request.template_kwargs().get("reasoning_effort") == want_effort


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"reasoning_effort": "maximum"}, "reasoning_effort"),
        (
            {"reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}},
            "reasoning_effort",
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": "yes"}},
            "chat_template_kwargs.enable_thinking",
        ),
    ],  # fmt: skip
)
def test_thinking_options_that_cannot_hold_are_a_400_naming_them(fields, param):
    assert rejected(chat_body(**fields), ChatCompletionRequest).param == param


def test_a_prefix_is_the_last_message_and_an_assistant_one():
    prefix = {"role": "assistant", "content": "def f(", "prefix": True}
    request = parse_request(ChatCompletionRequest, chat_body(messages=[CHAT["messages"][0],
                                                                       prefix]))  # fmt: skip
    assert request.template_messages()[-1] == {"role": "assistant", "content": "def f(",
                                               "prefix": True}  # fmt: skip
    early = [prefix, CHAT["messages"][0]]
    assert rejected(chat_body(messages=early), ChatCompletionRequest).param == "messages.0.prefix"


def test_sampling_controls_reach_the_sampling_parameters():
    body = chat_body(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.3,
                     min_p=0.1, min_tokens=2, logit_bias={"7": 5.0, "11": -100})  # fmt: skip
    params = parse_request(ChatCompletionRequest, body).sampling_params(16, None)
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -1.0)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.3, 0.1, 2)
    assert params.logit_bias == ((7, 5.0), (11, -100.0))


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 17}, "min_tokens"),  # beyond max_tokens 16
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),  # a digit, not a token id
    ],
)
def test_sampling_controls_out_of_range_are_a_400_naming_them(fields, param):
    request = parse_request(ChatCompletionRequest, chat_body(**fields))
    with pytest.raises(APIError) as err:
        request.sampling_params(16, None)
    assert err.value.param == param


@pytest.mark.parametrize(
    "response_format,spec",
    [({"type": "text"}, None), ({"type": "json_object"}, {"json_object": True}),
     ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"},
                                              "strict": True}}, {"json": {"type": "integer"}})],
)  # fmt: skip
def test_response_format_becomes_the_structured_output_constraint(response_format, spec):
    request = parse_request(ChatCompletionRequest, chat_body(response_format=response_format))
    assert request.sampling_params(16, None).structured_output == spec


@pytest.mark.parametrize(
    "response_format,param",
    [({"type": "json_schema"}, "response_format.json_schema"),
     ({"type": "xml"}, "response_format.type"),
     ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"},
                                              "bogus": 1}}, "response_format.json_schema.bogus"),
     ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/nowhere"}}},
      "response_format"),
     ({"type": "json_object", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
      "response_format.json_schema"),  # a schema the type would leave unused
     ({"type": "text", "json_schema": {"name": "n", "schema": {}}}, "response_format.json_schema")],
)  # fmt: skip
def test_a_response_format_that_cannot_hold_is_a_400_naming_it(response_format, param):
    body = chat_body(response_format=response_format)
    try:
        request = parse_request(ChatCompletionRequest, body)
        request.sampling_params(16, None)
    except APIError as err:
        assert err.param == param, err.message
    else:
        raise AssertionError("accepted")


def test_seeds_take_the_whole_signed_64_bit_range():
    low = parse_request(CompletionRequest, GOOD + b', "seed": -9223372036854775808}')
    high = parse_request(CompletionRequest, GOOD + b', "seed": 9223372036854775807}')
    assert (low.seed, high.seed) == (-(2**63), 2**63 - 1)
    assert rejected(GOOD + b', "seed": 9223372036854775808}').param == "seed"
    assert rejected(GOOD + b', "seed": -9223372036854775809}').param == "seed"


@pytest.mark.parametrize(
    "fields, param",
    [
        ('"prompt": ["a", "b"], "n": 33', "n"),
        ('"prompt": ["a", "b"], "n": 2, "best_of": 40', "best_of"),
        ('"prompt": ' + json.dumps(["p"] * 65), "prompt"),
    ],
)
def test_too_many_runs_name_the_field_that_asked_for_them(fields, param):
    body = b'{"model": ".tiny", "max_tokens": 4, ' + fields.encode() + b"}"
    err = rejected(body)
    assert "prompts x max(n, best_of)" in err.message and err.param == param

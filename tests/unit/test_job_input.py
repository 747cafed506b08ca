"""Batch job input lines: every SamplingParams field, logit_bias with JSON's string keys, and
the line's problem named."""

import json

import pytest

from dsv4ray.entrypoints.job_input import parse_line, sampling_params


def test_a_line_takes_every_sampling_field_and_logit_bias_by_token_id():
    line = json.dumps({"id": 3, "prompt": "hi", "max_tokens": 5, "frequency_penalty": 0.5,
                       "min_tokens": 2, "min_p": 0.1, "logit_bias": {"7": 1.5}})  # fmt: skip
    req_id, item = parse_line(line, 16)
    params = sampling_params(json.loads(json.dumps(item["params"])))  # as a replica reads it
    assert req_id == "3" and params.max_tokens == 5 and params.min_tokens == 2
    assert params.frequency_penalty == 0.5 and params.logit_bias == ((7, 1.5),)


@pytest.mark.parametrize(
    "fields,problem",
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"min_tokens": 99}, "min_tokens"),
        ({"typical_p": 0.5}, "unknown field 'typical_p'"),
    ],
)
def test_a_bad_sampling_field_is_the_lines_error_named(fields, problem):
    with pytest.raises(ValueError, match=problem):
        parse_line(json.dumps({"id": 1, "prompt": "hi", **fields}), 16)


def test_a_line_asks_for_json_with_openais_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    messages = [{"role": "user", "content": "hi"}]
    line = json.dumps({"id": "j", "messages": messages, "response_format": response_format})
    _, item = parse_line(line, 16)
    assert sampling_params(item["params"]).structured_output == {"json": schema}
    with pytest.raises(ValueError, match="'response_format'"):
        parse_line(json.dumps({"id": 1, "prompt": "p", "response_format": {"type": "xml"}}), 16)

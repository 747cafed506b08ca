"""SamplingParams validation and the msgpack-friendly output records."""

import math

import msgpack
import pytest

from dsv4ray.engine.outputs import RequestMetrics, RequestOutput
from dsv4ray.engine.sampling import SamplingParams


def test_defaults_are_greedy_and_16_tokens():
    params = SamplingParams()
    assert params.is_greedy and params.max_tokens == 16
    assert (params.top_p, params.top_k, params.seed, params.logprobs) == (1.0, -1, None, None)
    assert params.stop == () and params.stop_token_ids == ()


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.max_tokens = 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": "\ud800"}, "stop"),
        ({"stop": ["ok", "a\udfffb"]}, "stop"),
        ({"top_p": math.nan}, "top_p"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        # past these the penalised logits or the msgpack-encoded plans overflow
        ({"repetition_penalty": 1e-38}, "repetition_penalty"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty"),
        ({"repetition_penalty": 101.0}, "repetition_penalty"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 5e-324])
def test_temperatures_below_the_epsilon_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=2e-5).is_greedy


def test_valid_edges_are_accepted():
    params = SamplingParams(temperature=2, top_p=1e-6, top_k=1, logprobs=20, seed=-5)
    assert params.temperature == 2.0 and isinstance(params.temperature, float)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_vllm_spellings_of_off_and_unbounded():
    """As vLLM takes them: top_k 0 is off, seed -1 is no seed, max_tokens None runs to the
    context's end; each stored as this engine's own spelling."""
    params = SamplingParams(top_k=0, seed=-1, max_tokens=None)
    assert (params.top_k, params.seed, params.max_tokens) == (-1, None, 2**63 - 1)
    assert params == SamplingParams(top_k=-1, seed=None, max_tokens=2**63 - 1)
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_dict_round_trip_through_msgpack():
    params = SamplingParams(max_tokens=5, temperature=0.7, stop=["x"], stop_token_ids=[9], seed=3)
    wire = msgpack.unpackb(msgpack.packb(params.to_dict()), raw=False)
    assert SamplingParams.from_dict(wire) == params
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"best_of": 2})


def test_request_output_round_trip_through_msgpack():
    out = RequestOutput(
        request_id="r1",
        prompt_token_ids=[1, 2],
        token_ids=[5, 6],
        text="hi",
        logprobs=[{5: -0.1, 7: -2.5}, {6: -0.3}],
        finish_reason="length",
        metrics=RequestMetrics(num_prompt_tokens=2, num_cached_tokens=0, ttft_s=0.5, e2e_s=1.0),
    )
    wire = msgpack.unpackb(msgpack.packb(out.to_dict()), raw=False)
    back = RequestOutput.from_dict(wire)
    assert back == out and back.finished
    assert RequestOutput("r2", [1]).finish_reason is None


def test_request_output_rejects_unknown_finish_reasons():
    with pytest.raises(ValueError, match="finish_reason"):
        RequestOutput("r", [1], finish_reason="eos")

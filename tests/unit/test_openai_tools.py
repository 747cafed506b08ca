"""Tool calls over HTTP, seen by the real ``openai`` client, with a scripted fake engine: the
tools reach the prompt as the V4 chat encoding renders them, the answer's call block comes back
as ``tool_calls`` (the same streamed and whole), anything that is not a valid call stays text,
and forced choices constrain the engine's sampling."""

import json

import openai
import pytest
from starlette.testclient import TestClient

from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions
from dsv4ray.text.chat_encoding import THINK_END
from dsv4ray.text.dsml import no_call_grammar
from tests.unit.openai_fake import FakeEngine

MODEL = "tiny-test"
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CLOCK = {"name": "now", "description": "The time.", "parameters": {"type": "object"}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, CLOCK)]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
BLOCK = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n'
    "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]


@pytest.fixture
def engine(fake_model_dir) -> FakeEngine:
    return FakeEngine(fake_model_dir, max_model_len=4096)  # the tools' text is ~1.5k tokens


@pytest.fixture
def client(engine) -> openai.OpenAI:
    server = OpenAIServer(engine, ServerOptions(MODEL), ServeMetrics(MODEL))
    http = TestClient(server.app, base_url="http://127.0.0.1:8000")
    return openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-", http_client=http)


def script(engine: FakeEngine, text: str) -> None:
    engine.reply = engine.tokenizer.encode(text, add_bos=False)


def ask(client, stream: bool, **fields):
    """(content, reasoning, [(name, arguments)], call ids, finish_reason) of one chat answer,
    whole or assembled from its stream."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2000, **fields}
    extra = {k: body.pop(k) for k in ("chat_template_kwargs",) if k in body}
    body["extra_body"] = extra
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        msg = choice.message
        calls = msg.tool_calls or []
        reasoning = getattr(msg, "reasoning_content", None)
        return (msg.content, reasoning, [(c.function.name, json.loads(c.function.arguments))
                                         for c in calls], [c.id for c in calls],
                choice.finish_reason)  # fmt: skip
    content, reasoning, calls, ids, finish = None, None, [], [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        # no empty chunks while the parser holds back text that may open a call block
        assert delta.model_dump(exclude_none=True) or chunk.choices[0].finish_reason
        if delta.content:
            content = (content or "") + delta.content
        if getattr(delta, "reasoning_content", None):
            reasoning = (reasoning or "") + delta.reasoning_content
        for call in delta.tool_calls or []:
            assert call.index == len(calls)  # each call arrives whole, in order
            calls.append((call.function.name, json.loads(call.function.arguments)))
            ids.append(call.id)
    return content, reasoning, calls, ids, finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_block_comes_back_as_tool_calls(client, engine, stream):
    script(engine, "Let me check.\n\n" + BLOCK)
    content, reasoning, calls, ids, finish = ask(client, stream)
    assert (content, reasoning, calls, finish) == ("Let me check.", None, CALLS, "tool_calls")
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    functions = [t["function"] for t in TOOLS]
    assert engine.requests[-1][0] == engine.tokenizer.encode_chat(MESSAGES, tools=functions)
    script(engine, BLOCK)  # calls only: no content at all
    assert ask(client, stream)[:3] == (None, None, CALLS)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "reply",
    [
        BLOCK.replace(">2<", ">two<"),  # not JSON
        BLOCK.replace("get_weather", "get_wether"),  # no such tool
        BLOCK.replace('"city"', '"town"'),  # the required city is missing
        BLOCK[:120],  # cut off by max_tokens or a stop string
    ],
)
def test_what_is_not_a_valid_call_stays_text(client, engine, stream, reply):
    script(engine, "Sure.\n\n" + reply)
    content, _, calls, _, finish = ask(client, stream)
    assert (content, calls, finish) == ("Sure.\n\n" + reply, [], "stop")


def test_a_streamed_answer_sent_back_as_history_is_accepted(client, engine):
    """The openai client's own streamed answer (its calls keep their index) goes back into the
    conversation as it is, with or without its None fields."""
    script(engine, BLOCK)
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        max_tokens=2000) as stream:  # fmt: skip
        answer = stream.get_final_completion().choices[0].message
    assert [c.function.name for c in answer.tool_calls] == [name for name, _ in CALLS]
    results = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in answer.tool_calls]
    script(engine, "Sunny.")
    for echoed in (answer.model_dump(exclude_none=True), answer.model_dump()):
        history = [*MESSAGES, echoed, *results]
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
        assert reply.choices[0].message.content == "Sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(client, engine, stream):
    script(engine, BLOCK)
    assert ask(client, stream, parallel_tool_calls=False)[2] == CALLS[:1]


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_answers_reason_then_call(client, engine, stream):
    script(engine, f"Paris needs weather.{THINK_END}\n\n{BLOCK}")
    got = ask(client, stream, chat_template_kwargs={"thinking": True})
    assert got[:3] == (None, "Paris needs weather.", CALLS) and got[4] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_renders_the_tools_and_makes_no_call(client, engine, stream):
    script(engine, BLOCK)  # what a model could write if nothing kept it out
    assert ask(client, stream, tool_choice="none")[:3] == (BLOCK, None, [])
    prompt, params = engine.requests[-1][:2]
    functions = [t["function"] for t in TOOLS]
    assert prompt == engine.tokenizer.encode_chat(MESSAGES, None, functions)
    assert params.structured_output == {"grammar": no_call_grammar()}  # keeps the block out


def test_forced_choices_send_the_call_grammar_after_the_reasoning(client, engine):
    script(engine, BLOCK)
    ask(client, False)
    assert engine.requests[-1][1].structured_output is None  # auto: the model decides
    named = {"type": "function", "function": {"name": "now"}}
    for choice in ("required", named):
        ask(client, False, tool_choice=choice)
        spec = engine.requests[-1][1].structured_output
        assert set(spec) == {"grammar"} and "now" in spec["grammar"]
    assert "get_weather" not in spec["grammar"]  # the named choice allows that function only
    ask(client, False, tool_choice="required", chat_template_kwargs={"thinking": True})
    spec = engine.requests[-1][1].structured_output
    assert spec["after_token"] == engine.tokenizer.think_end_id


def test_a_conversation_with_calls_and_results_renders_them(client, engine):
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]  # fmt: skip
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]  # fmt: skip
    script(engine, "It is sunny.")
    assert ask(client, False, messages=messages)[:3] == ("It is sunny.", None, [])
    prompt = engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False)
    assert prompt.endswith(
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         "messages.0.tool_calls"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
         "tools.0.function.parameters"),
        ({"functions": [WEATHER]}, "functions"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1]"}}]},
          {"role": "tool", "tool_call_id": "c", "content": "noon"}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"messages": [*MESSAGES, {"role": "assistant", "content": None},
                       {"role": "user", "content": "and?"}]}, "messages.1.content"),
        ({"tool_choice": "required", "stop": ["\n"]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a\nb": {}}}}}]}, "tools.0.function.parameters"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(client, engine, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, False, **fields)
    assert info.value.body["param"] == param
    assert engine.requests == []


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_boolean_subschema_is_a_parameter_of_any_value(client, engine, choice):
    """true in properties is valid JSON Schema: the call's other values are still read by type,
    and a forced call's grammar takes it as any value."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": True, "n": {"type": "integer"}}}}}  # fmt: skip
    script(engine, '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
                   '<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
                   '<｜DSML｜parameter name="n" string="true">3</｜DSML｜parameter>\n'
                   "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")  # fmt: skip
    got = ask(client, False, tools=[tool], tool_choice=choice)
    assert got[2] == [("f", {"a": "x", "n": 3})] and got[4] == "tool_calls"


def test_an_assistant_prefix_may_carry_only_its_reasoning(client, engine):
    """The reasoning a prefix continues needs no content; a plain assistant turn without content
    or calls is refused (above)."""
    script(engine, "so it is sunny.")
    prefix = {"role": "assistant", "reasoning_content": "Let me think", "prefix": True}
    got = ask(client, False, messages=[*MESSAGES, prefix],
              chat_template_kwargs={"thinking": True})  # fmt: skip
    assert got[1] is not None and "sunny" in got[1] + (got[0] or "")
    prompt = engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False)
    assert prompt.endswith("Let me think")

"""DeepSeek-V4 tool calls (text/dsml.py, entrypoints/tool_calls.py): tools and calls rendered
in the V4 chat encoding, generated call blocks parsed however the stream cuts them, anything
unreadable given back as the text it was, and the grammar that forces a call accepting exactly
the calls the tools allow."""

import itertools
import json

import pytest
import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.structured import grammar
from dsv4ray.entrypoints.tool_calls import ChatTools, constrained
from dsv4ray.text import dsml
from dsv4ray.text.chat_encoding import encode_messages
from dsv4ray.text.tokenizer import Tokenizer
from dsv4ray.worker.sampling.grammar import Grammars
from dsv4ray.worker.sampling.sampler import GREEDY, sample_batch_async

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["C", "F"]},
            "days": {"type": "integer"},
            "alerts": {"type": "boolean"},
        },
        "required": ["city", "unit"],
    },
}
CLOCK = {"name": "now", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
# a call block as the V4 format writes it, typed out from the format's description
PARIS = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n'
    "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def tools(choice=None, parallel=None) -> ChatTools:
    return ChatTools.from_request(TOOLS, choice, parallel)


def parse(text: str, check=lambda name, args: args, cuts=()) -> list[tuple]:
    """Events of ``text`` pushed in pieces cut at ``cuts``, adjacent texts joined."""
    parser = dsml.CallParser(check)
    bounds = [0, *cuts, len(text)]
    events = []
    for a, b in itertools.pairwise(bounds):
        events += parser.push(text[a:b])
    events += parser.finish()
    joined = []
    for kind, value in events:
        if joined and kind == joined[-1][0] == "text":
            joined[-1] = ("text", joined[-1][1] + value)
        else:
            joined.append((kind, value))
    return joined


# ---- rendering --------------------------------------------------------------------------


def test_a_tool_conversation_renders_as_the_v4_encoding_writes_it():
    calls = [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},  # answers out of order
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    functions = [WEATHER, CLOCK]
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    got = encode_messages(messages, {}, tools=functions)
    system, rest = got.split(USER, 1)
    assert system.startswith(f"{BOS}Be brief.\n\n## Tools\n\n")
    assert f"### Available Tool Schemas\n\n{schemas}\n\nYou MUST strictly follow" in system
    assert rest == (
        f"Paris?{ASSISTANT}</think>Looking.\n\n{PARIS}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>"
        f"{ASSISTANT}</think>"
    )


def test_tools_without_a_system_message_get_their_own_system_text():
    got = encode_messages([{"role": "user", "content": "hi"}], {}, tools=[CLOCK])
    assert got.startswith(f"{BOS}\n\n## Tools\n\n") and got.endswith(f"{USER}hi{ASSISTANT}</think>")
    assert encode_messages([{"role": "user", "content": "hi"}], {}) == (
        f"{BOS}{USER}hi{ASSISTANT}</think>"
    )


def test_rendered_calls_parse_back_to_the_same_calls():
    calls = [("get_weather", {"city": "a</｜DSML｜invoke>b", "days": 3, "x": [1, {"y": None}]}),
             ("now", {})]  # fmt: skip
    events = parse(dsml.BEFORE_CALLS + dsml.render_calls(calls))
    assert events == [("call", dsml.ToolCall(n, a)) for n, a in calls]


# ---- parsing ----------------------------------------------------------------------------

STREAMS = {
    "text and two calls": ("It is:\n\n" + PARIS, "It is:", 2),
    "text after the block": ("a\n\n" + PARIS + " done", "a", 2),
    "only a call": (PARIS, "", 2),
    "no call": ("plain <｜DSML｜ text\n\n", "plain <｜DSML｜ text\n\n", 0),
}


@pytest.mark.parametrize("name", STREAMS)
def test_the_parser_gives_the_same_events_however_the_stream_is_cut(name):
    text, want_text, num_calls = STREAMS[name]
    whole = parse(text)
    calls = [v for k, v in whole if k == "call"]
    assert len(calls) == num_calls
    assert "".join(v for k, v in whole if k == "text").startswith(want_text)
    if num_calls:
        assert calls[0] == dsml.ToolCall("get_weather", {"city": "Paris", "days": 3})
        assert calls[1] == dsml.ToolCall("now", {})
    for a, b in itertools.combinations(range(1, len(text)), 2):
        assert parse(text, cuts=(a, b)) == whole, (a, b)
    assert parse(text, cuts=range(1, len(text))) == whole


@pytest.mark.parametrize(
    "bad",
    [
        PARIS.replace('string="false">3', 'string="false">3x'),  # not JSON
        PARIS.replace('string="true">Paris', 'string="maybe">Paris'),
        PARIS.replace("</｜DSML｜invoke>\n</｜DSML｜tool_calls>", "junk</｜DSML｜tool_calls>"),
        PARIS.replace('name="days"', 'name="city"'),  # a parameter twice
        PARIS[: len(PARIS) // 2],  # unfinished when the text ends
    ],
)
def test_an_unreadable_block_is_given_back_as_the_text_it_was(bad):
    text = "Sure.\n\n" + bad
    events = parse(text)
    called = [v for k, v in events if k == "call"]
    given_back = "".join(v for k, v in events if k == "text")
    # calls read before the bad invoke stay calls; everything from the bad one on is text
    assert given_back.startswith("Sure.")
    assert text.endswith(given_back[len("Sure.") :]) and len(called) <= 1
    rebuilt = "Sure.\n\n" + dsml.render_calls([(c.name, c.arguments) for c in called])
    if called:
        assert text.startswith(rebuilt.removesuffix("\n</｜DSML｜tool_calls>"))
    else:
        assert given_back == text


def test_a_block_the_text_ends_inside_keeps_its_calls_and_adds_no_text():
    # the answer stopped (eos, max_tokens) after whole invokes: their calls stand, and the line
    # breaks after the last one are the block's layout, not text of the answer
    unclosed = PARIS.removesuffix("</｜DSML｜tool_calls>")
    for cut in range(len(unclosed)):
        events = parse("Sure.\n\n" + unclosed, cuts=(cut,))
        assert "".join(v for k, v in events if k == "text") == "Sure."
        assert [v.name for k, v in events if k == "call"] == ["get_weather", "now"]


def test_a_call_its_check_refuses_and_all_after_it_are_text():
    refuse_now = lambda name, args: "no" if name == "now" else args  # noqa: E731
    events = parse("a\n\n" + PARIS, refuse_now)
    weather = dsml.ToolCall("get_weather", {"city": "Paris", "days": 3})
    assert events[:2] == [("text", "a"), ("call", weather)]
    assert events[2] == ("text", PARIS[PARIS.index('\n<｜DSML｜invoke name="now"') :])


# ---- checking against the request's tools -----------------------------------------------


def test_answers_become_openai_tool_calls_checked_against_their_schema():
    content, calls, finish = tools().answer("It is:\n\n" + PARIS.replace(
        '"city" string="true">Paris', '"unit" string="true">C</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="city" string="true">Paris'), "stop")  # fmt: skip
    assert (content, finish) == ("It is:", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"unit": "C", "city": "Paris",
                                                             "days": 3}  # fmt: skip
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # the first invoke lacks the required "unit": both calls stay text, the answer a plain stop
    content, calls, finish = tools().answer(PARIS, "stop")
    assert (content, calls, finish) == (PARIS, [], "stop")
    # a value given as text where the schema wants a number is read as JSON
    _, calls, _ = tools().answer(PARIS.replace('"days" string="false"', '"days" string="true"')
                                 .replace('"city" string="true">Paris',
                                          '"city" string="true">P</｜DSML｜parameter>\n'
                                          '<｜DSML｜parameter name="unit" string="true">F'),
                                 "stop")  # fmt: skip
    assert json.loads(calls[0]["function"]["arguments"])["days"] == 3
    # parallel_tool_calls false keeps the first; a length cut keeps "length"
    block = PARIS.replace('"days"', '"unit"').replace(">3<", '>"C"<')
    assert len(tools(parallel=False).answer(block, "stop")[1]) == 1
    assert tools().answer("abc", "length") == ("abc", [], "length")


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}]}, "tools.0.function.parameters"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(fields, field):
    with pytest.raises(ValueError) as info:
        ChatTools.from_request(
            fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls")
        )
    assert str(info.value).startswith(field)


def test_choice_none_keeps_calls_out_and_forced_choices_constrain_the_answer():
    none = ChatTools.from_request(TOOLS, "none")
    assert none.prompt_functions() == [t["function"] for t in TOOLS]  # the tools as context
    spec = constrained(SamplingParams(max_tokens=8), none, True, 261).structured_output
    assert spec == {"grammar": dsml.no_call_grammar(), "after_token": 261}
    json_answer = SamplingParams(structured_output={"json_object": True})
    got = constrained(json_answer, none, False, None).structured_output
    assert got == {"json_object": True}  # response_format's grammar makes no call either
    assert none.check("add", {}) == "tool_choice is none"  # a call made anyway stays text
    assert ChatTools.from_request([], "auto") is None
    params = SamplingParams(max_tokens=8)
    assert constrained(params, tools(), False, 261) is params  # auto: the model decides
    forced = constrained(params, tools("required"), True, 261).structured_output
    assert forced["after_token"] == 261 and "grammar" in forced
    with pytest.raises(ValueError, match="^tool_choice"):
        constrained(SamplingParams(structured_output={"json_object": True}),
                    tools("required"), False, None)  # fmt: skip


# ---- the forcing grammar ----------------------------------------------------------------


@pytest.fixture(scope="module")
def matcher_for(tiny_ckpt, tiny_model):
    from llguidance import LLMatcher, LLTokenizer

    tok = Tokenizer(tiny_ckpt)
    ll = LLTokenizer(f"{tiny_ckpt}/tokenizer.json", n_vocab=tiny_model.cfg.vocab_size,
                     eos_token=tok.eos_token_id)  # fmt: skip

    def accepts(spec: dict, text: str) -> bool:
        matcher = LLMatcher(ll, grammar(spec))
        assert not matcher.is_error(), matcher.get_error()
        ok = matcher.consume_tokens(tok.encode(text, add_bos=False))
        return ok and matcher.is_accepting()

    return accepts


def _block(*invokes: str) -> str:
    body = "".join(i + "\n" for i in invokes)
    return f"\n\n<｜DSML｜tool_calls>\n{body}</｜DSML｜tool_calls>"


def _weather(city="Paris", unit='"C"', extra="") -> str:
    unit_param = (f'<｜DSML｜parameter name="unit" string="true">{json.loads(unit)}'
                  "</｜DSML｜parameter>\n")  # fmt: skip
    return ('<｜DSML｜invoke name="get_weather">\n'
            f'<｜DSML｜parameter name="city" string="true">{city}</｜DSML｜parameter>\n'
            f"{unit_param}{extra}</｜DSML｜invoke>")  # fmt: skip


NOW = '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>'


def test_the_forcing_grammar_accepts_exactly_the_calls_the_tools_allow(matcher_for):
    required, named = (
        tools("required").structured_output(),
        tools({"type": "function", "function": {"name": "get_weather"}}).structured_output(),
    )
    days = '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    for spec, text in [
        (required, _block(_weather())),
        (required, _block(_weather("New\nYork </｜DSML｜invoke>", extra=days), NOW)),
        (required, _block(NOW)),
        (named, _block(_weather(extra=days))),
    ]:
        assert matcher_for(spec, text), text
        assert tools().answer(text, "stop")[1], text  # and the parser reads it as calls
    for spec, text in [
        (required, "plain text"),
        (required, _block('<｜DSML｜invoke name="other">\n\n</｜DSML｜invoke>')),
        (required, _block(_weather(unit='"K"'))),  # not in the enum
        (required, _block(_weather().replace("city", "town"))),  # required "city" missing
        (required, _block(_weather(extra=days.replace(">3<", ">three<")))),
        (named, _block(NOW)),  # not the named function
        (named, _block(_weather(), _weather())),  # a named choice makes one call
    ]:
        assert not matcher_for(spec, text), text


def test_masked_random_logits_always_make_a_valid_call(tiny_ckpt, tiny_model):
    """Whatever the model's logits, a forced choice ends in a call that parses and validates."""
    only_enums = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]},
                                                   "alerts": {"type": "boolean"}},
                  "required": ["unit", "alerts"]}  # fmt: skip
    forced = ChatTools.from_request([{"type": "function", "function": {
        "name": "f", "parameters": only_enums}}], "required", False)  # fmt: skip
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    for seed in range(3):
        grammars = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
        sp = SamplingParams(max_tokens=400, structured_output=forced.structured_output())
        grammars.add(NewRequest("a", 0, [0], [0], 0, -1, sp.to_dict(), 0, 0, []))
        g = torch.Generator().manual_seed(seed)
        drawn = []
        while not drawn or drawn[-1] != tok.eos_token_id:
            assert len(drawn) < 400
            logits = grammars.mask(torch.randn(1, vocab, generator=g), ["a"])
            pending = sample_batch_async(logits, [GREEDY], [0], [None])
            grammars.record(["a"], pending)
            drawn.append(pending.result()[0].token_id)
        content, calls, finish = forced.answer(tok.decode(drawn[:-1]), "stop")
        assert (content, finish, len(calls)) == (None, "tool_calls", 1)
        args = json.loads(calls[0]["function"]["arguments"])
        assert args["unit"] in ("C", "F") and isinstance(args["alerts"], bool)


def test_a_constraint_after_a_token_leaves_the_reasoning_free(tiny_ckpt, tiny_model):
    tok, vocab = Tokenizer(tiny_ckpt), tiny_model.cfg.vocab_size
    think_end = tok.think_end_id
    spec = {"choice": ["yes"], "after_token": think_end}
    grammars = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
    sp = SamplingParams(max_tokens=20, structured_output=spec)
    grammars.add(NewRequest("a", 0, [0], [0], 0, -1, sp.to_dict(), 0, 0, []))
    script = [*tok.encode("no", add_bos=False), think_end]  # free text, then </think>
    for token in script:
        logits = torch.zeros(1, vocab)
        masked = grammars.mask(logits, ["a"])
        assert torch.equal(masked, logits)  # unconstrained until </think> is drawn
        logits[0, token] = 1.0
        pending = sample_batch_async(logits, [GREEDY], [0], [None])
        grammars.record(["a"], pending)
    masked = grammars.mask(torch.zeros(1, vocab), ["a"])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert tok.encode("yes", add_bos=False)[0] in allowed and len(allowed) < vocab // 2
    # a replayed request (preempted after </think>) resumes inside the constraint
    history = [5, 6, *script, *tok.encode("ye", add_bos=False)]
    replay = Grammars(tiny_ckpt, vocab, tok.eos_token_id)
    replay.add(NewRequest("b", 0, [0], [0], 0, -1, sp.to_dict(), 0, 2, history))
    allowed = torch.isfinite(replay.mask(torch.zeros(1, vocab), ["b"])[0]).nonzero().flatten()
    assert allowed.tolist() == tok.encode("s", add_bos=False)


def _param(name: str, value: str, as_text: bool) -> str:
    flag = "true" if as_text else "false"
    return f'<｜DSML｜parameter name="{name}" string="{flag}">{value}</｜DSML｜parameter>\n'


def _one(schema: dict, choice="required") -> ChatTools:
    return ChatTools.from_request([{"type": "function", "function": {
        "name": "f", "parameters": schema}}], choice)  # fmt: skip


def _call(*params: str) -> str:
    return _block('<｜DSML｜invoke name="f">\n' + "".join(params) + "</｜DSML｜invoke>")


def test_the_forced_grammar_writes_only_calls_that_validate(matcher_for):
    """Schemas whose text form the argument check would refuse: boolean subschemas, required
    names the properties leave out, strings with checks of their own."""
    cases = {
        "boolean subschemas": (
            {"type": "object", "properties": {"a": True, "n": {"type": "integer"}, "no": False},
             "required": ["n"]},
            [_call(_param("a", "x", True), _param("n", "3", False))],
            [_call(_param("n", "3", False), _param("no", "1", False))],
        ),
        "required, not declared": (
            {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x", "y"],
             "additionalProperties": {"type": "boolean"}},
            [_call(_param("x", "1", False), _param("y", "true", False))],
            [_call(_param("x", "1", False)), _call(_param("x", "1", False),
                                                   _param("y", "2", False))],
        ),
        "nested string checks": (
            {"type": "object", "required": ["c"], "properties": {
                "c": {"anyOf": [{"type": "string", "pattern": "^[A-Z]{3}$"}]}}},
            [_call(_param("c", '"ABC"', False))],
            [_call(_param("c", "abcd", True)), _call(_param("c", '"abcd"', False))],
        ),
        "required, no properties": (
            {"type": "object", "required": ["q"]},
            [_call(_param("q", "x", True))],
            [_call()],
        ),
        "string checks": (
            {"type": "object", "required": ["code", "short", "fixed"], "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "short": {"type": "string", "maxLength": 2},
                "fixed": {"type": "string", "const": "ok"}}},
            [_call(_param("code", '"ABC"', False), _param("short", '"ab"', False),
                   _param("fixed", '"ok"', False))],
            [_call(_param("code", "ABC", True), _param("short", '"ab"', False),
                   _param("fixed", '"ok"', False)),
             _call(_param("code", '"ABCD"', False), _param("short", '"ab"', False),
                   _param("fixed", '"ok"', False)),
             _call(_param("code", '"ABC"', False), _param("short", '"abc"', False),
                   _param("fixed", '"ok"', False))],
        ),
    }  # fmt: skip
    for name, (schema, good, bad) in cases.items():
        forced = _one(schema)
        for text in good:
            assert matcher_for(forced.structured_output(), text), (name, text)
            content, calls, finish = forced.answer(text, "stop")
            assert (content, finish, len(calls)) == (None, "tool_calls", 1), (name, text)
        for text in bad:
            assert not matcher_for(forced.structured_output(), text), (name, text)
    # auto: a boolean subschema's value is kept, a number written as text is read as JSON
    auto = _one(cases["boolean subschemas"][0], "auto")
    assert auto.check("f", {"a": "x", "n": "3"}) == {"a": "x", "n": 3}


def test_tools_beside_a_json_answer_allow_a_call_or_that_json(matcher_for):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    for response in ({"json": schema}, {"json": json.dumps(schema)}, {"json_object": True}):
        spec = constrained(SamplingParams(structured_output=response), tools(), False, None)
        spec = spec.structured_output
        assert matcher_for(spec, '{"answer": "Paris"}')
        assert matcher_for(spec, _block(NOW))
        assert not matcher_for(spec, "Paris")
    content, calls, finish = tools().answer('{"answer": "Paris"}', "stop")
    assert (content, calls, finish) == ('{"answer": "Paris"}', [], "stop")
    bad = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["n"],
    }
    with pytest.raises(ValueError, match="^structured_output.json"):  # not the tools' fault
        constrained(SamplingParams(structured_output={"json": bad}), tools(), False, None)
    with pytest.raises(ValueError, match="^structured_output: .* must be JSON, not regex"):
        constrained(SamplingParams(structured_output={"regex": "a+"}), tools(), False, None)


@pytest.mark.parametrize(
    ("schema", "choice", "field"),
    [
        ({"type": "object", "properties": {"a>b": {"type": "string"}}}, "auto",
         "tools.0.function.parameters"),
        ({"type": "object", "properties": {'say "hi"': {}}}, "auto",
         "tools.0.function.parameters"),
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
          "required": ["n"]}, "required", "tools.0.function.parameters"),
    ],
)  # fmt: skip
def test_tools_no_call_can_follow_are_refused_naming_the_field(schema, choice, field):
    with pytest.raises(ValueError) as info:
        constrained(SamplingParams(max_tokens=8), _one(schema, choice), False, None)
    assert str(info.value).startswith(field + ":"), info.value


def test_a_forced_call_refuses_stop_strings_that_would_cut_it():
    with pytest.raises(ValueError, match="^stop: a forced call"):
        constrained(SamplingParams(max_tokens=8, stop=["\n"]), tools("required"), False, None)
    assert constrained(SamplingParams(max_tokens=8, stop=["\n"]), tools(), False, None)  # auto

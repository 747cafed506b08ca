"""What a generation looks like over HTTP, with a scripted fake engine and no Ray: response
bodies, SSE framing, usage, logprobs, sampling defaults, and thinking mode's reasoning split."""

import itertools
import json

import pytest
from starlette.testclient import TestClient

from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.reasoning import ReasoningSplitter
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions
from dsv4ray.text.chat_encoding import THINK_END, THINK_START, split_reasoning
from tests.unit.openai_fake import SAMPLED_LOGPROB, FakeEngine

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "2+2?"}]
THINKING = {"thinking": True}


@pytest.fixture
def client(engine) -> TestClient:
    server = OpenAIServer(engine, ServerOptions(MODEL), ServeMetrics(MODEL))
    return TestClient(server.app, base_url="http://127.0.0.1:8000")


def completion(client, **fields) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, **fields) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(client, path: str, **fields) -> list[dict]:
    """The stream's JSON events; asserts its framing: ``data: `` lines, then ``[DONE]``."""
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {"model": MODEL, **base, "stream": True, **fields}
    response = client.post(path, json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    *data, done, tail = response.text.split("\n\n")
    assert (done, tail) == ("data: [DONE]", "")
    assert all(e.startswith("data: {") and "\n" not in e for e in data)
    return [json.loads(e.removeprefix("data: ")) for e in data]


def test_completions_give_the_text_finish_reason_and_usage(client, engine):
    whole = completion(client, max_tokens=50)
    prompt_ids = engine.tokenizer.encode("hi")
    assert engine.requests[-1][0] == prompt_ids
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello, world!", "stop")
    assert whole["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(engine.reply),
        "total_tokens": len(prompt_ids) + len(engine.reply),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    cut = completion(client, max_tokens=4, return_token_ids=True)["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == ("Hell", "length")
    assert cut["token_ids"] == engine.reply[:4]
    engine.num_cached_tokens = 2
    assert completion(client)["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_openai_defaults_reach_the_engine(client, engine):
    completion(client)
    params = engine.requests[-1][1]
    assert (params.max_tokens, params.temperature, params.top_p, params.logprobs) == (
        16, 1.0, 1.0, None)  # fmt: skip
    chat(client, temperature=0, seed=5, stop=["x"], top_k=3)
    prompt, params, _ = engine.requests[-1]
    assert params.max_tokens == engine.max_model_len - len(prompt)  # chat: up to the context
    assert (params.temperature, params.seed, params.stop, params.top_k) == (0.0, 5, ("x",), 3)
    assert prompt == engine.tokenizer.encode_chat(MESSAGES)


@pytest.mark.parametrize(
    "fields,limit",
    [({"max_completion_tokens": 3}, 3), ({"max_tokens": 6}, 6),
     ({"max_tokens": 6, "max_completion_tokens": 2}, 2)],
)  # fmt: skip
def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(client, engine, fields, limit):
    chat(client, **fields)
    assert engine.requests[-1][1].max_tokens == limit


@pytest.mark.parametrize(
    "fields,named",
    [({"max_tokens": 6, "max_completion_tokens": 0}, "max_completion_tokens"),
     ({"max_completion_tokens": 0}, "max_completion_tokens"),
     ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens"),
     ({"max_completion_tokens": 10**9}, "max_completion_tokens")],
)  # fmt: skip
def test_a_bad_limit_is_a_400_naming_the_field_that_sent_it(client, fields, named):
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == named


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "field,value", [("logit_bias", {"99999": 5}), ("stop_token_ids", [3, 99999])]
)
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(client, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    response = client.post(path, json={"model": MODEL, **body, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_streamed_completions_carry_the_same_text_then_usage(client, engine):
    whole = completion(client, max_tokens=50)
    chunks = events(client, "/v1/completions", max_tokens=50)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)  # only when asked for
    with_usage = events(client, "/v1/completions", stream_options={"include_usage": True})
    *body, usage = with_usage
    assert usage["choices"] == [] and all(c["choices"] for c in body)
    assert usage["usage"] == completion(client, max_tokens=50)["usage"]
    ids = events(client, "/v1/completions", return_token_ids=True, max_tokens=5)
    assert [t for c in ids for t in c["choices"][0]["token_ids"]] == engine.reply[:5]


def test_streamed_chat_opens_with_the_role_and_ends_with_usage(client):
    whole = chat(client)
    chunks = events(client, "/v1/chat/completions", stream_options={"include_usage": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completion_logprobs_have_one_entry_per_token(client, engine):
    lp = completion(client, max_tokens=5, logprobs=2)["choices"][0]["logprobs"]
    assert lp["tokens"] == list("Hello")
    assert lp["token_logprobs"] == [SAMPLED_LOGPROB] * 5
    assert all(len(top) == 2 and max(top.values()) == SAMPLED_LOGPROB for top in lp["top_logprobs"])
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert engine.requests[-1][1].logprobs == 2


def test_chat_logprobs_carry_tokens_bytes_and_top_alternatives(client):
    got = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)["choices"][0]
    content = got["logprobs"]["content"]
    assert [e["token"] for e in content] == list("Hello")
    for entry in content:
        assert bytes(entry["bytes"]).decode() == entry["token"]
        assert entry["logprob"] == SAMPLED_LOGPROB and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    assert chat(client, max_tokens=2, logprobs=True)["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []  # fmt: skip
    streamed = events(client, "/v1/chat/completions", max_tokens=5, logprobs=True, top_logprobs=3)
    per_chunk = [c["choices"][0]["logprobs"] for c in streamed if c["choices"]]
    # each chunk carries its own token's entry; joined they are the whole answer's
    assert [len(lp["content"]) for lp in per_chunk if lp] == [1] * 5
    assert [e for lp in per_chunk if lp for e in lp["content"]] == content


def test_completion_logprobs_include_the_sampled_token_and_stream_per_chunk(client):
    zero = completion(client, max_tokens=3, logprobs=0)["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{ch: SAMPLED_LOGPROB} for ch in "Hel"]
    whole = completion(client, max_tokens=4, logprobs=1)["choices"][0]["logprobs"]
    streamed = events(client, "/v1/completions", max_tokens=4, logprobs=1)
    chunks = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"]]
    assert len(chunks) == 4
    assert [t for lp in chunks for t in lp["tokens"]] == whole["tokens"]
    assert [t for lp in chunks for t in lp["top_logprobs"]] == whole["top_logprobs"]
    assert [o for lp in chunks for o in lp["text_offset"]] == whole["text_offset"]


def script(engine: FakeEngine, text: str) -> None:
    """The fake engine answers ``text`` (think tags as the single tokens they are)."""
    engine.reply = engine.tokenizer.encode(text, add_bos=False)


def test_thinking_mode_reaches_the_template_and_splits_the_answer(client, engine):
    script(engine, f"Two and two.{THINK_END}4")
    plain = chat(client)["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": f"Two and two.{THINK_END}4"}
    assert engine.requests[-1][0][-1] == engine.tokenizer.encode(THINK_END, add_bos=False)[0]
    message = chat(client, chat_template_kwargs=THINKING)["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "Two and two.", "content": "4"}
    prompt = engine.requests[-1][0]
    assert prompt == engine.tokenizer.encode_chat(MESSAGES, THINKING)
    assert prompt[-1] == engine.tokenizer.encode(THINK_START, add_bos=False)[0]


def test_thinking_mode_streams_reasoning_and_content_deltas(client, engine):
    script(engine, f"Two and two.{THINK_END}4, as asked.")
    whole = chat(client, chat_template_kwargs=THINKING)["choices"][0]["message"]
    chunks = events(client, "/v1/chat/completions", chat_template_kwargs=THINKING)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert not any("reasoning_content" in d and "content" in d for d in deltas[1:-1])
    script(engine, "Still thinking")  # no </think>: all of it is reasoning
    unfinished = chat(client, chat_template_kwargs=THINKING, max_tokens=5)["choices"][0]
    assert (unfinished["message"]["reasoning_content"], unfinished["message"]["content"]) == (
        "Still", "")  # fmt: skip


def test_history_reasoning_reaches_the_template_when_kept(client, engine):
    history = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
               {"role": "user", "content": "3+3?"}]  # fmt: skip
    kwargs = {"thinking": True, "drop_thinking": False}
    chat(client, messages=history, chat_template_kwargs=kwargs)
    assert engine.requests[-1][0] == engine.tokenizer.encode_chat(history, kwargs)
    assert "Adding." in engine.tokenizer.decode(engine.requests[-1][0])


ANSWERS = ["", "<think>", "<thi", "</thi", "abc", f"{THINK_START}why{THINK_END}so",
           f"why{THINK_END}so{THINK_END}on", f"x{THINK_START}y", f"{THINK_END}", "a</think",
           f"{THINK_START}{THINK_END}", "<<think>think>a</</think>b"]  # fmt: skip


@pytest.mark.parametrize("text", ANSWERS)
def test_streamed_reasoning_splits_as_the_whole_text_does_however_it_is_cut(text):
    for num_cuts in range(min(len(text), 3) + 1):
        for cuts in itertools.combinations(range(1, len(text)), num_cuts):
            bounds = [0, *cuts, len(text)]
            splitter, reasoning, content = ReasoningSplitter(), "", ""
            for start, end in itertools.pairwise(bounds):
                r, c = splitter.push(text[start:end])
                reasoning, content = reasoning + r, content + c
            r, c = splitter.finish()
            assert (reasoning + r, content + c) == split_reasoning(text), (text, cuts)


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk(client, engine):
    prompt_ids = engine.tokenizer.encode_chat(MESSAGES)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(client, "/v1/chat/completions", max_tokens=4, stream_options=options)
    assert all("usage" in c for c in chunks)
    generated = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert generated == [0, 1, 2, 3, 4]  # the role chunk, then one token a chunk
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(prompt_ids)}
    assert chunks[-1]["usage"]["completion_tokens"] == 4  # the final usage chunk


@pytest.mark.parametrize(
    "fields,thinking",
    [
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ],  # fmt: skip
)
def test_reasoning_effort_and_enable_thinking_render_and_split_like_thinking(
    client, engine, fields, thinking
):
    script(engine, f"Two and two.{THINK_END}4")
    message = chat(client, **fields)["choices"][0]["message"]
    assert engine.requests[-1][0] == engine.tokenizer.encode_chat(MESSAGES, {"thinking": thinking})
    assert ("reasoning_content" in message) is thinking


def test_prefix_completion_continues_the_assistant_text_it_was_given(client, engine):
    script(engine, "4, surely.")
    prefix = [*MESSAGES, {"role": "assistant", "content": "The answer is ", "prefix": True}]
    message = chat(client, messages=prefix)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4, surely."}  # the continuation only
    prompt = engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False)
    assert prompt.endswith("<｜Assistant｜></think>The answer is ")  # no end of sentence
    # thinking mode: a prefix of reasoning alone stays open, the answer continues it
    script(engine, f" so 4.{THINK_END}4")
    open_reasoning = [*MESSAGES, {"role": "assistant", "content": "", "prefix": True,
                                  "reasoning_content": "Two and two"}]  # fmt: skip
    body = chat(client, messages=open_reasoning, chat_template_kwargs=THINKING)
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": " so 4.",
                                             "content": "4"}  # fmt: skip
    prompt = engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False)
    assert prompt.endswith(f"<｜Assistant｜>{THINK_START}Two and two")
    # a prefix with text after its reasoning: the answer is all content
    script(engine, "4.")
    closed = [*MESSAGES, {"role": "assistant", "content": "It is ", "prefix": True,
                          "reasoning_content": "Two and two"}]  # fmt: skip
    body = chat(client, messages=closed, chat_template_kwargs=THINKING)
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": "",
                                             "content": "4."}  # fmt: skip

"""POST /tokenize and /detokenize over a fake engine, without Ray: the ids are exactly those a
generation feeds the engine, detokenizing gives the text back, and bad input is OpenAI's 400."""

import pytest
from starlette.testclient import TestClient

from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions

MODEL = "tiny-test"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
KEY = "k-123"


@pytest.fixture
def client(engine) -> TestClient:
    server = OpenAIServer(engine, ServerOptions(MODEL), ServeMetrics(MODEL))
    return TestClient(server.app, base_url="http://127.0.0.1:8000")


def tokenize(client, **body) -> dict:
    response = client.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(client, tokens: list[int]) -> str:
    response = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def assert_400(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_a_prompt_tokenizes_to_what_a_completion_feeds_the_engine(client, engine):
    for prompt in ("hi", "héllo ☃, world", ""):
        got = tokenize(client, prompt=prompt)
        response = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert got["tokens"] == engine.requests[-1][0]
        assert got["count"] == len(got["tokens"]) == response.json()["usage"]["prompt_tokens"]
        assert got["max_model_len"] == engine.max_model_len
    bare = tokenize(client, prompt="hi", add_special_tokens=False)["tokens"]
    assert [engine.tokenizer.bos_token_id, *bare] == tokenize(client, prompt="hi")["tokens"]


def test_messages_tokenize_to_what_a_chat_completion_feeds_the_engine(client, engine):
    for kwargs in (None, {"thinking": True}):
        got = tokenize(client, messages=MESSAGES, chat_template_kwargs=kwargs)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
        body["chat_template_kwargs"] = kwargs
        response = client.post("/v1/chat/completions", json=body)
        assert got["tokens"] == engine.requests[-1][0]
        assert got["count"] == response.json()["usage"]["prompt_tokens"]
    thinking = tokenize(client, messages=MESSAGES, chat_template_kwargs={"thinking": True})
    assert thinking["tokens"] != tokenize(client, messages=MESSAGES)["tokens"]
    # the model may be left out, as vLLM allows: then it is the served one
    assert client.post("/tokenize", json={"prompt": "hi"}).json() == tokenize(client, prompt="hi")


ADD = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}}
]


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_messages_with_tools_tokenize_to_what_a_chat_completion_feeds_the_engine(
    client, engine, tool_choice
):
    engine.max_model_len = 4096  # the rendered tools are a long prompt
    fields = {"tools": TOOLS, "tool_choice": tool_choice}
    got = tokenize(client, messages=MESSAGES, **fields)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert got["tokens"] == engine.requests[-1][0]
    assert got["tokens"] != tokenize(client, messages=MESSAGES)["tokens"]  # tools rendered


def test_detokenize_gives_the_text_back_with_its_special_tokens(client, engine):
    text = "héllo ☃, world"
    bare = tokenize(client, prompt=text, add_special_tokens=False)["tokens"]
    assert detokenize(client, bare) == text
    bos = engine.tokenizer.bos_token
    assert detokenize(client, tokenize(client, prompt=text)["tokens"]) == bos + text
    rendered = engine.tokenizer.apply_chat_template(MESSAGES)
    assert detokenize(client, tokenize(client, messages=MESSAGES)["tokens"]) == rendered
    assert detokenize(client, []) == ""


NO_THINKING = {"thinking": "yes"}
BAD_TOKENIZE = [
    ("neither prompt nor messages", {}, "prompt"),
    ("both", {"prompt": "hi", "messages": MESSAGES}, "messages"),
    ("token ids as the prompt", {"prompt": [1, 2]}, "prompt"),
    ("no messages", {"messages": []}, "messages"),
    ("a generation field", {"prompt": "hi", "max_tokens": 3}, "max_tokens"),
    ("chat options with a prompt", {"prompt": "hi", "chat_template_kwargs": {}},
     "chat_template_kwargs"),
    ("add_special_tokens with messages", {"messages": MESSAGES, "add_special_tokens": True},
     "add_special_tokens"),
    ("no generation prompt", {"messages": MESSAGES, "add_generation_prompt": False},
     "add_generation_prompt"),
    ("a tool call without its id", {"messages": [{"role": "assistant", "tool_calls": [{}]}]},
     "messages.0.tool_calls.0.id"),
    ("a non-boolean thinking switch", {"messages": MESSAGES, "chat_template_kwargs": NO_THINKING},
     "chat_template_kwargs.thinking"),
    ("add_special_tokens as a string", {"prompt": "hi", "add_special_tokens": "no"},
     "add_special_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("case, body, param", BAD_TOKENIZE, ids=[c[0] for c in BAD_TOKENIZE])
def test_bad_tokenize_requests_are_400_naming_the_field(client, case, body, param):
    assert_400(client.post("/tokenize", json={"model": MODEL, **body}), param)


@pytest.mark.parametrize(
    "tokens,param",
    [([5, 10**6], "tokens"), ([-1], "tokens"), ([1.5], "tokens.0"), ([True], "tokens.0"),
     ("abc", "tokens"), (None, "tokens")],
    ids=str,
)  # fmt: skip
def test_bad_detokenize_requests_are_400_naming_tokens(client, tokens, param):
    body = {"model": MODEL} if tokens is None else {"model": MODEL, "tokens": tokens}
    assert_400(client.post("/detokenize", json=body), param)


def test_detokenize_takes_the_ids_of_the_models_vocabulary(client, engine):
    """The vocabulary that completions check token prompts against."""
    detokenize(client, [0, engine.vocab_size - 1])
    past = client.post("/detokenize", json={"model": MODEL, "tokens": [engine.vocab_size]})
    assert_400(past, "tokens")


def test_an_unknown_model_is_404_and_other_methods_405(client):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        response = client.post(path, json={**body, "model": "gpt-4"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
        assert client.get(path).status_code == 405
    assert_400(client.post("/tokenize", content=b'{"model": '), None)


def test_with_a_key_tokenize_and_detokenize_need_it(engine):
    server = OpenAIServer(engine, ServerOptions(MODEL, api_key=KEY), ServeMetrics(MODEL))
    client = TestClient(server.app, base_url="http://serve.example")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert client.post(path, json=body).status_code == 401
        auth = {"authorization": f"Bearer {KEY}"}
        assert client.post(path, json=body, headers=auth).status_code == 200

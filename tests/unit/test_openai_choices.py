"""Several choices per response, with a scripted fake engine: ``n`` and several prompts run one
engine request each (the other choices of a prompt start once its first has a token, so its
prompt is cached for them), ``best_of`` keeps the likeliest, ``echo`` and ``prompt_logprobs``
give the prompt back, streamed chunks name their choice, and a failure ends every choice."""

import json

import pytest
from starlette.testclient import TestClient

from dsv4ray.entrypoints.openai.format import TextOffsets, TokenBytes, legacy_token
from dsv4ray.entrypoints.openai.metrics import ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions
from tests.unit.openai_fake import FakeEngine, write_checkpoint_files, write_sentencepiece_tokenizer

MODEL = "tiny-test"


@pytest.fixture
def server(engine) -> OpenAIServer:
    return OpenAIServer(engine, ServerOptions(MODEL), ServeMetrics(MODEL))


@pytest.fixture
def client(server) -> TestClient:
    return TestClient(server.app, base_url="http://127.0.0.1:8000")


def body(path: str, fields: dict) -> dict:
    base = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    return {"model": MODEL, **base, **fields}


def post(client, path="/v1/completions", **fields) -> dict:
    response = client.post(path, json=body(path, fields))
    assert response.status_code == 200, response.text
    return response.json()


def events(client, path="/v1/completions", **fields) -> list[dict]:
    response = client.post(path, json=body(path, {"stream": True, **fields}))
    *data, done, tail = response.text.split("\n\n")
    assert (done, tail) == ("data: [DONE]", "")
    return [json.loads(e.removeprefix("data: ")) for e in data]


def reply(engine, num_tokens: int) -> str:
    return engine.tokenizer.decode(engine.reply[:num_tokens])


def test_n_choices_are_one_engine_request_each_with_seeds_in_turn(client, engine):
    got = post(client, n=3, seed=5, max_tokens=4)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert all(c["text"] == reply(engine, 4) for c in got["choices"])
    seeds = [params.seed for _, params, _ in engine.requests]
    assert seeds == [5, 6, 7] and len({r for _, _, r in engine.requests}) == 3
    # the leader's first token comes before the others start: its prompt is cached for them
    leader = engine.requests[0][2]
    assert engine.events.index(("first token", leader)) < engine.events.index(
        ("start", engine.requests[1][2]))  # fmt: skip
    prompt = len(engine.requests[0][0])
    assert got["usage"]["prompt_tokens"] == prompt  # the prompt once, every choice's tokens
    assert got["usage"]["completion_tokens"] == 3 * 4


def test_several_prompts_get_their_choices_in_order(client, engine):
    got = post(client, prompt=["a", [70, 71]], n=2, max_tokens=2)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    prompts = [ids for ids, _, _ in engine.requests]  # the leaders, then the others
    assert prompts[1] == prompts[3] == [70, 71] and prompts[0] == prompts[2] != [70, 71]
    assert got["usage"]["prompt_tokens"] == len(prompts[0]) + 2
    too_long = client.post("/v1/completions", json=body("/v1/completions", {
        "prompt": ["a", "x" * (engine.max_model_len + 1)]}))  # fmt: skip
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt.1"


def test_best_of_keeps_the_likeliest_choices(client, engine):
    engine.sampled_logprob = lambda params: -abs(params.seed - 6)  # seed 6 is likeliest
    got = post(client, best_of=3, seed=5, max_tokens=2)
    assert len(got["choices"]) == 1 and got["choices"][0]["logprobs"] is None
    assert [params.logprobs for _, params, _ in engine.requests] == [0, 0, 0]  # to rank them
    got = post(client, best_of=3, n=2, seed=5, max_tokens=2, logprobs=0)
    ranked = [c["logprobs"]["token_logprobs"] for c in got["choices"]]
    assert ranked == [[0, 0], [-1, -1]] and [c["index"] for c in got["choices"]] == [0, 1]
    assert got["usage"]["completion_tokens"] == 3 * 2  # every candidate's tokens


def test_echo_opens_the_text_and_the_logprobs_with_the_prompt(client, engine):
    prompt = engine.tokenizer.encode("hi")
    got = post(client, echo=True, max_tokens=3)["choices"][0]
    assert got["text"] == "hi" + reply(engine, 3)
    logprobs = post(client, echo=True, max_tokens=3, logprobs=1)["choices"][0]["logprobs"]
    assert engine.requests[-1][1].prompt_logprobs == 1
    tokens = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert logprobs["tokens"][: len(prompt)] == tokens
    want = [None, *(-i / 10 for i in range(1, len(prompt)))]  # the fake's prompt logprobs
    assert logprobs["token_logprobs"][: len(prompt)] == want
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) == 2
    assert len(logprobs["tokens"]) == len(prompt) + 3
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(prompt)] == len("hi")
    # every offset indexes the choice's text: a token is found where its offset says (the
    # prompt's begin-of-sentence token is not in the text: it starts the text, adding none)
    text = post(client, echo=True, max_tokens=3, logprobs=1)["choices"][0]["text"]
    assert logprobs["tokens"][0] not in text and offsets[:2] == [0, 0]
    for token, at in list(zip(logprobs["tokens"], offsets))[1:]:
        assert text[at : at + len(token)] == token
    # streamed: the first chunk brings the prompt; the chunks join to the same answer
    chunks = [c["choices"][0] for c in events(client, echo=True, max_tokens=3, logprobs=1)]
    assert chunks[0]["text"].startswith("hi")
    assert "".join(c["text"] for c in chunks) == got["text"]
    joined = {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in logprobs}
    assert joined == logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_index_the_text_around_special_tokens_and_split_characters(
    client, engine, stream
):
    """A prompt string that spells special tokens is echoed as sent (their text included), a
    token-id prompt that ends inside a character is decoded on its own, as is the answer: in
    both every token's text_offset points at it in the choice's text."""

    def echoed(prompt) -> tuple[str, list[str], list[int]]:
        fields = dict(prompt=prompt, echo=True, max_tokens=2, logprobs=0)
        if not stream:
            got = post(client, **fields)["choices"][0]
            return got["text"], got["logprobs"]["tokens"], got["logprobs"]["text_offset"]
        chunks = [c["choices"][0] for c in events(client, **fields)]
        join = lambda key: sum((c["logprobs"][key] for c in chunks if c["logprobs"]), [])  # noqa: E731
        return "".join(c["text"] for c in chunks), join("tokens"), join("text_offset")

    engine.reply = engine.tokenizer.encode("zy", add_bos=False)
    text, tokens, offsets = echoed("a<｜User｜>b")
    assert text == "a<｜User｜>bzy"
    assert offsets == [0, 0, 1, 9, 10, 11]  # the BOS encode added is not in the text
    assert all(text[at : at + len(t)] == t for t, at in list(zip(tokens, offsets))[1:])

    char = engine.tokenizer.encode("你", add_bos=False)  # three byte tokens
    engine.reply = [char[2], *engine.tokenizer.encode("x", add_bos=False)]
    text, tokens, offsets = echoed(engine.tokenizer.encode("h", add_bos=False) + char[:2])
    assert text == "h\ufffd\ufffdx"  # the prompt's cut character, then the answer's
    assert offsets == [0, 1, 1, 2, 3] and text[offsets[-1]] == "x"


def test_prompt_logprobs_are_vllms_shape_once_per_prompt(client, engine):
    got = post(client, prompt_logprobs=2, n=2, max_tokens=1)
    prompt = engine.requests[0][0]
    asked = [params.prompt_logprobs for _, params, _ in engine.requests]
    assert asked == [2, None]  # only the leader computes its whole prompt
    for choice in got["choices"]:
        lps = choice["prompt_logprobs"]
        assert lps[0] is None and len(lps) == len(prompt)
        entry = lps[1]
        assert entry[str(prompt[1])] == {"logprob": -0.1, "rank": 2, "decoded_token":
                                         engine.tokenizer.decode([prompt[1]])}  # fmt: skip
        assert len(entry) == 3
    chat = post(client, "/v1/chat/completions", prompt_logprobs=0, max_tokens=1)
    assert [list(e) for e in chat["prompt_logprobs"][1:3]] == [
        [str(t)] for t in engine.requests[-1][0][1:3]
    ]
    assert "prompt_logprobs" not in chat["choices"][0]


def test_streamed_choices_interleave_and_each_joins_to_its_answer(client, engine):
    chunks = events(client, n=2, max_tokens=4, stream_options={"include_usage": True})
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: reply(engine, 4), 1: reply(engine, 4)}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    chat = events(client, "/v1/chat/completions", n=2, max_tokens=2)
    assert {c["choices"][0]["index"] for c in chat} == {0, 1}
    roles = [c["choices"][0]["index"] for c in chat if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]  # each choice opens with its role


def test_a_failing_choice_ends_them_all_and_nothing_stays_pending(client, engine, server):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", [9999]],
                                                    "n": 2})  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert server.num_pending == 0
    assert {r for _, _, r in engine.requests} <= set(engine.aborted)  # started ones ended
    engine.abort_after = 1
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "n": 3})
    assert response.status_code == 500 and server.num_pending == 0
    chunks = events(client, n=2)
    assert "error" in chunks[-1] and server.num_pending == 0


def test_legacy_logprobs_name_tokens_apart_and_offsets_index_the_text(fake_model_dir):
    """The byte tokenizer (byte b is token b + 2): the bytes of a split character are named
    as OpenAI names them, an id the tokenizer does not name by its id, so top_logprobs keys
    never collide; text_offset puts every token of a character where the character starts."""
    token_bytes = TokenBytes(fake_model_dir)
    ids = [b + 2 for b in "a😀b".encode()]
    names = [legacy_token(token_bytes(t), t) for t in [*ids, 100_000]]
    assert names == ["a", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80", "b",
                     "token_id:100000"]  # fmt: skip
    offsets = TextOffsets(token_bytes)
    assert [offsets.next(t) for t in [0, *ids]] == [0, 0, 1, 1, 1, 1, 2]  # 0: begin-of-text


def test_sentencepiece_tokens_keep_their_space_and_offsets_index_the_answer(tmp_path):
    """A SentencePiece-style tokenizer (spaces as ▁, byte fallback, the text's first space
    stripped): a token's bytes hold the space its ▁ stands for and a byte piece's byte, as
    the answer decoded after its prompt has them, so text_offset indexes that text."""
    from dsv4ray.text.tokenizer import Tokenizer

    ids = write_sentencepiece_tokenizer(str(tmp_path))
    token_bytes, tok = TokenBytes(str(tmp_path)), Tokenizer(str(tmp_path))
    assert tok.decode([ids["▁world"]]) == "world"  # decoded alone the space is gone
    assert token_bytes(ids["▁world"]) == b" world" and token_bytes(ids["<0x97>"]) == b"\x97"
    prompt = [ids["<s>"], ids["▁hello"]]
    answer = [ids[p] for p in ["▁world", "<0xE6>", "<0x97>", "<0xA5>", "!", "▁x"]]
    text = tok.decode_after(tok.answer_context(prompt), answer)
    assert text == " world日! x" == b"".join(token_bytes(t) for t in answer).decode()
    offsets = TextOffsets(token_bytes)
    assert [offsets.next(t) for t in answer] == [0, 6, 6, 6, 7, 8]
    # after a prompt of special tokens only the answer opens the text, which drops its space
    context = tok.answer_context([ids["<s>"]])
    text = tok.decode_after(context, answer)
    assert text == "world日! x" and tok.decode(context) == ""
    offsets = TextOffsets(token_bytes, opens_text=True)
    starts = [offsets.next(t) for t in [ids["<s>"], *answer]]
    assert starts == [0, 0, 5, 5, 5, 6, 7]
    assert [text[i] for i in starts[1:]] == ["w", "日", "日", "日", "!", " "]
    # token ids echoed: decoded alone, the prompt's text drops its first space too
    echo = [ids["▁hello"], ids["▁world"], ids["!"]]
    offsets = TextOffsets(token_bytes, opens_text=True)
    assert tok.decode(echo) == "hello world!"
    assert [offsets.next(t) for t in echo] == [0, 5, 11]


@pytest.mark.parametrize("echo", [False, True])
def test_sentencepiece_text_offsets_index_the_served_text(tmp_path, echo):
    """Over HTTP, with the SentencePiece-style tokenizer: each text_offset is where its token's
    text starts in the choice's text, after a prompt with text and after one of special tokens
    only (the answer then opens the text and its first space is dropped)."""
    ids = write_sentencepiece_tokenizer(write_checkpoint_files(str(tmp_path)))
    engine = FakeEngine(str(tmp_path))
    answer = [ids[p] for p in ["▁world", "<0xE6>", "<0x97>", "<0xA5>", "!", "▁x"]]
    engine.reply = answer
    server = OpenAIServer(engine, ServerOptions("sp"), ServeMetrics("sp"))
    client = TestClient(server.app, base_url="http://127.0.0.1:8000")
    for prompt, want in (
        ([ids["<s>"], ids["▁hello"]], " world日! x"),
        ([ids["<s>"]], "world日! x"),
    ):
        body = {"model": "sp", "prompt": prompt, "max_tokens": len(answer), "logprobs": 0,
                "echo": echo}  # fmt: skip
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
        echoed = engine.tokenizer.decode(prompt) if echo else ""
        assert text == echoed + want
        starts = offsets[len(prompt) :] if echo else offsets
        pieces = ["w" if want[0] == "w" else " ", "日", "日", "日", "!", " "]
        assert [text[i] for i in starts] == pieces, (prompt, offsets)

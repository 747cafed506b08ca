"""The OpenAI API over Ray Serve, checked with the real `openai` client against a live server.

One server per module on the shared local Ray (tiny checkpoint, fp32 pages so greedy tokens are
exact), bound to 127.0.0.1 on a free port.
"""

import asyncio
import json
import math
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

from dsv4ray import LLM, SamplingParams
from dsv4ray.entrypoints.openai.metrics import METRICS
from dsv4ray.entrypoints.serve import APP_NAME
from dsv4ray.text.chat_encoding import THINK_START, split_reasoning
from dsv4ray.text.tokenizer import Tokenizer

API_KEY = "test-key-1"
MODEL = "tiny-test"
CAPACITY = 2048  # 8 pages: the preemption test fills them with two prompts


@pytest.fixture(scope="module")
def base_url(start_server, tiny_ckpt):
    url = start_server(
        tiny_ckpt,
        served_model_name=MODEL,
        kv_cache_dtype="fp32",
        max_total_tokens=CAPACITY,
        api_key=API_KEY,
        max_pending_requests=40,
    )
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_llm(tiny_ckpt):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_total_tokens=CAPACITY, use_ray=False)
    yield llm
    llm.shutdown()


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200  # probes need no key


def test_the_engine_replica_loads_neither_torch_nor_triton(client):
    # it drives stage actors: the network, the pools and the kernels live in their processes
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)  # a served request
    pid = serve.get_app_handle(APP_NAME).info.remote().result(timeout_s=60)["engine_pid"]
    with open(f"/proc/{pid}/maps") as f:
        libraries = {line.split()[-1] for line in f if line.rstrip().endswith(".so")}
    loaded = sorted(lib for lib in libraries if "/torch/" in lib or "/triton/" in lib)
    assert loaded == [], loaded


def test_greedy_completions_equal_llm_generate(client, local_llm, tiny_ckpt):
    text_prompt, id_prompt = "The quick brown fox", [0, 17, 99, 250, 3, 42]
    expected = local_llm.generate(
        [text_prompt, id_prompt], SamplingParams(max_tokens=8, temperature=0.0)
    )
    for prompt, want in zip([text_prompt, id_prompt], expected):
        got = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        choice = got.choices[0]
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == len(want.prompt_token_ids) + len(want.token_ids)
    assert got.usage.prompt_tokens == len(id_prompt)
    tokenizer = Tokenizer(tiny_ckpt)
    assert expected[0].prompt_token_ids == tokenizer.encode(text_prompt)


def test_chat_uses_the_checkpoint_template_and_equals_llm_generate(client, local_llm, tiny_ckpt):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    tokenizer = Tokenizer(tiny_ckpt)
    rendered = "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Say something.<｜Assistant｜></think>"
    assert tokenizer.apply_chat_template(messages) == rendered  # the DeepSeek-V4 chat format
    want = local_llm.generate(
        [tokenizer.encode(rendered, add_bos=False)], SamplingParams(max_tokens=6)
    )[0]
    got = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_thinking_mode_gives_the_openai_client_reasoning_content(client, local_llm, tiny_ckpt):
    messages = [{"role": "user", "content": "Think first."}]
    kwargs = {"thinking": True}
    tokenizer = Tokenizer(tiny_ckpt)
    prompt = tokenizer.encode_chat(messages, kwargs)  # the answer opens with <think>
    assert tokenizer.decode(prompt[-1:], skip_special_tokens=False) == THINK_START
    want = local_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    reasoning, content = split_reasoning(want.text)
    request = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"chat_template_kwargs": kwargs, "return_token_ids": True},
    }
    got = client.chat.completions.create(**request)
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    message = got.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**request, stream=True)]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_streams_carry_the_same_text_usage_and_done(client, base_url):
    kwargs = {"model": MODEL, "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(prompt="stream me", **kwargs)
    chunks = list(
        client.completions.create(
            prompt="stream me", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    ids = client.completions.create(
        prompt="stream me", stream=True, extra_body={"return_token_ids": True}, **kwargs
    )
    streamed_ids = [t for c in ids for t in c.choices[0].model_extra["token_ids"]]
    assert len(streamed_ids) == whole.usage.completion_tokens  # every token, as it came
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # usage only when asked for

    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
        raw = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: {") for e in events[:-2])


def test_openai_defaults_for_omitted_fields(client):
    got = client.completions.create(model=MODEL, prompt="abc", extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 16  # OpenAI's completions default
    seeded = [
        client.completions.create(model=MODEL, prompt="abc", max_tokens=12, seed=7)
        for _ in range(2)
    ]
    greedy = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    # temperature 1.0 by default: twelve sampled tokens differ from greedy ones (random model)
    assert seeded[0].choices[0].text != greedy.choices[0].text


def test_logprobs_for_completions_and_chat(client):
    got = client.completions.create(
        model=MODEL, prompt="log", max_tokens=5, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == got.usage.completion_tokens
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert token_lp <= 0 and sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
        # greedy takes the best token (distinct ids may share a string key, so >=)
        assert token_lp >= max(top.values()) - 1e-6

    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "log"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    raw = b"".join(bytes(entry.bytes) for entry in content)
    assert raw.decode("utf-8", errors="replace") == got.choices[0].message.content


def test_a_json_schema_answer_validates_and_controls_reach_the_sampler(client, local_llm):
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["ok", "tag"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=64,
        response_format=fmt, frequency_penalty=1.0,
    )  # fmt: skip
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    assert got.choices[0].finish_reason == "stop"
    # a bias of 100 makes greedy decoding repeat one token (the server's own tokenizer decodes)
    forced = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=4,
        temperature=0,
        logit_bias={"97": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == local_llm.tokenizer.decode([97] * 4)


def test_a_forced_tool_call_is_a_valid_call_and_goes_back_into_the_conversation(client, local_llm):
    import jsonschema

    params = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]},
                                               "on": {"type": "boolean"}},
              "required": ["room", "on"]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "set_light", "parameters": params}}]
    messages = [{"role": "user", "content": "lights"}]
    body = dict(model=MODEL, messages=messages, tools=tools, max_tokens=500, temperature=0,
                tool_choice={"type": "function", "function": {"name": "set_light"}})  # fmt: skip
    got = client.chat.completions.create(**body)
    choice = got.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_light" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params)
    functions = [t["function"] for t in tools]
    prompt = local_llm.tokenizer.encode_chat(messages, tools=functions)
    assert got.usage.prompt_tokens == len(prompt)
    # the call and its result go back into the conversation (streamed calls: test_openai_tools)
    history = [*messages, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]  # fmt: skip
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=tools,
                                            max_tokens=4)  # fmt: skip
    rendered = local_llm.tokenizer.encode_chat(history, tools=functions)
    assert follow.usage.prompt_tokens == len(rendered)


def test_choices_echo_and_prompt_logprobs_equal_the_engine_run_alone(client, local_llm):
    """n (seeds in turn), best_of, several prompts and echo with logprobs, against LLM: each
    choice is the token-exact answer of its own seeded request; the echoed prompt's logprobs
    are LLM.score's."""
    prompts = ["Once upon", "The sea"]
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, seed=11, max_tokens=6,
                                    temperature=1.0, logprobs=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=11 + j, logprobs=0,
                             ignore_eos=True) for j in range(2)]  # fmt: skip
    alone = [local_llm.generate([p] * 2, params) for p in prompts]
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [out.text for outs in alone for out in outs]
    # best_of 2 keeps the likelier of the two seeded answers
    best = client.completions.create(model=MODEL, prompt=prompts[0], best_of=2, seed=11,
                                     max_tokens=6, temperature=1.0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    likelier = max(alone[0], key=lambda o: sum(s[t] for t, s in zip(o.token_ids, o.logprobs)))
    assert best.choices[0].text == likelier.text and len(best.choices) == 1
    # echo: the prompt opens the text; its logprobs are the prefill's, as LLM.score gives them
    echo = client.completions.create(model=MODEL, prompt=prompts[1], echo=True, max_tokens=1,
                                     temperature=0, logprobs=1)  # fmt: skip
    ids = local_llm.tokenizer.encode(prompts[1])
    assert echo.choices[0].text.startswith(prompts[1])
    scored = local_llm.score([ids])[0]
    want = [scored[i - 1, ids[i]].item() for i in range(1, len(ids))]
    lps = echo.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids) + 1
    assert all(abs(a - b) < 1e-4 for a, b in zip(lps[1 : len(ids)], want))


def test_32_concurrent_requests_complete_with_their_token_counts(base_url):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        max_tokens = 1 + i % 8
        common = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "extra_body": {"ignore_eos": True},
            "stream": i % 2 == 1,
        }
        if i % 2:
            common["stream_options"] = {"include_usage": True}
        if i % 4 < 2:
            result = await client.completions.create(prompt=f"request {i}", **common)
        else:
            messages = [{"role": "user", "content": f"request {i}"}]
            result = await client.chat.completions.create(messages=messages, **common)
        if i % 2 == 0:
            return max_tokens, result.usage.completion_tokens, result.choices[0].finish_reason
        chunks = [c async for c in result]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        return max_tokens, chunks[-1].usage.completion_tokens, finish[-1]

    async def run() -> list:
        client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for asked, got, finish in results:
        assert (got, finish) == (asked, "length")


def test_the_replica_and_its_stages_share_one_placement_group(base_url):
    info = serve.get_app_handle(APP_NAME).info.remote().result()
    assert info["stage_placement_group_id"] == info["placement_group_id"]
    table = ray.util.placement_group_table()[info["placement_group_id"]]
    assert table["strategy"] == "PACK" and table["state"] == "CREATED"
    # pp 1 on CPU: one bundle, the stage's half CPU plus the replica's
    assert list(table["bundles"].values()) == [{"CPU": 1.0}]
    assert (info["pp_size"], info["capacity_tokens"]) == (1, CAPACITY)


def scrape_dsv4ray_metrics(ray_session) -> dict[str, float]:
    """Ray's Prometheus endpoint on this node: {series with its tags: value} of ours."""
    port = ray_session.nodes()[0]["MetricsExportPort"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    series = {}
    for line in text.splitlines():
        if line.startswith("ray_dsv4ray_"):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def _total(series: dict[str, float], name: str, *tags: str) -> float:
    matching = [k for k in series if k.startswith(name + "{") and all(t in k for t in tags)]
    return sum(series[k] for k in matching)


def test_prefix_cache_hits_show_in_usage_and_metrics(client, base_url, ray_session):
    prompt = [7 + i % 200 for i in range(600)]  # two full 256-token pages to reuse
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 512
    # vLLM's series on the API port, without the key (as Prometheus scrapes), updated at once
    scraped = httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines()
    vllm = dict(line.rsplit(" ", 1) for line in scraped if line.startswith("vllm:"))
    assert float(vllm[f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}}']) >= 512
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

    deadline = time.monotonic() + 30  # Ray exports metrics every few seconds
    while True:
        series = scrape_dsv4ray_metrics(ray_session)
        ok = _total(series, "ray_dsv4ray_requests_total", 'status="200"', "/v1/completions")
        expected = [
            ok >= 2,
            _total(series, "ray_dsv4ray_requests_total", 'status="404"') >= 1,
            _total(series, "ray_dsv4ray_cached_prompt_tokens_total") >= 512,
            _total(series, "ray_dsv4ray_prompt_tokens_total") >= 1200,
            _total(series, "ray_dsv4ray_generation_tokens_total") >= 4,
            _total(series, "ray_dsv4ray_time_to_first_token_seconds_count") >= 2,
            _total(series, "ray_dsv4ray_time_per_output_token_seconds_count") >= 2,
            any(k.startswith("ray_dsv4ray_running_requests{") for k in series),
            any(k.startswith("ray_dsv4ray_waiting_requests{") for k in series),
        ]
        if all(expected):
            break
        assert time.monotonic() < deadline, (expected, series)
        time.sleep(1)


def documented_series() -> dict[str, str]:
    """The serving guide's metrics table: {series: kind}."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "serving.md").read_text()
    rows = re.findall(r"^\| `(ray_dsv4ray_\w+)` \| (counter|gauge|histogram) \|", doc, re.M)
    return dict(rows)


def test_every_documented_series_is_exported_after_traffic(client, base_url, ray_session):
    assert documented_series() == {m.series: m.kind for m in METRICS}
    # two prompts that fill the pool between them: the first to grow past its pages preempts
    # the other, which is recomputed and still finishes
    headers = {"Authorization": f"Bearer {API_KEY}"}
    num_pages = httpx.get(f"{base_url}/v1/dsv4ray/stats", headers=headers).json()["num_pages"]
    prompt_len = num_pages // 2 * 256 - 8
    prompts = [[3 + (i * 7 + j) % 250 for j in range(prompt_len)] for i in range(2)]

    async def run() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            return await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=MODEL, prompt=p, max_tokens=16, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                )
            )

    for got in asyncio.run(run()):
        assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (16, "length")
    shared = [5 + i % 240 for i in range(600)]
    for _ in range(2):  # the second reuses the first's two full pages
        again = client.completions.create(model=MODEL, prompt=shared, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 512

    deadline = time.monotonic() + 30  # Ray exports metrics every few seconds
    while True:
        series = scrape_dsv4ray_metrics(ray_session)
        missing = [
            m.series
            for m in METRICS
            if m.only_with is None  # a series of an option this server runs without
            and not _total(series, m.series + ("_count" if m.kind == "histogram" else ""))
            and not (m.kind == "gauge" and any(k.startswith(m.series + "{") for k in series))
        ]
        if not missing:
            break
        assert time.monotonic() < deadline, (missing, sorted(series))
        time.sleep(1)
    assert _total(series, "ray_dsv4ray_preemptions_total") >= 1
    assert 0 <= _total(series, "ray_dsv4ray_kv_cache_usage") <= 1

"""Hostile requests against a live keyless server must not hurt the requests beside them.

A bounded sample of bench/http_fuzz_cases.py's families (deep nesting, 5,000-digit integers,
NaN, lone surrogates, wrong types, truncated bodies, invalid UTF-8, ...) goes in while good
greedy requests run: every hostile one gets a 4xx with OpenAI's body naming the field where
there is one, every greedy one the reference model's argmax tokens, and the pipeline is never
rebuilt. A server without an API key answers only loopback Host and Origin headers.
"""

import asyncio
import collections
import json

import httpx
import pytest
import torch
from ray import serve

from dsv4ray.bench.http_fuzz_cases import Case, Target, check_response, completion, families
from dsv4ray.entrypoints.serve_config import API_KEY_ENV, API_KEY_FILE_ENV

MODEL = "tiny-test"
CONTEXT = 2048
PER_FAMILY = 18  # cases sent from each family: ~200 in all
GREEDY_TOKENS = 8
GREEDY_PROMPTS = [[0, 17, 99, 250, 3, 42], [5, 6, 7], [200, 100, 50, 25, 12]]
TARGET = Target(MODEL, CONTEXT, api_key=None)


@pytest.fixture(scope="module")
def base_url(start_server, tiny_ckpt):
    with pytest.MonkeyPatch.context() as env:  # keyless, whatever the caller's environment
        env.delenv(API_KEY_ENV, raising=False)
        env.delenv(API_KEY_FILE_ENV, raising=False)
        url = start_server(
            tiny_ckpt, served_model_name=MODEL, kv_cache_dtype="fp32", max_total_tokens=CONTEXT
        )
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def reference_tokens(tiny_model) -> list[list[int]]:
    """The reference model's argmax continuation of each greedy prompt."""
    out = []
    for prompt in GREEDY_PROMPTS:
        ids = list(prompt)
        for _ in range(GREEDY_TOKENS):
            ids.append(int(tiny_model(torch.tensor([ids]))[0, -1].argmax()))
        out.append(ids[len(prompt) :])
    return out


def raw(fields: str) -> bytes:
    return b'{"model": "%s", %s}' % (MODEL.encode(), fields.encode())


LISTED = [  # the findings this hardening answers, exactly as reported
    Case("listed", "/v1/completions", raw(r'"prompt": "Hello", "max_tokens": 4, "stop": "\ud800"'),
         param="stop"),
    Case("listed", "/v1/completions", raw(r'"prompt": "Hi", "stop": ["a", "\udfff"]'),
         param="stop.1"),
    Case("listed", "/v1/chat/completions",
         raw(r'"messages": [{"role": "user", "content": "\ud800"}]'), param="messages.0.content"),
    Case("listed", "/v1/completions", raw('"prompt": ' + "[" * 100_000)),
    Case("listed", "/v1/completions", b'{"a":' * 5000),
    Case("listed", "/v1/completions", raw('"prompt": "x", "max_tokens": ' + "9" * 4301),
         param="max_tokens"),
    Case("listed", "/v1/completions", raw('"prompt": "x", "seed": ' + "1" * 5000), param="seed"),
    Case("listed", "/v1/completions", raw('"prompt": "x", "temperature": NaN'),
         param="temperature"),
    Case("listed", "/v1/completions", raw('"prompt": "x", "top_p": Infinity'), param="top_p"),
    Case("listed", "/v1/completions", raw('"prompt": "x", "temperature": -Infinity'),
         param="temperature"),
]  # fmt: skip


def hostile_cases() -> list[Case]:
    """The listed findings, the first PER_FAMILY malformed cases of every family, and every
    valid request with extreme values (temperature 5e-324, top_p 1e-300, ...: answered 200)."""
    by_family = collections.defaultdict(list)
    for case in families(TARGET, seed=0, scale=0):
        if case.valid or len(by_family[case.family]) < PER_FAMILY:
            by_family[case.family].append(case)
    return LISTED + [case for cases in by_family.values() for case in cases]


async def send_hostile(http: httpx.AsyncClient, cases: list[Case], concurrency: int = 6):
    pending, wrong = iter(cases), []

    async def worker() -> None:
        for case in pending:
            headers = {"content-type": "application/json", **dict(case.headers)}
            response = await http.request(case.method, case.path, content=case.body,
                                          headers=headers)  # fmt: skip
            problem = check_response(case, response.status_code, response.content)
            if problem is not None:
                wrong.append((problem, case.family, case.param, case.body and case.body[:120],
                              response.status_code, response.text[:200]))  # fmt: skip

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return wrong


async def greedy(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
    body = completion(TARGET, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                      ignore_eos=True, return_token_ids=True)  # fmt: skip
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def rebuilds(base_url: str) -> int:
    """Pipeline rebuilds so far (0 from an engine that does not count them)."""
    stats = httpx.get(f"{base_url}/v1/dsv4ray/stats", timeout=30).json()
    return stats.get("num_pipeline_rebuilds", 0)


def test_hostile_requests_get_4xx_while_greedy_requests_beside_them_stay_exact(
    base_url, reference_tokens
):
    cases = hostile_cases()
    assert 150 <= len(cases) <= 320
    assert {c.family for c in cases} >= {"deep nesting", "long integers", "lone surrogates"}
    assert sum(c.valid for c in cases) >= 10
    rebuilds_before = rebuilds(base_url)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            greedy_runs = [greedy(http, p) for p in GREEDY_PROMPTS * 2]
            return await asyncio.gather(send_hostile(http, cases), *greedy_runs)

    wrong, *tokens = asyncio.run(run())
    assert wrong == [], f"{len(wrong)} wrong answers, e.g. {wrong[:5]}"
    assert tokens == reference_tokens * 2
    assert rebuilds(base_url) == rebuilds_before


def test_keyless_server_answers_only_loopback_hosts_and_origins(base_url):
    port = base_url.rsplit(":", 1)[1]
    body = json.dumps(completion(TARGET, prompt=[5, 6], max_tokens=1)).encode()
    for path, method in [("/health", "GET"), ("/v1/models", "GET"), ("/v1/completions", "POST")]:
        content = body if method == "POST" else None
        for headers in ({"host": "evil.example"}, {"host": f"rebind.example:{port}"},
                        {"origin": "http://evil.example"}, {"origin": "null"}):  # fmt: skip
            # a browser's simple cross-site request: no preflight, text/plain
            headers = {**headers, "content-type": "text/plain"}
            r = httpx.request(method, base_url + path, content=content, headers=headers)
            assert r.status_code == 403, (path, headers, r.text)
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "forbidden")
            assert set(error) == {"message", "type", "param", "code"}
        for headers in ({"host": f"localhost:{port}"}, {"host": f"[::1]:{port}"},
                        {"host": "127.0.0.1", "origin": "http://localhost:3000"}):  # fmt: skip
            r = httpx.request(method, base_url + path, content=content, headers=headers)
            assert r.status_code == 200, (path, headers, r.text)

"""GET /metrics over a fake engine, without Ray: vLLM's series, each present at 0 from the start,
moved by what requests did, labelled with the served model; the same events as Ray's series."""

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from dsv4ray.entrypoints.openai.metrics import VLLM_NAMES, ServeMetrics
from dsv4ray.entrypoints.openai.server import OpenAIServer, ServerOptions
from dsv4ray.entrypoints.openai.streaming import Answer, Tracked
from dsv4ray.entrypoints.openai.vllm_metrics import CONTENT_TYPE, SERIES, token_buckets
from tests.unit.openai_fake import FakeEngine

MODEL = "tiny-test"
KEY = "k-123"
SECRET = "zebra launches quietly"
QUEUE_S, TTFT_S, E2E_S = 0.5, 0.75, 2.0  # the timings TimedEngine's requests report
SUCCESS = "vllm:request_success_total{finished_reason="


class TimedEngine(FakeEngine):
    """Answers with engine timings (RequestMetrics), which the plain fake leaves out."""

    def _output(self, *args):
        output = super()._output(*args)
        output.metrics.queue_s, output.metrics.ttft_s, output.metrics.e2e_s = QUEUE_S, TTFT_S, E2E_S
        return output


@pytest.fixture
def engine(fake_model_dir) -> TimedEngine:
    return TimedEngine(fake_model_dir, max_model_len=128)


def make_server(engine, **options) -> OpenAIServer:
    return OpenAIServer(engine, ServerOptions(MODEL, **options), ServeMetrics(MODEL))


def scrape(client, **kwargs) -> dict[str, float]:
    """{sample: value} of GET /metrics; a sample is named with its labels but ``model_name``,
    which every one carries with the served model's name."""
    response = client.get("/metrics", **kwargs)
    assert response.status_code == 200 and response.headers["content-type"] == CONTENT_TYPE
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            tags = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{tags}}}" if tags else "")] = sample.value
    return samples


def expected_names(speculative: bool) -> set[str]:
    """The samples every series gives: a histogram its buckets, sum and count."""
    names = set()
    for spec in SERIES:
        if spec.only_with is not None and not speculative:
            continue
        if spec.kind != "histogram":
            names.add(spec.series)
        else:
            buckets = token_buckets(128) if spec.buckets == "tokens" else spec.buckets
            les = [str(float(b)) for b in buckets] + ["+Inf"]
            names |= {f"{spec.name}_bucket{{le={le}}}" for le in les}
            names |= {f"{spec.name}_sum", f"{spec.name}_count"}
    names.remove("vllm:request_success_total")
    return names | {SUCCESS + reason + "}" for reason in ("stop", "length", "abort", "error")}


def by_reason(samples: dict[str, float]) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    return {k[len(SUCCESS) : -1]: v for k, v in samples.items() if k.startswith(SUCCESS)}


@pytest.mark.parametrize("speculative", [False, True])
def test_a_fresh_server_has_every_series_at_zero(engine, speculative):
    if speculative:  # an engine that drafts: the spec-decode counters exist too
        engine.config = dataclasses.replace(engine.config, speculative_num_steps=2)
    samples = scrape(TestClient(make_server(engine).app, base_url="http://127.0.0.1:8000"))
    assert set(samples) == expected_names(speculative)
    assert set(samples.values()) == {0.0}


def test_counters_and_histograms_count_what_requests_did(engine):
    engine.num_cached_tokens = 4
    client = TestClient(make_server(engine).app, base_url="http://127.0.0.1:8000")
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
    short = client.post("/v1/completions", json=body).json()
    whole = client.post("/v1/completions", json={**body, "max_tokens": 50}).json()
    assert (short["choices"][0]["finish_reason"], whole["choices"][0]["finish_reason"]) == (
        "length",
        "stop",
    )
    num_prompt = short["usage"]["prompt_tokens"]
    num_generated = [short["usage"]["completion_tokens"], whole["usage"]["completion_tokens"]]
    s = scrape(client)
    assert s["vllm:prompt_tokens_total"] == s["vllm:prefix_cache_queries_total"] == 2 * num_prompt
    assert s["vllm:prefix_cache_hits_total"] == 2 * 4
    assert s["vllm:generation_tokens_total"] == sum(num_generated)
    assert by_reason(s) == {"stop": 1, "length": 1, "abort": 0, "error": 0}
    assert s["vllm:request_prompt_tokens_sum"] == 2 * num_prompt
    assert s["vllm:request_prompt_tokens_bucket{le=5.0}"] == 0  # "hello there" is 12 tokens
    assert s["vllm:request_prompt_tokens_bucket{le=20.0}"] == 2
    assert s["vllm:request_generation_tokens_sum"] == sum(num_generated)
    assert s["vllm:time_to_first_token_seconds_count"] == 2
    assert s["vllm:request_time_per_output_token_seconds_count"] == 2
    assert s["vllm:inter_token_latency_seconds_count"] == sum(n - 1 for n in num_generated)
    for name, seconds in [
        ("e2e_request_latency", E2E_S),
        ("request_queue_time", QUEUE_S),
        ("request_prefill_time", TTFT_S - QUEUE_S),
        ("request_decode_time", E2E_S - TTFT_S),
        ("request_inference_time", E2E_S - QUEUE_S),
    ]:
        assert s[f"vllm:{name}_seconds_count"] == 2
        assert s[f"vllm:{name}_seconds_sum"] == pytest.approx(2 * seconds)


def test_failures_count_as_error_and_a_client_gone_as_abort(engine):
    server = make_server(engine)
    client = TestClient(server.app, base_url="http://127.0.0.1:8000")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
    assert client.post("/v1/completions", json={**body, "prompt": [10**6]}).status_code == 400
    engine.abort_after = 2
    assert client.post("/v1/completions", json=body).status_code == 500
    assert client.post("/v1/completions", json={**body, "stream": True}).status_code == 200

    async def client_gone():
        answer = Answer(server.metrics, "/v1/completions")
        tracked = Tracked(server, answer, engine.generate([1], None, "r"))
        await tracked.cancel()

    asyncio.run(client_gone())
    s = scrape(client)
    assert by_reason(s) == {"stop": 0, "length": 0, "abort": 1, "error": 2}  # the 400 never ran
    assert s["vllm:generation_tokens_total"] == 0  # only finished requests count theirs
    assert server.num_pending == 0


def test_gauges_and_preemptions_come_from_the_engine_poll(engine):
    server = make_server(engine)
    stats = {"num_running": 3, "num_waiting": 2, "num_pages": 16, "num_free_pages": 4,
             "num_cached_pages": 4, "num_preemptions": 5}  # fmt: skip
    server.metrics.engine_stats(stats, server.num_pending)
    server.metrics.engine_stats({**stats, "num_preemptions": 7}, server.num_pending)
    s = scrape(TestClient(server.app, base_url="http://127.0.0.1:8000"))
    assert (s["vllm:num_requests_running"], s["vllm:num_requests_waiting"]) == (3, 2)
    assert s["vllm:kv_cache_usage_perc"] == 0.5  # 8 of 16 pages held (cached ones count free)
    assert s["vllm:num_preemptions_total"] == 7


class Recorder:
    """Stands in for a Ray metric: what it was given."""

    def __init__(self) -> None:
        self.total, self.count, self.last = 0.0, 0, None
        self.by_tags: dict[tuple, float] = {}

    def inc(self, value: float, tags=None) -> None:
        self.total += value
        key = tuple(sorted((tags or {}).items()))
        self.by_tags[key] = self.by_tags.get(key, 0.0) + value

    def observe(self, value: float) -> None:
        self.total, self.count = self.total + value, self.count + 1

    def set(self, value: float) -> None:
        self.last = value


def test_ray_series_and_their_vllm_twins_agree(engine):
    """Each event updates both exports: Ray's value equals its vLLM twin's."""
    engine.num_cached_tokens = 4
    engine.config = dataclasses.replace(engine.config, speculative_num_steps=2)
    server = make_server(engine)
    server.metrics.m = {name: Recorder() for name in server.metrics.m}
    client = TestClient(server.app, base_url="http://127.0.0.1:8000")
    for max_tokens in (2, 50):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}
        assert client.post("/v1/completions", json=body).status_code == 200
    server.metrics.drafts(6, 4)
    stats = {"num_running": 1, "num_waiting": 1, "num_pages": 8, "num_free_pages": 2,
             "num_cached_pages": 0, "num_preemptions": 3}  # fmt: skip
    server.metrics.engine_stats(stats, 0)
    s = scrape(client)
    for ray_name, vllm_name in VLLM_NAMES.items():
        ray = server.metrics.m[ray_name]
        if vllm_name + "_count" in s:  # a histogram
            assert (ray.count, ray.total) == (s[vllm_name + "_count"], s[vllm_name + "_sum"])
        elif vllm_name + "_total" in s:
            assert ray.total == s[vllm_name + "_total"] > 0, ray_name
        else:
            assert ray.last == s[vllm_name] > 0, ray_name


def test_a_response_counts_one_http_request_whatever_its_choices(engine):
    """ray_dsv4ray_requests_total counts HTTP requests: a response of n = 4 choices (or of
    best_of candidates, streamed or not) is one request, with its status."""
    server = make_server(engine)
    server.metrics.m = {name: Recorder() for name in server.metrics.m}
    client = TestClient(server.app, base_url="http://127.0.0.1:8000")
    body = {"model": MODEL, "prompt": ["hi", "ho"], "max_tokens": 3}
    for extra in ({"n": 4}, {"n": 2, "stream": True}, {"n": 1, "best_of": 3}):
        assert client.post("/v1/completions", json={**body, **extra}).status_code == 200
    engine.abort_after = 1  # every choice aborted: one failed request
    assert client.post("/v1/completions", json={**body, "n": 3}).status_code == 500
    counts = server.metrics.m["dsv4ray_requests"].by_tags
    assert {dict(tags)["status"]: n for tags, n in counts.items()} == {"200": 3, "500": 1}


def test_metrics_need_no_key_and_carry_no_request_content(engine):
    client = TestClient(make_server(engine, api_key=KEY).app, base_url="http://prom.example")
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": SECRET, "max_tokens": 3}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
    response = client.get("/metrics")  # as Prometheus scrapes: no key
    assert response.status_code == 200 and scrape(client)["vllm:request_prompt_tokens_count"] == 1
    assert not any(w in response.text for w in ("zebra", "launches", "quietly", "Hello"))
    assert set(re.findall(r'(\w+)="', response.text)) == {"model_name", "finished_reason", "le"}


def test_a_keyless_server_serves_metrics_to_local_callers_only(engine):
    client = TestClient(make_server(engine).app, base_url="http://127.0.0.1:8000")
    assert client.get("/metrics").status_code == 200
    assert client.get("/metrics", headers={"host": "evil.example"}).status_code == 403
    assert client.get("/metrics", headers={"origin": "http://evil.example"}).status_code == 403


def vllm_table() -> dict[str, str]:
    """The serving guide's table of /metrics series: {series: kind}."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "serving.md").read_text()
    rows = re.findall(r"^\| `(vllm:\w+)` \| (counter|gauge|histogram) \|", doc, re.M)
    return dict(rows)


def test_the_serving_guide_lists_every_vllm_series():
    assert vllm_table() == {spec.series: spec.kind for spec in SERIES}

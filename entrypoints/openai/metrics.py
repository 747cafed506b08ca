"""Serving metrics through ``ray.util.metrics``, exported by Ray's Prometheus endpoint.

``METRICS`` is the one list of what a replica exports: the metrics table of docs/guide/serving.md
and the test that scrapes Ray's endpoint both come from it. Ray prefixes every name with ``ray_``;
Prometheus adds ``_total`` to counters and ``_bucket``/``_sum``/``_count`` to histograms. Every
series carries a ``model`` tag (the served model name); request counts also carry ``endpoint`` and
``status`` (the HTTP status code as a string; 499 when the client disconnected before the end). The
replica updates them per request as it ends, per first token, and from a poll of
``AsyncEngine.stats()`` every second (gauges, preemptions). Outside Ray (a plain process) the metric
objects are no-ops. ``ServeMetrics`` is the one sink of these events: each also updates the vLLM-
named series of ``GET /metrics`` (``vllm_metrics``), so the two exports agree."""

from __future__ import annotations

from dataclasses import dataclass

from ray.util.metrics import Counter, Gauge, Histogram

from dsv4ray.entrypoints.openai.vllm_metrics import VllmMetrics

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
REQUEST_BOUNDARIES_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
STATUS_CLIENT_CLOSED = "499"
PD_STATS = {  # engine stats key (engine/pd/core.py) -> the counter it feeds
    "pd_transfer_bytes": "dsv4ray_pd_transfer_bytes",
    "pd_transfer_seconds": "dsv4ray_pd_transfer_seconds",
    "pd_checksum_seconds": "dsv4ray_pd_checksum_seconds",
    "pd_checksum_failures": "dsv4ray_pd_checksum_failures",
    "pd_local_prefills": "dsv4ray_pd_local_prefills",
    "pd_remote_prefills": "dsv4ray_pd_remote_prefills",
}


@dataclass(frozen=True)
class Metric:
    name: str  # as registered with Ray (no ray_ prefix, no _total suffix)
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[str, ...] = ("model",)
    only_with: str | None = None  # the option without which the series is never exported

    @property
    def series(self) -> str:
        """The name Prometheus scrapes (histograms: its ``_count``, ``_sum``, ``_bucket``)."""
        return "ray_" + self.name + ("_total" if self.kind == "counter" else "")


METRICS = (
    Metric(
        "dsv4ray_requests",
        "counter",
        "HTTP requests answered, by endpoint and status code",
        ("model", "endpoint", "status"),
    ),
    Metric("dsv4ray_time_to_first_token_seconds", "histogram", "arrival to the first token"),
    Metric(
        "dsv4ray_time_per_output_token_seconds",
        "histogram",
        "mean time per generated token after the first, per request",
    ),
    Metric("dsv4ray_e2e_request_latency_seconds", "histogram", "arrival to the last token"),
    Metric(
        "dsv4ray_request_queue_time_seconds",
        "histogram",
        "arrival to the first engine step that runs the request",
    ),
    Metric("dsv4ray_request_prefill_time_seconds", "histogram", "first step to the first token"),
    Metric("dsv4ray_request_decode_time_seconds", "histogram", "first token to the last"),
    Metric("dsv4ray_prompt_tokens", "counter", "prompt tokens of finished requests"),
    Metric("dsv4ray_generation_tokens", "counter", "tokens generated"),
    Metric("dsv4ray_cached_prompt_tokens", "counter", "prompt tokens served from the prefix cache"),
    Metric("dsv4ray_preemptions", "counter", "requests preempted (pages freed, recomputed later)"),
    Metric(
        "dsv4ray_draft_tokens",
        "counter",
        "MTP draft tokens the model verified",
        only_with="speculative_num_steps",
    ),
    Metric(
        "dsv4ray_accepted_draft_tokens",
        "counter",
        "MTP draft tokens the model accepted",
        only_with="speculative_num_steps",
    ),
    *(
        Metric(name, "counter", text, only_with="prefill_pp_size")
        for name, text in (
            ("dsv4ray_pd_transfer_bytes", "KV bytes prefill stages wrote to decode"),
            ("dsv4ray_pd_transfer_seconds", "seconds prefill stages spent writing KV"),
            ("dsv4ray_pd_checksum_seconds", "seconds prefill stages spent checksumming KV"),
            ("dsv4ray_pd_checksum_failures", "handoffs that failed the checksum or signature"),
            ("dsv4ray_pd_local_prefills", "requests prefilled on the decode engine instead"),
            ("dsv4ray_pd_remote_prefills", "requests whose KV came from the prefill engine"),
        )
    ),
    Metric("dsv4ray_running_requests", "gauge", "requests the engine is running"),
    Metric("dsv4ray_waiting_requests", "gauge", "requests waiting for pages or budget"),
    Metric(
        "dsv4ray_kv_cache_usage",
        "gauge",
        "fraction of the device KV pages held by requests (0 to 1; cached prefixes count free)",
    ),
    Metric("dsv4ray_free_kv_pages", "gauge", "KV pages free or held only by the cache"),
    Metric("dsv4ray_pending_http_requests", "gauge", "generation requests in the replica"),
)
BOUNDARIES = {
    "dsv4ray_time_to_first_token_seconds": TTFT_BOUNDARIES_S,
    "dsv4ray_time_per_output_token_seconds": TPOT_BOUNDARIES_S,
}
# the twins of our series among vLLM's: Ray's name -> vLLM's (the same event updates both)
VLLM_NAMES = {
    "dsv4ray_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "dsv4ray_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "dsv4ray_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "dsv4ray_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "dsv4ray_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "dsv4ray_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "dsv4ray_prompt_tokens": "vllm:prompt_tokens",
    "dsv4ray_generation_tokens": "vllm:generation_tokens",
    "dsv4ray_cached_prompt_tokens": "vllm:prefix_cache_hits",
    "dsv4ray_preemptions": "vllm:num_preemptions",
    "dsv4ray_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "dsv4ray_accepted_draft_tokens": "vllm:spec_decode_num_accepted_tokens",
    "dsv4ray_running_requests": "vllm:num_requests_running",
    "dsv4ray_waiting_requests": "vllm:num_requests_waiting",
    "dsv4ray_kv_cache_usage": "vllm:kv_cache_usage_perc",
}


class ServeMetrics:
    """One replica's metric objects (``self.m[name]``), its vLLM-named series (``self.vllm``,
    built by ``bind_engine``) and the events that update both."""

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self.m = {spec.name: _make(spec, model_name) for spec in METRICS}
        self.vllm: VllmMetrics | None = None
        # engine totals seen so far, per engine (``engine_id`` in the stats: an ingress polls
        # whichever engine replica answers, and a replaced replica counts from zero again)
        self._seen: dict[object, dict[str, float]] = {}

    def bind_engine(self, max_model_len: int, speculative: bool) -> None:
        """Builds the vLLM-named series, which need the engine's context length (the buckets of
        token counts) and whether it drafts; the server calls it once, before any event."""
        self.vllm = VllmMetrics(self._model, max_model_len, speculative)

    def request_done(self, endpoint: str, status: int | str) -> None:
        tags = {"model": self._model, "endpoint": endpoint, "status": str(status)}
        self.m["dsv4ray_requests"].inc(1.0, tags)

    def finished(self, finished_reason: str) -> None:
        """A generation that ran ended: stop, length, abort (client gone) or error."""
        self.vllm.success(finished_reason)

    def first_token(self, ttft_s: float) -> None:
        self._observe("dsv4ray_time_to_first_token_seconds", ttft_s)

    def inter_token(self, seconds: float) -> None:
        self.vllm.observe("vllm:inter_token_latency_seconds", seconds)

    def tokens(self, num_prompt: int, num_generated: int, num_cached: int, tpot_s: float | None):
        for name, count in (
            ("dsv4ray_prompt_tokens", num_prompt),
            ("dsv4ray_generation_tokens", num_generated),
            ("dsv4ray_cached_prompt_tokens", num_cached),
        ):
            self._inc(name, count)
        self.vllm.inc("vllm:prefix_cache_queries", num_prompt)
        self.vllm.observe("vllm:request_prompt_tokens", num_prompt)
        self.vllm.observe("vllm:request_generation_tokens", num_generated)
        if tpot_s is not None:
            self._observe("dsv4ray_time_per_output_token_seconds", tpot_s)

    def request_times(self, metrics) -> None:
        """A finished request's engine timings (``RequestMetrics``): e2e, queue, prefill and
        decode; a phase the request never reached is not observed."""
        ttft, e2e, queue = metrics.ttft_s, metrics.e2e_s, metrics.queue_s
        phases = {
            "dsv4ray_e2e_request_latency_seconds": e2e,
            "dsv4ray_request_queue_time_seconds": queue,
            "dsv4ray_request_prefill_time_seconds": _between(queue, ttft),
            "dsv4ray_request_decode_time_seconds": _between(ttft, e2e),
        }
        for name, seconds in phases.items():
            if seconds is not None:
                self._observe(name, seconds)
        inference = _between(queue, e2e)
        if inference is not None:
            self.vllm.observe("vllm:request_inference_time_seconds", inference)

    def drafts(self, num_draft: int, num_accepted: int) -> None:
        """A finished request's drafted and accepted tokens (speculative decoding)."""
        self._inc("dsv4ray_draft_tokens", num_draft)
        self._inc("dsv4ray_accepted_draft_tokens", num_accepted)

    def engine_stats(self, stats: dict, num_pending: int) -> None:
        free = stats["num_free_pages"] + stats["num_cached_pages"]
        self._set("dsv4ray_running_requests", stats["num_running"])
        self._set("dsv4ray_waiting_requests", stats["num_waiting"])
        self._set("dsv4ray_kv_cache_usage", 1.0 - free / max(1, stats["num_pages"]))
        self.m["dsv4ray_free_kv_pages"].set(free)
        self.m["dsv4ray_pending_http_requests"].set(num_pending)
        seen = self._seen.setdefault(stats.get("engine_id"), {})
        self._inc("dsv4ray_preemptions", stats["num_preemptions"] - seen.get("preemptions", 0))
        seen["preemptions"] = stats["num_preemptions"]
        for key, name in PD_STATS.items():  # engine totals -> counter increments
            if stats.get(key, 0) > seen.get(key, 0):
                self.m[name].inc(float(stats[key] - seen.get(key, 0)))
                seen[key] = stats[key]

    # one event, both exports: Ray's series and its vLLM twin (VLLM_NAMES), if it has one
    def _inc(self, name: str, count: float) -> None:
        if count > 0:  # Ray counters refuse increments of 0; no drafts: no spec-decode series
            self.m[name].inc(float(count))
            if name in VLLM_NAMES:
                self.vllm.inc(VLLM_NAMES[name], count)

    def _observe(self, name: str, value: float) -> None:
        self.m[name].observe(value)
        self.vllm.observe(VLLM_NAMES[name], value)

    def _set(self, name: str, value: float) -> None:
        self.m[name].set(value)
        self.vllm.set(VLLM_NAMES[name], value)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def _make(spec: Metric, model_name: str):
    if spec.kind == "counter":
        metric = Counter(spec.name, description=spec.description, tag_keys=spec.tags)
    elif spec.kind == "gauge":
        metric = Gauge(spec.name, description=spec.description, tag_keys=spec.tags)
    else:
        boundaries = BOUNDARIES.get(spec.name, REQUEST_BOUNDARIES_S)
        metric = Histogram(
            spec.name, description=spec.description, boundaries=boundaries, tag_keys=spec.tags
        )
    if spec.tags == ("model",):
        metric.set_default_tags({"model": model_name})
    return metric

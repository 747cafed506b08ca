"""Serving metrics through ``ray.util.metrics``, exported by Ray's Prometheus endpoint.

Ray prefixes every name with ``ray_`` (``ray_dsv4ray_requests_total``, ...). Every series carries
a ``model`` tag (the served model name); request counts also carry ``endpoint`` and ``status``
(the HTTP status code as a string; 499 when the client disconnected before the end). The replica
updates them: per request as it ends, per first token, and the engine gauges from a periodic poll
of ``AsyncEngine.stats()``. Outside Ray (a plain process) the metric objects are no-ops.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
STATUS_CLIENT_CLOSED = "499"
PD_COUNTERS = {  # engine stats key (engine/pd_core.py) -> metric name, description
    "pd_transfer_bytes": ("dsv4ray_pd_transfer_bytes", "KV bytes prefill stages wrote to decode"),
    "pd_transfer_seconds": ("dsv4ray_pd_transfer_seconds", "seconds prefill stages spent writing"),
    "pd_checksum_failures": ("dsv4ray_pd_checksum_failures", "handoffs that failed the checksum"),
    "pd_local_prefills": ("dsv4ray_pd_local_prefills", "requests prefilled on the decode engine"),
    "pd_remote_prefills": ("dsv4ray_pd_remote_prefills", "requests whose KV came verified"),
}


class ServeMetrics:
    def __init__(self, model_name: str) -> None:
        tags = {"model": model_name}
        self.requests = Counter(
            "dsv4ray_requests",
            description="HTTP requests answered, by endpoint and status code",
            tag_keys=("model", "endpoint", "status"),
        )
        self.ttft = Histogram(
            "dsv4ray_time_to_first_token_seconds",
            description="time from a request's arrival to its first generated token",
            boundaries=TTFT_BOUNDARIES_S,
            tag_keys=("model",),
        )
        self.tpot = Histogram(
            "dsv4ray_time_per_output_token_seconds",
            description="mean time per generated token after the first, per request",
            boundaries=TPOT_BOUNDARIES_S,
            tag_keys=("model",),
        )
        self.prompt_tokens = _counter("dsv4ray_prompt_tokens", "prompt tokens of finished requests")
        self.generated_tokens = _counter("dsv4ray_generation_tokens", "tokens generated")
        self.cached_tokens = _counter(
            "dsv4ray_cached_prompt_tokens", "prompt tokens served from the prefix cache"
        )
        self.draft_tokens = _counter(
            "dsv4ray_draft_tokens", "MTP draft tokens the model verified (speculative decoding)"
        )
        self.accepted_draft_tokens = _counter(
            "dsv4ray_accepted_draft_tokens", "MTP draft tokens the model accepted"
        )
        self.running = _gauge("dsv4ray_running_requests", "requests the engine is running")
        self.waiting = _gauge("dsv4ray_waiting_requests", "requests waiting for pages or budget")
        self.free_pages = _gauge("dsv4ray_free_kv_pages", "KV pages free or held only by the cache")
        self.pending = _gauge("dsv4ray_pending_http_requests", "generation requests in the replica")
        self.pd = {key: _counter(name, text) for key, (name, text) in PD_COUNTERS.items()}
        self._pd_seen: dict[str, float] = {}
        self._model = model_name
        for metric in (
            *self.pd.values(),
            self.ttft,
            self.tpot,
            self.prompt_tokens,
            self.generated_tokens,
            self.cached_tokens,
            self.draft_tokens,
            self.accepted_draft_tokens,
            self.running,
            self.waiting,
            self.free_pages,
            self.pending,
        ):
            metric.set_default_tags(tags)

    def request_done(self, endpoint: str, status: int | str) -> None:
        self.requests.inc(1.0, {"model": self._model, "endpoint": endpoint, "status": str(status)})

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, num_prompt: int, num_generated: int, num_cached: int, tpot_s: float | None):
        for counter, count in (
            (self.prompt_tokens, num_prompt),
            (self.generated_tokens, num_generated),
            (self.cached_tokens, num_cached),
        ):
            if count > 0:  # Ray counters refuse increments of 0
                counter.inc(float(count))
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def drafts(self, num_draft: int, num_accepted: int) -> None:
        """A finished request's drafted and accepted tokens (speculative decoding)."""
        for counter, count in (
            (self.draft_tokens, num_draft),
            (self.accepted_draft_tokens, num_accepted),
        ):
            if count > 0:
                counter.inc(float(count))

    def engine_stats(self, stats: dict, num_pending: int) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.free_pages.set(stats["num_free_pages"] + stats["num_cached_pages"])
        self.pending.set(num_pending)
        for key, counter in self.pd.items():  # engine totals -> counter increments
            if key in stats and stats[key] > self._pd_seen.get(key, 0):
                counter.inc(float(stats[key] - self._pd_seen.get(key, 0)))
                self._pd_seen[key] = stats[key]


def _counter(name: str, description: str) -> Counter:
    return Counter(name, description=description, tag_keys=("model",))


def _gauge(name: str, description: str) -> Gauge:
    return Gauge(name, description=description, tag_keys=("model",))

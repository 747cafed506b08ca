"""OutputProcessor: what callers see of each request while it runs (pure Python).

Per request: the RequestOutput being filled (token ids, text, logprobs, timings), its streaming
detokeniser and its stop strings; a request's entry lives from ``add`` until ``pop``.
"""

from __future__ import annotations

import time

from dsv4ray.engine.outputs import RequestMetrics, RequestOutput
from dsv4ray.engine.request import FinishedRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.text.tokenizer import StreamDecoder, Tokenizer


class OutputProcessor:
    """Text, logprobs, stop strings and timings of each request, until it is popped."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: dict[str, RequestOutput] = {}
        self.params: dict[str, SamplingParams] = {}
        self.decoders: dict[str, StreamDecoder] = {}
        self.start: dict[str, float] = {}
        self.stopped_by_string: set[str] = set()
        self.logits: dict[str, list] = {}
        self.prompt_asking: set[str] = set()  # requests whose prompt logprobs are computed

    def add(self, req_id: str, prompt_ids: list[int], sp: SamplingParams) -> None:
        self.outputs[req_id] = RequestOutput(
            req_id,
            prompt_ids,
            logprobs=[] if sp.logprobs is not None else None,
            prompt_logprobs=[None] * len(prompt_ids) if sp.prompt_logprobs is not None else None,
            metrics=RequestMetrics(num_prompt_tokens=len(prompt_ids)),
        )
        self.params[req_id] = sp
        if sp.prompt_logprobs is not None:
            self.prompt_asking.add(req_id)
        self.decoders[req_id] = StreamDecoder(self.tokenizer)
        self.start[req_id] = time.perf_counter()

    def on_scheduled(self, req_ids) -> None:
        """The requests of a plan: the first plan a request is in ends its queue time."""
        now = time.perf_counter()
        for req_id in req_ids:
            metrics = self.outputs[req_id].metrics
            if metrics.queue_s is None:
                metrics.queue_s = now - self.start[req_id]

    def unfinished(self) -> list[str]:
        return [r for r, out in self.outputs.items() if not out.finished]

    def prompt_targets(self, batch) -> dict[str, list]:
        """StepPlan.prompt_logprobs of a plan's entries: [top n, the prompt's next token at
        each of the entry's positions that has one]."""
        targets = {}
        if not self.prompt_asking:  # every step asks: nothing to do for most
            return targets
        for entry in batch:
            if entry.req_id not in self.prompt_asking:
                continue
            sp = self.params[entry.req_id]
            prompt = self.outputs[entry.req_id].prompt_token_ids
            start = entry.start_pos + 1
            ids = prompt[start : min(start + entry.num_tokens, len(prompt))]
            if ids:
                targets[entry.req_id] = [sp.prompt_logprobs, list(ids)]
        return targets

    def on_prompt_logprobs(self, req_id: str, start: int, entries: list) -> None:
        """The last stage's logprobs of prompt tokens start + 1, start + 2, ... (a recomputed
        chunk writes the same values again)."""
        out = self.outputs[req_id].prompt_logprobs
        if out is not None:
            out[start + 1 : start + 1 + len(entries)] = entries

    def on_token(self, req_id: str, token: int, logprobs) -> tuple[str, bool]:
        """Records a sampled token; returns (text delta, whether a stop string appeared)."""
        out, sp = self.outputs[req_id], self.params[req_id]
        if out.metrics.ttft_s is None:
            out.metrics.ttft_s = time.perf_counter() - self.start[req_id]
        out.token_ids.append(token)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append({token: logprobs[0], **{t: lp for t, lp in logprobs[1]}})
        delta = self.decoders[req_id].push([token])
        if not (delta and sp.stop):  # the text is whole-decoded at the finish
            return delta, False
        before = len(out.text)
        out.text += delta
        if len(out.token_ids) < sp.min_tokens:  # stop strings end nothing before min_tokens
            return delta, False
        # the text before this delta held no stop string that counts, so one can only start in
        # its last len(stop) - 1 characters or in the delta: search there, cut at the earliest
        start = max(0, before - max(len(stop) for stop in sp.stop) + 1)
        cuts = [cut for cut in (out.text.find(stop, start) for stop in sp.stop) if cut >= 0]
        if not cuts:
            return delta, False
        out.text = out.text[: min(cuts)]
        self.stopped_by_string.add(req_id)
        return out.text[before:], True

    def on_finish(self, finished: FinishedRequest, error: str | None = None) -> RequestOutput:
        out = self.outputs[finished.req_id]
        out.finish_reason = finished.finish_reason
        out.error = error
        out.metrics.num_cached_tokens = finished.num_cached_tokens
        out.metrics.num_host_cached_tokens = finished.num_host_cached_tokens
        out.metrics.e2e_s = time.perf_counter() - self.start[finished.req_id]
        if finished.req_id not in self.stopped_by_string:
            out.text = self.tokenizer.decode(out.token_ids)
        return out

    def pop(self, req_id: str) -> RequestOutput:
        for table in (self.params, self.decoders, self.start, self.logits):
            table.pop(req_id, None)
        self.stopped_by_string.discard(req_id)
        self.prompt_asking.discard(req_id)
        return self.outputs.pop(req_id)

    def pop_logits(self, req_id: str) -> list:
        """The [n, V] fp32 logits a scoring request's steps returned, in order."""
        return self.logits.pop(req_id)

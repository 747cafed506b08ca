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
        # req_id -> characters of its text handed out as deltas (with stop strings: the text
        # that may start one is held back until it cannot)
        self.shown: dict[str, int] = {}
        self.logits: dict[str, list] = {}  # req_id -> [(start position, [n, V] logits)]
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
        context = self.tokenizer.answer_context(prompt_ids)
        self.decoders[req_id] = StreamDecoder(self.tokenizer, context)
        self.shown[req_id] = 0
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
        """Records a sampled token; returns (text delta, whether a stop string appeared).
        With stop strings a delta never holds text that a later token could make part of one
        (a streamed answer equals the whole one); callers take the text held back at the
        finish from the output's text."""
        out, sp = self.outputs[req_id], self.params[req_id]
        if out.metrics.ttft_s is None:
            out.metrics.ttft_s = time.perf_counter() - self.start[req_id]
        out.token_ids.append(token)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append({token: logprobs[0], **{t: lp for t, lp in logprobs[1]}})
        if token in sp.stop_token_ids:  # it ends the request; its text is not the answer's
            return "", False
        delta = self.decoders[req_id].push([token])
        if not (delta and sp.stop):  # the text is whole-decoded at the finish
            return delta, False
        before, shown = len(out.text), self.shown[req_id]
        out.text += delta
        cut = (
            self._stop_at(out.text, before, shown, sp)
            if len(out.token_ids) >= sp.min_tokens
            else -1
        )
        if cut >= 0:  # stop strings end nothing before min_tokens
            out.text = out.text[:cut]
            self.stopped_by_string.add(req_id)
            return out.text[shown:], True
        end = len(out.text) - _stop_prefix(out.text, sp.stop)
        self.shown[req_id] = max(shown, end)
        return out.text[shown:end], False

    @staticmethod
    def _stop_at(text: str, before: int, shown: int, sp: SamplingParams) -> int:
        """Where the earliest stop string in text starts (-1: none). The text before the
        last delta held none that counts, so one can only start in its last len(stop) - 1
        characters or in the delta; text already handed out is never taken back."""
        start = max(shown, before - max(len(stop) for stop in sp.stop) + 1, 0)
        cuts = [cut for cut in (text.find(stop, start) for stop in sp.stop) if cut >= 0]
        return min(cuts, default=-1)

    def on_finish(self, finished: FinishedRequest, error: str | None = None) -> RequestOutput:
        out = self.outputs[finished.req_id]
        out.finish_reason = finished.finish_reason
        if finished.finish_reason == "length" and finished.req_id in self.stopped_by_string:
            out.finish_reason = "stop"  # the last token allowed completed a stop string
        out.error = error
        out.metrics.num_cached_tokens = finished.num_cached_tokens
        out.metrics.num_host_cached_tokens = finished.num_host_cached_tokens
        out.metrics.e2e_s = time.perf_counter() - self.start[finished.req_id]
        if finished.req_id not in self.stopped_by_string:
            context = self.decoders[finished.req_id].context  # the answer follows its prompt
            out.text = self.tokenizer.decode_after(context, self._answer_ids(finished))
        return out

    def _answer_ids(self, finished: FinishedRequest) -> list[int]:
        """The ids whose text is the answer: a stop token's is left out, as a stop string is."""
        ids = self.outputs[finished.req_id].token_ids
        stops = self.params[finished.req_id].stop_token_ids
        ends = finished.finish_reason == "stop" and bool(ids) and ids[-1] in stops
        return ids[:-1] if ends else ids

    def pop(self, req_id: str) -> RequestOutput:
        for table in (self.params, self.decoders, self.start, self.logits):
            table.pop(req_id, None)
        self.stopped_by_string.discard(req_id)
        self.prompt_asking.discard(req_id)
        self.shown.pop(req_id, None)
        return self.outputs.pop(req_id)

    def on_logits(self, req_id: str, start: int, logits) -> None:
        """A scoring request's logits [n, V] of positions start.. . A pass that starts again
        (recomputed after a preemption) replaces what the earlier one wrote from there on."""
        chunks = self.logits.setdefault(req_id, [])
        while chunks and chunks[-1][0] >= start:
            chunks.pop()
        chunks.append((start, logits))

    def pop_logits(self, req_id: str) -> list:
        """The [n, V] fp32 logits of a scoring request's positions, in order (none when it
        ended before its first pass, aborted)."""
        return [logits for _, logits in self.logits.pop(req_id, [])]


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of text that begins a stop string (0: none)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest

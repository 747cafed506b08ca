"""Structured output on the last stage: one llguidance matcher per constrained request, advanced
by its drawn tokens, and the token mask of its next draw.

The matcher has consumed every token the request drew before, except the one of its previous
step, which the device may still be computing when the next step is launched: that one is read
(``PendingSample``'s host copy, waiting for that step's draw only, never for the forward of
the step being launched) and consumed when the next step samples. A request that comes back
after a preemption replays the tokens it generated (``NewRequest.history``). A constraint with
an ``after_token`` leaves its row free (no mask) until that token is drawn, and its matcher
starts with the token after it. A row whose
matcher is done allows only the end of sequence; a matcher in error (a token it could not
take) fails its row alone. Rows without a grammar are not touched.
"""

from __future__ import annotations

import os

import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.engine.structured import grammar
from dsv4ray.worker.sampler import to_device


class Grammars:
    """model_path: the checkpoint (its tokenizer.json); vocab_size: the logits' width."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_id: int) -> None:
        self.model_path, self.vocab_size, self.eos = model_path, vocab_size, eos_token_id
        self.tokenizer = None  # llguidance's view of the vocabulary, made with the first grammar
        self.matchers: dict = {}  # req_id -> LLMatcher
        self.pending: dict[str, tuple] = {}  # req_id -> (PendingSample, row) of its last draw
        self.waiting: dict[str, int] = {}  # req_id -> the after_token its matcher waits for

    def add(self, new: NewRequest) -> None:
        """A request with a structured_output constraint gets its matcher (and replays what it
        generated before a preemption)."""
        self.drop(new.req_id)
        spec = new.sampling.get("structured_output")
        if spec is None:
            return
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer(), grammar(spec))
        generated = new.history[new.prompt_len :]
        after = spec.get("after_token")
        if after is not None:
            if after not in generated:
                self.waiting[new.req_id] = after
            generated = generated[generated.index(after) + 1 :] if after in generated else []
        if generated and not matcher.consume_tokens(generated):
            raise ValueError(f"structured_output: {matcher.get_error()}"[:300])
        self.matchers[new.req_id] = matcher

    def drop(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.pending.pop(req_id, None)
        self.waiting.pop(req_id, None)

    def mask(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """logits [R, V] with every token the rows' grammars forbid at -inf (rows without one
        unchanged; a new tensor when any row has one)."""
        rows = [(i, self.matchers[r], r) for i, r in enumerate(req_ids) if r in self.matchers]
        for _, matcher, req_id in rows:
            self._catch_up(matcher, req_id)
        rows = [row for row in rows if row[2] not in self.waiting]
        if not rows:
            return logits
        allowed = [self._allowed(matcher) for _, matcher, _ in rows]
        idx = to_device([i for i, _, _ in rows], torch.long, logits.device)
        ok = torch.stack(allowed).to(logits.device)  # [Rg, V] bool
        return logits.index_copy(0, idx, logits.index_select(0, idx).masked_fill(~ok, -torch.inf))

    def record(self, req_ids: list[str], pending) -> None:
        """The rows' draw (``PendingSample``), which each constrained request consumes before
        its next one."""
        for row, req_id in enumerate(req_ids):
            if req_id in self.matchers:
                self.pending[req_id] = (pending, row)

    def _catch_up(self, matcher, req_id: str) -> None:
        last = self.pending.pop(req_id, None)
        if last is None:
            return
        pending, row = last
        token = pending.result()[row].token_id  # the previous step's draw, done by now
        if req_id in self.waiting:
            if token == self.waiting[req_id]:
                del self.waiting[req_id]  # the constraint starts with the next token
        elif token >= 0:
            matcher.consume_token(token)

    def _allowed(self, matcher) -> torch.Tensor:
        """[V] bool: what the matcher lets the next token be (only eos once it is done, nothing
        once it is in error: that row fails alone)."""
        ok = torch.zeros(self.vocab_size, dtype=torch.bool)
        if matcher.is_error():
            return ok
        if matcher.is_stopped():
            ok[self.eos] = True
            return ok
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
        flat = bits.flatten().bool()[: self.vocab_size]
        ok[: flat.numel()] = flat
        return ok

    def _tokenizer(self):
        if self.tokenizer is None:
            from llguidance import LLTokenizer

            path = os.path.join(self.model_path, "tokenizer.json")
            self.tokenizer = LLTokenizer(path, n_vocab=self.vocab_size, eos_token=self.eos)
        return self.tokenizer

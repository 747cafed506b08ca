"""Sampling controls on the last stage: what a request's logits go through before it samples.

In order, on the [R, V] fp32 logits of a step's sampling rows (the sampled token's logprobs
are those of the raw logits, taken before):

    logit_bias          logits[r, t] += bias (a sparse add over every biased row)
    min_tokens          the request's stop ids (eos unless ignored, stop_token_ids) at -inf
                        while fewer than min_tokens tokens came before the drawn one
    repetition_penalty  logits of the tokens in the prompt or generated so far divided by it
                        where positive, multiplied where negative
    frequency_penalty   minus the penalty once per time a token was generated so far
    presence_penalty    minus the penalty for every token generated so far

min_p acts after temperature, inside the draw (worker/sampling/sampler.py). The penalties read a
table on this stage's device: per state slot, how often each token was generated (int32 [S, V])
and whether it is in the prompt (bool [S, V]); made when the first request with a penalty
arrives.
A request's rows start from the tokens it has (``NewRequest.history``: the prompt, and what it
generated before a preemption), and every token it samples is counted on the device right
after the draw, in stream order before its next step samples, so no host round trip sits
between a token and the next step's penalty. Rows without any control pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4ray.engine.plan import NewRequest
from dsv4ray.worker.sampling.sampler import to_device


@dataclass(frozen=True)
class Controls:
    """One request's controls (neutral values: nothing to do)."""

    bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    prompt_len: int = 0
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    state_slot: int = -1

    @classmethod
    def from_new(cls, new: NewRequest) -> Controls | None:
        """The controls of a new request, or None when it has none."""
        p = new.sampling
        controls = cls(
            tuple((int(t), float(b)) for t, b in p.get("logit_bias") or ()),
            int(p.get("min_tokens", 0)), tuple(new.stop_ids), new.prompt_len,
            float(p.get("repetition_penalty", 1.0)), float(p.get("frequency_penalty", 0.0)),
            float(p.get("presence_penalty", 0.0)), new.state_slot,
        )  # fmt: skip
        return controls if controls.bias or controls.min_tokens or controls.penalizes else None

    @property
    def penalizes(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0


class LogitsProcessors:
    """The controls of the requests this stage samples for, and the penalty table."""

    def __init__(self, num_slots: int, vocab_size: int, device) -> None:
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.device = torch.device(device)
        self.controls: dict[str, Controls] = {}
        self.counts: torch.Tensor | None = None  # int32 [S, V] tokens generated so far
        self.in_prompt: torch.Tensor | None = None  # bool [S, V]

    def add(self, new: NewRequest) -> None:
        self.controls.pop(new.req_id, None)
        controls = Controls.from_new(new)
        if controls is None:
            return
        bad = [t for t, _ in controls.bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary")
        self.controls[new.req_id] = controls
        if controls.penalizes:
            self._start_rows(controls, new.history)

    def drop(self, req_id: str) -> None:
        self.controls.pop(req_id, None)

    def _start_rows(self, c: Controls, history: list[int]) -> None:
        """The slot's rows from the request's tokens so far."""
        if self.counts is None:
            shape = (self.num_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        ids = to_device(history, torch.long, self.device)
        prompt, output = ids[: c.prompt_len], ids[c.prompt_len :]
        self.in_prompt[c.state_slot].zero_().index_fill_(0, prompt, True)
        counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        counts.index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self.counts[c.state_slot].copy_(counts)

    def active(self, req_ids: list[str]) -> bool:
        return any(r in self.controls for r in req_ids)

    def apply(self, logits: torch.Tensor, req_ids: list[str], positions: list[int]):
        """logits [R, V] fp32 of rows req_ids (each drawing the token at its position) ->
        the controlled logits (a new tensor; the rows without controls are unchanged)."""
        rows = [(i, self.controls[r]) for i, r in enumerate(req_ids) if r in self.controls]
        if not rows:
            return logits
        logits = logits.clone()
        self._bias(logits, rows)
        self._hold_back(logits, rows, positions)
        penalized = [(i, c) for i, c in rows if c.penalizes]
        if penalized:
            self._penalize(logits, penalized)
        return logits

    def _bias(self, logits: torch.Tensor, rows) -> None:
        pairs = [(i, t, b) for i, c in rows for t, b in c.bias]
        if pairs:
            idx = to_device([[i, t] for i, t, _ in pairs], torch.long, logits.device)
            values = to_device([b for _, _, b in pairs], logits.dtype, logits.device)
            logits.index_put_((idx[:, 0], idx[:, 1]), values, accumulate=True)

    def _hold_back(self, logits: torch.Tensor, rows, positions: list[int]) -> None:
        """Stop ids at -inf for rows whose drawn token comes before min_tokens, unless that
        leaves a row nothing to draw (a grammar that allows only the end, a bias): such a
        row may still stop."""
        held = [
            (i, [t for t in c.stop_ids if 0 <= t < logits.shape[1]])
            for i, c in rows
            if c.min_tokens and positions[i] - c.prompt_len < c.min_tokens
        ]
        cells = [(k, t) for k, (_, ids) in enumerate(held) for t in ids]
        if not cells:
            return
        idx = to_device([i for i, _ in held], torch.long, logits.device)
        cell = to_device(cells, torch.long, logits.device)
        before = logits.index_select(0, idx)  # [H, V]
        after = before.clone()
        after[cell[:, 0], cell[:, 1]] = float("-inf")
        keeps = torch.isfinite(after).any(-1, keepdim=True)  # something else to draw
        logits.index_copy_(0, idx, torch.where(keeps, after, before))

    def _penalize(self, logits: torch.Tensor, rows) -> None:
        columns = [(i, c.state_slot, c.repetition, c.frequency, c.presence) for i, c in rows]
        table = to_device(columns, torch.float64, logits.device)
        idx, slots = table[:, 0].long(), table[:, 1].long()
        counts = self.counts.index_select(0, slots).float()  # [P, V]
        seen = self.in_prompt.index_select(0, slots) | (counts > 0)
        x = logits.index_select(0, idx)
        rep = table[:, 2:3].float()
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - table[:, 3:4].float() * counts - table[:, 4:5].float() * (counts > 0).float()
        logits.index_copy_(0, idx, x)

    def record(self, req_ids: list[str], token_ids: torch.Tensor) -> None:
        """Counts the drawn tokens [R] (device; -1 where a row failed) of penalized rows."""
        rows = [(i, c.state_slot) for i, r in enumerate(req_ids)
                if (c := self.controls.get(r)) is not None and c.penalizes]  # fmt: skip
        if not rows:
            return
        idx = to_device([list(p) for p in rows], torch.long, token_ids.device)
        tokens = token_ids.index_select(0, idx[:, 0])
        ok = (tokens >= 0).to(torch.int32)
        flat = idx[:, 1] * self.vocab_size + tokens.clamp(min=0)
        self.counts.view(-1).index_add_(0, flat.to(self.counts.device), ok.to(self.counts.device))

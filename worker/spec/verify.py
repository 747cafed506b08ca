"""Verifying draft tokens on the last stage, and what it hands the draft worker.

An entry with d drafts covers positions p .. p + d: the request's last committed token, then the
drafts. The last stage draws the target's token at each of the d + 1 positions with the
request's own sampling (``sample_batch``: greedy argmax, or Gumbel-max with noise keyed on
(seed, position)) and accepts drafts while they equal the target's tokens; the token after the
accepted ones is the target's at that position (the correction, or the bonus token when all d
were accepted).

This is rejection sampling for the draft distribution the draft worker proposes from: top-1
drafts are a point mass q = [d], for which rejection sampling accepts d with probability
min(1, p(d) / q(d)) = p(d) and otherwise draws from the residual max(0, p - q), that is from p
without d. The Gumbel-max draw equals d with probability p(d) and, when it does not, is a draw
from p without d: the same law, so the output distribution is exactly the target's; and since
the noise is the one plain sampling uses at that position, a seeded request gets exactly the
tokens of plain sampling.

``draft_spans`` names the positions whose next token is known after the step (accepted
positions, and whole prefill chunks, whose next token the plan carries): the last stage hands
their pre-head residual rows (and top-k rows) to the draft worker in this order.

A replayed verification step in process can instead leave everything on the device
(``Handoff``): the target's token at every position, and the residual and top-k rows of every
position. The draft worker's graph then counts the accepted drafts itself and drafts from there
(worker/spec/draft_graphs.py), and the host settles the verification (``PendingVerify``) only when
the step is collected: one wait per step instead of one before drafting and one after.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv4ray.engine.plan import NO_DRAFTS, StageResult, StepPlan
from dsv4ray.worker.sampling.sampler import GREEDY, SamplingRow, sample_batch_async, to_device


@dataclass(frozen=True)
class DraftSpan:
    """Consecutive positions start_pos.. of one request (batch rows batch_first..) and the token
    that follows each; sampled: the entry sampled, so drafts follow its last position."""

    req_id: str
    start_pos: int
    batch_first: int
    next_tokens: list[int]
    sampled: bool


def draft_spans(plan: StepPlan, result: StageResult) -> list[DraftSpan]:
    """The spans of a step, in batch order (entries whose sampling failed have none)."""
    spans, first = [], 0
    for e in plan.batch:
        tokens = plan.token_ids[first : first + e.num_tokens]
        next_tokens = plan.drafts.next_tokens if plan.drafts is not None else {}
        if not e.sample and e.req_id in next_tokens:
            nxt = [*tokens[1:], next_tokens[e.req_id]]
            spans.append(DraftSpan(e.req_id, e.start_pos, first, nxt, False))
        elif e.sample and e.req_id in result.sampled:
            accepted = (result.spec or NO_DRAFTS).accepted.get(e.req_id, ())
            num_rows = e.num_tokens - e.num_drafts + len(accepted)
            nxt = [*tokens[1:num_rows], result.sampled[e.req_id]]
            spans.append(DraftSpan(e.req_id, e.start_pos, first, nxt, True))
        first += e.num_tokens
    return spans


def hand_over(plan: StepPlan, result: StageResult, x: torch.Tensor, topk, row_of=None) -> None:
    """Puts the residual rows [N, hc * hidden] (and top-k rows [N, k]) of the draft spans into
    the last stage's result. row_of: row of x of each batch token (numpy; None: the same)."""
    spans = draft_spans(plan, result)
    if not spans:
        return
    rows = [s.batch_first + i for s in spans for i in range(len(s.next_tokens))]
    idx = to_device(rows if row_of is None else row_of[rows].tolist(), torch.long, x.device)
    result.residual = x.index_select(0, idx).flatten(-2)
    result.topk = topk.index_select(0, idx) if topk is not None else None


def sample_with_drafts(model, plan: StepPlan, x: torch.Tensor, sampling: dict, result,
                       sampler=None) -> None:  # fmt: skip
    """Samples every sampling entry of a step that verifies drafts: one head pass and one
    batched sampling pass over the d + 1 positions of each entry (one for entries without
    drafts), then the accepted prefix (``verify``)."""
    rows = to_device(_scored_rows(plan), torch.long, x.device)
    logits = model.logits(x[rows])  # [R, V]
    verify(plan, logits, sampling, result, sampler)


def verify_rows(plan: StepPlan, logits: torch.Tensor, row_of, sampling: dict, sampler=None):
    """``launch_verify`` from logits [T', V] fp32 of every row of a replayed step, row_of (numpy
    [T]) the row of each batch token."""
    rows = row_of[_scored_rows(plan)].tolist()
    scored = logits.index_select(0, to_device(rows, torch.long, logits.device))
    return launch_verify(plan, scored, sampling, sampler)


def verify(plan: StepPlan, logits: torch.Tensor, sampling: dict, result: StageResult,
           sampler=None) -> None:  # fmt: skip
    """logits [R, V] fp32 of the scored rows (per sampling entry in batch order, its last
    num_drafts + 1 positions); sampling: req_id -> SamplingRow (or why it was refused). Fills
    result.sampled / accepted / logprobs / accepted_logprobs / errors."""
    launch_verify(plan, logits, sampling, sampler).settle(result)


def launch_verify(plan: StepPlan, logits: torch.Tensor, sampling: dict,
                  sampler=None) -> PendingVerify:  # fmt: skip
    """``verify``'s sampling pass, launched: the target's tokens stay on the device
    (PendingVerify.token_ids [R]) until ``settle`` reads them. sampler: the stage's
    (worker/stage_sampling.py): its controls and grammars act on each scored row at its own
    position, a grammar's after the drafts before it (a request whose penalties count its
    tokens decodes without drafts: one scored row a step)."""
    entries = [e for e, _ in _sampling_entries(plan)]
    params = [sampling[e.req_id] for e in entries for _ in range(e.num_drafts + 1)]
    num_top = [plan.logprobs.get(e.req_id) for e in entries for _ in range(e.num_drafts + 1)]
    # the token drawn at row j follows position start + j: its position keys the seeded noise
    positions = [p + 1 for e in entries for p in _positions(e)]
    usable = [p if isinstance(p, SamplingRow) else GREEDY for p in params]
    req_ids = [e.req_id for e in entries for _ in range(e.num_drafts + 1)]
    drafts = step_drafts(plan) if sampler is not None and sampler.follows_drafts else None
    processed = logits if sampler is None else sampler.process(logits, req_ids, positions, drafts)
    pending = sample_batch_async(processed, usable, positions, num_top, raw=logits)
    if sampler is not None:
        sampler.drawn(req_ids, pending, drafts)
    return PendingVerify(plan, pending, {e.req_id: sampling[e.req_id] for e in entries})


class PendingVerify:
    """A launched verification: token_ids [R] (device; -1 where the logits are not finite) in
    scored-row order; ``settle`` waits for their host copy and accepts drafts (idempotent)."""

    def __init__(self, plan: StepPlan, pending, sampling: dict) -> None:
        self.plan, self.pending, self.sampling = plan, pending, sampling
        self.token_ids = pending.token_ids

    def settle(self, result: StageResult) -> None:
        outcomes, at = self.pending.result(), 0
        for e, first in _sampling_entries(self.plan):
            drafts = _drafts_of(self.plan, e, first)
            used = outcomes[at : at + e.num_drafts + 1]
            _accept(e, drafts, used, self.sampling[e.req_id], result)
            at += e.num_drafts + 1


@dataclass(frozen=True)
class Handoff:
    """A replayed verification step's rows left on the device for the draft worker in the same
    process: stack [b n, hc, hidden] and top-k [b n, k'] (or None) in slotted rows, rows (numpy
    [T]) the slotted row of each batch token, token_ids [T] the target's token at each (every
    token of such a step is scored)."""

    stack: torch.Tensor
    topk: torch.Tensor | None
    rows: np.ndarray
    token_ids: torch.Tensor


def settle_handoff(plan: StepPlan, result: StageResult) -> None:
    """A handoff the draft worker cannot replay: the verification settled on the host, then the
    rows of the accepted positions handed over as ``hand_over`` does."""
    result.pending.settle(result)
    h = result.handoff
    hand_over(plan, result, h.stack, h.topk, h.rows)


def step_drafts(plan: StepPlan) -> dict[str, list[int]]:
    """req_id -> the drafts of every sampling entry that has some (host values: on the device
    until ``DraftFill.resolve`` writes them into plan.token_ids)."""
    return {e.req_id: _drafts_of(plan, e, first) for e, first in _sampling_entries(plan)
            if e.num_drafts}  # fmt: skip


def _drafts_of(plan: StepPlan, entry, first: int) -> list[int]:
    """An entry's drafts: its last num_drafts tokens (first: its first token's batch row)."""
    end = first + entry.num_tokens
    return plan.token_ids[end - entry.num_drafts : end]


def _scored_rows(plan: StepPlan) -> list[int]:
    """Batch rows of every sampling entry's scored positions, in batch order."""
    return [r for e, first in _sampling_entries(plan) for r in _rows(e, first)]


def _sampling_entries(plan: StepPlan):
    """(entry, its first token's row in the batch) of every sampling entry, in batch order."""
    first = 0
    for e in plan.batch:
        if e.sample:
            yield e, first
        first += e.num_tokens


def _rows(entry, first: int) -> range:
    """Batch rows of the entry's scored positions: its last num_drafts + 1 tokens."""
    return range(first + entry.num_tokens - entry.num_drafts - 1, first + entry.num_tokens)


def _positions(entry) -> range:
    end = entry.start_pos + entry.num_tokens
    return range(end - entry.num_drafts - 1, end)


def _accept(entry, drafts: list[int], outcomes, row, result: StageResult) -> None:
    """Longest prefix of drafts equal to the target's tokens, then the target's next token."""
    num_accepted = 0
    while num_accepted < len(drafts) and outcomes[num_accepted].token_id == drafts[num_accepted]:
        num_accepted += 1
    used = outcomes[: num_accepted + 1]
    error = row if isinstance(row, str) else next((o.error for o in used if o.error), None)
    if error is not None:
        result.errors[entry.req_id] = error
        return
    result.sampled[entry.req_id] = used[-1].token_id
    if entry.num_drafts:
        result.spec_section().accepted[entry.req_id] = drafts[:num_accepted]
    if used[-1].logprobs is not None:
        result.logprobs[entry.req_id] = used[-1].logprobs
        if num_accepted:
            result.spec_section().accepted_logprobs[entry.req_id] = [o.logprobs for o in used[:-1]]

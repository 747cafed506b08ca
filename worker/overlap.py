"""The stage's side of overlap scheduling (engine/lookahead.py): a lookahead entry's token id is
filled on the device from the previous step's sampled ids, and sampled ids reach the host only
when the engine collects the step.

A lookahead entry is a request's one token that its previous plan samples. That plan ran just
before on this stage (stages run plans in order), so its ids are the ones `prev_samples` holds:
(request ids in sampling order, token ids [R] on the device). A row that could not sample holds
-1; the request ends at that plan's commit and its lookahead entry is skipped, so the id used
for it (clamped to 0) only has to be a valid embedding index.
"""

from __future__ import annotations

import logging

import torch

from dsv4ray.engine.plan import StageResult, StepPlan

log = logging.getLogger("dsv4ray.worker")


def fill_lookahead(plan: StepPlan, token_ids: torch.Tensor, prev_samples) -> None:
    """Writes into the step's token ids [T] (on the device) each lookahead entry's token, read
    from the previous step's sampled ids without a host round trip."""
    if not plan.lookahead:
        return
    if prev_samples is None:
        raise RuntimeError(f"step {plan.step_id} looks ahead but no previous step sampled")
    prev_ids, prev_tokens = prev_samples
    row_of = {req_id: i for i, req_id in enumerate(prev_ids)}
    wanted = set(plan.lookahead)
    idx, rows, offset = [], [], 0
    for entry in plan.batch:
        if entry.req_id in wanted:
            idx.append(offset)
            rows.append(row_of[entry.req_id])
        offset += entry.num_tokens
    index = torch.tensor([idx, rows], dtype=torch.int64)
    if token_ids.is_cuda:
        index = index.pin_memory()
    index = index.to(token_ids.device, non_blocking=True)
    token_ids.index_copy_(0, index[0], prev_tokens.index_select(0, index[1]).clamp(min=0))


def record_samples(result: StageResult, req_ids: list[str], rows: list, pending) -> None:
    """Waits for a sampling pass's host copy and files each request's token, logprobs or error
    (rows: the requests' SamplingRow, or the reason their parameters were refused)."""
    for req_id, row, outcome in zip(req_ids, rows, pending.result()):
        error = row if isinstance(row, str) else outcome.error
        if error is not None:  # one request's sampling fails alone
            log.warning("request %s could not sample: %s", req_id, error)
            result.errors[req_id] = error
            continue
        result.sampled[req_id] = outcome.token_id
        if outcome.logprobs is not None:
            result.logprobs[req_id] = outcome.logprobs

"""Draft verification on the last stage against exact target probabilities.

Drafts are top-1 proposals (a point-mass draft distribution), so rejection sampling must accept
draft d with probability p(d) and otherwise emit a draw from p without d: the first token a
verified step emits is then distributed as p, and each accepted draft's successor as the target's
distribution at the next position. Many requests with distinct seeds verify the same drafts over
fixed logits; the empirical frequencies must match the reference sampler's probabilities
(``ReferenceSampler.probs``: temperature, top-k and top-p as plain sampling applies them).
"""

import math

import pytest
import torch

from dsv4ray.engine.plan import BatchEntry, StageResult, StepPlan
from dsv4ray.worker.sampling.sampler import ReferenceSampler, SamplingRow
from dsv4ray.worker.spec.verify import verify

NUM_REQUESTS = 12000
VOCAB = 10


def _close(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every frequency within 5 standard errors of its probability (fixed seeds: no flakes;
    a sampler off by a few percent of mass fails)."""
    n = int(counts.sum())
    assert n > 500, n
    freq = counts / n
    tol = 5 * torch.sqrt(probs * (1 - probs) / n) + 2e-3
    assert torch.all((freq - probs).abs() <= tol), (freq, probs)


def _plan(drafts: list[int], num_requests: int) -> StepPlan:
    plan = StepPlan(step_id=0)
    for i in range(num_requests):
        n = len(drafts) + 1
        plan.batch.append(BatchEntry(f"r{i}", 20, n, True, len(drafts)))
        plan.token_ids += [3, *drafts]
    return plan


@pytest.mark.parametrize(
    "params", [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.9)]
)
def test_verified_tokens_follow_the_target_distribution(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5  # target rows: positions p, p+1, p+2
    ref = ReferenceSampler(params, 0)
    probs = [ref.probs(row) for row in logits]
    drafts = [
        int(probs[0].argsort()[-2]),
        int(probs[1].argmax()),
    ]  # the second likeliest, then the likeliest
    plan = _plan(drafts, NUM_REQUESTS)
    rows = {f"r{i}": SamplingRow.from_plan(params, seed=i) for i in range(NUM_REQUESTS)}
    result = StageResult(0)
    verify(plan, logits.repeat(NUM_REQUESTS, 1), rows, result)

    first, second, third = (torch.zeros(VOCAB) for _ in range(3))
    num_accepted = torch.zeros(3)
    for req_id, token in result.sampled.items():
        emitted = [*result.spec.accepted[req_id], token]
        assert emitted[:-1] == drafts[: len(emitted) - 1]  # accepted tokens are a draft prefix
        num_accepted[len(emitted) - 1] += 1
        for counts, tok in zip((first, second, third), emitted):
            counts[tok] += 1
    _close(first, probs[0])  # the first token emitted is a draw from p, whatever the draft
    _close(second, probs[1])  # after an accepted draft: a draw from the next position's p
    _close(third, probs[2])
    accept1 = (num_accepted[1] + num_accepted[2]) / NUM_REQUESTS
    assert math.isclose(accept1, float(probs[0][drafts[0]]), abs_tol=0.02)


def test_greedy_accepts_the_longest_matching_prefix_and_reports_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    plan = _plan([1, 2], 1)  # the target's tokens are 1, 0, 2: the first draft holds
    plan.logprobs = {"r0": 1}
    result = StageResult(0)
    verify(plan, logits, {"r0": SamplingRow.from_plan({}, 0)}, result)
    assert result.spec.accepted == {"r0": [1]} and result.sampled == {"r0": 0}
    logp = torch.log_softmax(logits, dim=-1)
    assert result.spec.accepted_logprobs["r0"][0][0] == pytest.approx(float(logp[0, 1]))
    assert result.logprobs["r0"][0] == pytest.approx(float(logp[1, 0]))


def test_a_refused_sampling_row_or_bad_logits_fail_only_their_request():
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan")] * 3, [1.0, 0.0, 0.0]] * 2)
    plan = _plan([1, 2], 2)
    rows = {"r0": SamplingRow.from_plan({}, 0), "r1": "sampling failed: ValueError: top_p"}
    result = StageResult(0)
    verify(plan, logits, rows, result)
    assert "r1" in result.errors and "r1" not in result.sampled
    assert "not finite" in result.errors["r0"]  # its accepted draft led to NaN logits

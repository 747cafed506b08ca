"""The last stage's sampler against a torch reference of the same rules (temperature, top-k,
top-p with at least one token kept), including the extreme values the API allows."""

import pytest
import torch

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.worker.sampler import RequestSampler


def _allowed(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Tokens a top-k / top-p filter may return: the k best, then the smallest prefix of the
    sorted distribution whose mass reaches p (the top token always)."""
    order = torch.argsort(logits, descending=True, stable=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    probs = torch.softmax(logits[order], dim=-1)
    kept, mass = [], 0.0
    for token, p in zip(order, probs.tolist()):
        kept.append(token)
        mass += p
        if mass >= top_p:
            break
    return set(kept)


def _sampler(**kw) -> RequestSampler:
    return RequestSampler(SamplingParams(**kw).to_dict(), seed=7)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-9])
def test_a_top_p_that_leaves_no_token_keeps_the_top_one(top_p):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    sampler = _sampler(temperature=1.0, top_p=top_p)
    assert {sampler.sample(logits) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize("temperature", [1e-38, 5e-324])
def test_tiny_temperatures_sample_greedily(temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 30
    assert _sampler(temperature=temperature).sample(logits) == int(logits.argmax())


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (-1, 0.5), (8, 0.3)])
def test_samples_stay_inside_the_filtered_set(top_k, top_p):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 2
    sampler = _sampler(temperature=0.9, top_k=top_k, top_p=top_p)
    drawn = {sampler.sample(logits) for _ in range(300)}
    allowed = _allowed(logits / 0.9, top_k, top_p)
    assert drawn <= allowed and int(logits.argmax()) in drawn


def test_seeded_samplers_repeat_their_draws():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(4))
    a, b = _sampler(temperature=1.0), _sampler(temperature=1.0)
    assert [a.sample(logits) for _ in range(10)] == [b.sample(logits) for _ in range(10)]

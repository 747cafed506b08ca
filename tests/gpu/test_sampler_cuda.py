"""The batched sampler on a GPU: distributions against the torch reference (statistical, fixed
seeds, stated tolerance), seeded draws independent of the batch, the same draws as on the CPU,
and seeded requests through the CUDA engine unchanged by what shares their batch."""

from dataclasses import asdict

import pytest
import torch

from dsv4ray import LLM
from dsv4ray.worker.sampling.sampler import ReferenceSampler
from tests.oracle import sampled_tokens, sampling_row, seeded_alone_and_in_a_crowd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V = 32
NUM_DRAWS = 50_000
# E[TV] of an N-draw histogram over V outcomes is <= 0.5 * sqrt(2 V / (pi N)) = 0.0071 here:
# 0.02 is close to 3x that, and a sampler that moves 2% of the mass between tokens fails.
TV_TOLERANCE = 0.02


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 6, 1.0), (1.2, -1, 0.8)]
)
def test_cuda_distribution_matches_the_reference(temperature, top_k, top_p):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5
    row = sampling_row(seed=3, temperature=temperature, top_k=top_k, top_p=top_p)
    batch = logits.expand(NUM_DRAWS, V).contiguous().cuda()
    drawn = torch.tensor(sampled_tokens(batch, [row] * NUM_DRAWS, list(range(NUM_DRAWS))))
    freq = torch.bincount(drawn, minlength=V).double() / NUM_DRAWS
    expected = ReferenceSampler(asdict(row), 0).probs(logits).double()
    assert set(drawn.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert 0.5 * (freq - expected).abs().sum() < TV_TOLERANCE


def test_cuda_seeded_draws_do_not_depend_on_the_batch_and_match_the_cpu():
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(2)) * 2
    mine = sampling_row(seed=-42, temperature=0.9, top_p=0.95, top_k=200)
    positions = list(range(100, 300))
    alone = sampled_tokens(logits[:1].expand(200, 4096).cuda(), [mine] * 200, positions)
    others = [sampling_row(seed=s, temperature=1.0) for s in range(100)] + [sampling_row()] * 100
    order = torch.randperm(400, generator=torch.Generator().manual_seed(0)).tolist()
    rows = [mine] * 200 + others
    batch = torch.cat([logits[:1].expand(200, 4096), logits[1:].expand(200, 4096)])[order]
    shuffled = sampled_tokens(
        batch.cuda(), [rows[i] for i in order], [(positions * 2)[i] for i in order]
    )
    assert [t for t, i in zip(shuffled, order) if i < 200] == [alone[i] for i in order if i < 200]
    cpu = sampled_tokens(logits[:1].expand(200, 4096), [mine] * 200, positions)
    # the noise is integer-exact on both; fp32 logs may differ in the last bit at a near-tie
    assert sum(a == b for a, b in zip(alone, cpu)) >= 198


def test_cuda_engine_seeded_request_is_unchanged_by_its_batch(tiny_ckpt):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", device="cuda", max_num_batched_tokens=512)
    try:
        alone, crowd = seeded_alone_and_in_a_crowd(llm)
    finally:
        llm.shutdown()
    assert alone == crowd

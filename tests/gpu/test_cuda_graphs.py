"""Decode steps replayed from CUDA graphs give the tokens of eager steps and of the reference."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _run(ckpt, cuda_graphs: bool, batches, max_tokens, **options):
    """Token ids of each batch of prompts (generated in turn), and the graph replay counts."""
    options = {"max_num_batched_tokens": 512, **options}
    llm = LLM(ckpt, kv_cache_dtype="fp32", device="cuda", cuda_graphs=cuda_graphs, **options)
    try:
        outs = []
        for prompts, tokens in zip(batches, max_tokens):
            params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in tokens]
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
        graphs = llm.core.pipeline.workers[0].graphs
        return outs, (dict(graphs.replays) if graphs is not None else None)
    finally:
        llm.shutdown()


def test_every_batch_bucket_equals_eager_and_reference(tiny_ckpt, tiny_model):
    # max_running_requests 8: buckets 1, 2, 4, 8; batches of 1, 2, 3 and 7 requests use each
    sizes = [1, 2, 3, 7]
    batches = [_prompts([1 + 37 * i for i in range(n)], seed=n) for n in sizes]
    max_tokens = [[5] * n for n in sizes]
    opts = dict(max_running_requests=8, max_model_len=4096)
    graphed, replays = _run(tiny_ckpt, True, batches, max_tokens, **opts)
    eager, none = _run(tiny_ckpt, False, batches, max_tokens, **opts)
    assert none is None
    assert {b for b, _ in replays} == {1, 2, 4, 8}, replays
    assert graphed == eager
    for prompts, outs in zip(batches, graphed):
        assert outs == [reference_greedy(tiny_model, p, 5) for p in prompts]


def test_batch_shrinking_mid_generation_and_long_context_bucket(tiny_ckpt, tiny_model):
    # prefill, then requests finish after 2, 4, 7 and 12 tokens: decode runs up to 4 requests
    # (the 4200-token one in the 16k context bucket), then fewer, down to 1 in the 4k bucket
    prompts = _prompts([3, 129, 300, 4200], seed=7)
    max_tokens = [12, 2, 7, 4]
    outs, replays = _run(tiny_ckpt, True, [prompts], [max_tokens], max_running_requests=4,
                         max_model_len=20000, max_num_batched_tokens=8192)  # fmt: skip
    # the batch shrinks 4 -> 2 -> 1 (which steps fall in which context bucket depends on when
    # the long prompt's last chunk runs), and the long request decodes in the 16k bucket
    assert {b for b, _ in replays} == {1, 2, 4}, replays
    assert (4, 16384) in replays and (1, 4096) in replays, replays
    expected = [reference_greedy(tiny_model, p, n) for p, n in zip(prompts, max_tokens)]
    assert outs[0] == expected

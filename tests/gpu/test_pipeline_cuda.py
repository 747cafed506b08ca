"""Two GPU stages with NCCL between them give the tokens of one GPU stage and of the reference."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_pp2_nccl_equals_pp1(tiny_ckpt, tiny_model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (5, 130, 700)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = {}
    for pp in (1, 2):
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=pp, use_ray=True)
        try:
            tokens[pp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[2]
    assert tokens[2] == [reference_greedy(tiny_model, p, 6) for p in prompts]

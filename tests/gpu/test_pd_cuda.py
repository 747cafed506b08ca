"""Prefill on one GPU, decode on another, KV pages handed over by Mooncake from device memory to
device memory: the decode engine's greedy tokens equal the reference, every handoff verified."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_prefill_and_decode_on_separate_gpus_give_the_reference(tiny_ckpt, tiny_model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (1, 129, 257, 700)]
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", prefill_pp_size=1, pp_size=1)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        stats = llm.core.stats()
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_model, p, 5) for p in prompts]
    assert stats["pd_remote_prefills"] == len(prompts) and stats["pd_local_prefills"] == 0
    assert stats["pd_checksum_failures"] == 0

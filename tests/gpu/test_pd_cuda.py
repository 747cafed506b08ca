"""Prefill on one GPU, decode on another, KV pages handed over by Mooncake from device memory to
device memory: the decode engine's greedy tokens equal the reference, every handoff verified;
also with MTP drafts on the decode side (its stage and draft worker replaying CUDA graphs) and a
host tier behind both engines."""

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


def test_pd_with_drafts_and_host_tier_on_two_gpus_gives_the_reference(tiny_ckpt, tiny_model):
    """Three 600-token prompts, each evicting the one before from 1024 device tokens, then the
    first again, longer (its prefix comes back from the prefill side's host tier), and three
    short ones; drafts k = 2 verified on the decode GPU."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (600, 600, 600)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", prefill_pp_size=1, pp_size=1,
              speculative_num_steps=2, enable_hicache=True, max_total_tokens=1024,
              max_num_batched_tokens=512)  # fmt: skip
    try:
        outs = [llm.generate([p], params)[0] for p in prompts]
        prompts += [prompts[0] + [9, 10]]
        prompts += [torch.randint(2, 258, (n,), generator=g).tolist() for n in (300, 129, 3)]
        outs += llm.generate(prompts[3:], params)
        stats, described = llm.core.stats(), llm.core.describe()
        graph_steps = sum(s["num_graph_steps"] for s in llm.core.pipeline.stage_stats())
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_model, p, 6) for p in prompts]
    assert described["draft_worker"] and not described["prefill_draft_worker"]
    assert outs[3].metrics.num_host_cached_tokens > 0
    assert stats["num_draft_tokens"] > 0 and stats["num_failed_draft_passes"] == 0
    assert stats["num_draft_graph_passes"] > 0 and graph_steps > 0
    assert stats["pd_remote_prefills"] == len(prompts) and stats["pd_local_prefills"] == 0
    assert stats["pd_checksum_failures"] == 0

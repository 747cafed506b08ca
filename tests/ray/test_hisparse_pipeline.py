"""HiSparse over Ray at pp 2 (each stage holds its own layers' store) with the host tier, a
preemption and a stage restart: the same greedy tokens as the all-on-device engine."""

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model.tiny import make_tiny

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def test_pp2_with_host_tier_preemption_and_restart_equals_all_on_device(
    ray_session, tmp_path_factory
):
    # index_topk 4: decode steps keep missing hot rows; 1024 tokens (4 pages) of capacity: the
    # 600-token prompts evict each other to the host tier and the batch of four preempts
    ckpt = make_tiny(str(tmp_path_factory.mktemp("topk4")), "tiny", seed=3, index_topk=4)
    common = dict(kv_cache_dtype="fp32", max_num_batched_tokens=512)
    oracle = LLM(ckpt, max_total_tokens=1024, **common)
    # overlap scheduling too: lookahead tokens go from the last stage back to the first
    llm = LLM(ckpt, pp_size=2, enable_hisparse=True, hisparse_host_tokens=1024,
              enable_hicache=True, overlap_scheduling=True, **common)  # fmt: skip
    a, b, c = _prompts([600] * 3, seed=11)
    calls = [[a], [b], [c], [a + [9, 10]], _prompts([250, 245, 20, 9], seed=12)]
    try:
        got = [[o for o in llm.generate(prompts, GREEDY)] for prompts in calls]
        stats = llm.core.stats()
        llm.core.check_integrity()
        ray.kill(llm.core.pipeline.actors[1], no_restart=True)
        lost = llm.generate([b + [3]], GREEDY)[0]  # in flight when the stage is found dead
        again = llm.generate([c + [4]], GREEDY)[0]  # on the restarted stages
        want = [[o.token_ids for o in oracle.generate(prompts, GREEDY)] for prompts in calls]
        want_again = oracle.generate([c + [4]], GREEDY)[0].token_ids
    finally:
        llm.shutdown()
        oracle.shutdown()
    assert [[o.token_ids for o in outs] for outs in got] == want
    assert got[3][0].metrics.num_host_cached_tokens > 0  # a's C4 history came back from the tier
    assert stats["num_preemptions"] > 0 and stats["hisparse_misses"] > 0
    assert lost.finish_reason == "abort"
    assert again.finish_reason == "length" and again.token_ids == want_again


def test_the_serve_config_takes_the_hisparse_options(tiny_ckpt):
    from dsv4ray.entrypoints.serve import ServeSettings

    settings = ServeSettings.from_config(
        {"model": tiny_ckpt, "enable_hisparse": True, "hisparse_hot_rows": 40, "device": "cpu"}
    )
    assert settings.engine_options["enable_hisparse"] is True
    assert settings.engine_options["hisparse_hot_rows"] == 40
    with pytest.raises(ValueError, match="hisparse_host_tokens is set but enable_hisparse"):
        ServeSettings.from_config({"model": tiny_ckpt, "hisparse_host_tokens": 4096})

"""Host-tier prefix cache over Ray: evicted prefixes come back from host memory with the same
tokens, at pp 1 and 2 (stages with different layer mixes), across a stage restart, and the
engine keeps serving correctly when the host tier itself dies."""

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.cache.host_layout import HostLayout
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import PRESETS, make_tiny
from tests.oracle import reference_greedy

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (600,), generator=g).tolist() for _ in range(3)]


def _engine(ckpt, **kw):
    # 1024 device tokens (4 pages): three 600-token prompts cannot all stay on the device
    return LLM(
        ckpt,
        kv_cache_dtype="fp32",
        enable_hicache=True,
        max_total_tokens=1024,
        max_num_batched_tokens=512,
        **kw,
    )


@pytest.mark.parametrize(
    "pp,policy,overlap,share",
    [(1, "write_through", False, False), (2, "write_through", True, False),
     (1, "write_back", True, True)],
)  # fmt: skip
def test_evicted_prefixes_are_served_from_the_host_tier(
    ray_session, tiny_ckpt, tiny_model, tmp_path, pp, policy, overlap, share
):
    if pp == 2:  # the tiny preset splits into stages [0, 4, 128] and [4, 4, 128]
        assert PRESETS["tiny"]["compress_ratios"][:6] == [0, 4, 128, 4, 4, 128]
    if share:  # IndexShare: the C4 layers' indexer ids (0, -, 1) are not their compress ids
        tiny_ckpt = make_tiny(str(tmp_path), "tiny", seed=0,
                              index_topk_pattern=["compute", "share", "compute"])  # fmt: skip
        tiny_model = load_reference(tiny_ckpt, torch.float32)
    a, b, c = _prompts(pp)
    llm = _engine(tiny_ckpt, pp_size=pp, hicache_write_policy=policy,
                  overlap_scheduling=overlap)  # fmt: skip
    try:
        for prompt in (a, b, c):  # each evicts the previous prefix from the device
            llm.generate([prompt], GREEDY)
        again = llm.generate([a + [9, 10]], GREEDY)[0]
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    assert again.metrics.num_host_cached_tokens > 0
    assert again.metrics.num_cached_tokens >= again.metrics.num_host_cached_tokens
    assert again.token_ids == reference_greedy(tiny_model, a + [9, 10], 4)


@pytest.mark.parametrize("pp", [1, 2])
def test_drafts_with_the_host_tier_give_the_reference_tokens(ray_session, tiny_ckpt, tiny_model,
                                                             pp):  # fmt: skip
    """MTP drafts (k = 2) beside the host tier: prefixes evicted to the host and loaded back
    restore the doubled compressor rings speculation keeps, and every verified token is the
    reference's."""
    a, b, c = _prompts(10 + pp)
    llm = _engine(tiny_ckpt, pp_size=pp, speculative_num_steps=2)
    try:
        for prompt in (a, b, c):
            llm.generate([prompt], GREEDY)
        again = llm.generate([a + [9, 10]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        llm.core.check_integrity()
        stats = llm.core.stats()
    finally:
        llm.shutdown()
    assert again.metrics.num_host_cached_tokens > 0 and stats["num_draft_tokens"] > 0
    assert again.token_ids == reference_greedy(tiny_model, a + [9, 10], 8)


def test_dead_host_tier_drops_residency_and_keeps_serving(
    ray_session, tiny_ckpt, tiny_model, caplog
):
    a, b, c = _prompts(7)
    llm = _engine(tiny_ckpt)
    try:
        for prompt in (a, b, c):
            llm.generate([prompt], GREEDY)
        for tier in llm.core.pipeline.tiers:
            ray.kill(tier, no_restart=True)
        with caplog.at_level("ERROR", logger="dsv4ray.engine"):
            outs = llm.generate([a + [1], b + [2]], GREEDY)
        assert "host tier lost" in caplog.text
        later = llm.generate([c + [3]], GREEDY)[0]
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    for prompt, out in zip([a + [1], b + [2]], outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 4)
    assert later.metrics.num_host_cached_tokens == 0
    assert later.token_ids == reference_greedy(tiny_model, c + [3], 4)


def test_a_request_half_from_the_host_tier_beside_preemptions_at_pp2_is_exact(
    ray_session, tiny_ckpt, tiny_model
):
    """Ten 530-token prompts over a 4096-token device pool at pp 2, two micro-batches in flight:
    in the second call the last request reloads a prefix from the host tier while the scheduler
    preempts others mid-step. Its tokens (and its neighbour's) equal the reference's."""
    rows = [[0] + [(7 * i + j) % 500 + 2 for j in range(529)] for i in range(4)]
    fills = [[0] + [(11 * i + 3 * j) % 500 + 2 for j in range(529)] for i in range(4, 10)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_ckpt, pp_size=2, kv_cache_dtype="fp32", enable_hicache=True,
              max_total_tokens=4096, host_cache_tokens=16384)  # fmt: skip
    try:
        llm.generate(fills, params)
        prompts = rows + fills[:2]
        outs = llm.generate(prompts, params)
        llm.core.check_integrity()
        # each stage's host region holds its own layers' pages: together, one model's worth
        pipe = llm.core.pipeline
        whole = HostLayout(pipe.cfg, 0, pipe.cfg.num_hidden_layers, "fp32", **pipe.host_args)
        stages = [HostLayout(pipe.cfg, s, e, "fp32", **pipe.host_args) for s, e in pipe.ranges]
        assert [r["nbytes"] for r in pipe.regions] == [layout.nbytes for layout in stages]
        assert sum(r["nbytes"] for r in pipe.regions) == whole.nbytes
    finally:
        llm.shutdown()
    assert outs[-1].metrics.num_host_cached_tokens > 0
    for prompt, out in zip(prompts[-2:], outs[-2:]):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 8)


@pytest.fixture(scope="module")
def pp2_engine(ray_session, tiny_ckpt):
    """One pp 2 engine for the two tests that kill its stages and host tier, the last of this
    file (idle stages poll their channels: kept beside other tests they would cost more than
    a build). Each kill is followed by a rebuild that the test checks with the reference."""
    llm = _engine(tiny_ckpt, pp_size=2)
    yield llm
    llm.shutdown()


def test_restarted_stage_reloads_prefixes_from_the_host_tier(pp2_engine, tiny_model):
    a, b, _ = _prompts(5)
    llm = pp2_engine
    llm.generate([a], GREEDY)
    llm.generate([b], GREEDY)
    ray.kill(llm.core.pipeline.actors[1], no_restart=True)
    lost = llm.generate([b + [3]], GREEDY)[0]  # in flight when the stage is found dead
    assert lost.finish_reason == "abort" and "stage" in lost.error
    again = llm.generate([a + [4]], GREEDY)[0]
    assert again.finish_reason == "length"
    assert again.metrics.num_host_cached_tokens > 0
    assert again.token_ids == reference_greedy(tiny_model, a + [4], 4)


def test_a_rebuild_that_finds_a_new_host_tier_forgets_the_old_host_copies(
    pp2_engine, tiny_model, caplog
):
    # the tier and a stage die together; the rebuild creates a new tier whose regions are
    # zeros, so nothing may be served from the host copies the index remembered
    a, b, c = _prompts(8)
    llm = pp2_engine
    for prompt in (a, b, c):
        llm.generate([prompt], GREEDY)
    llm.generate([[7] * 10], GREEDY)  # carries the last backups while the tier lives
    for tier in llm.core.pipeline.tiers:
        ray.kill(tier, no_restart=True)
    ray.kill(llm.core.pipeline.actors[1], no_restart=True)
    with caplog.at_level("ERROR", logger="dsv4ray.engine"):
        lost = llm.generate([[5] * 40], GREEDY)[0]  # no prefix hit: no host copy to load
        again = llm.generate([a + [1]], GREEDY)[0]  # its first step rebuilds
    assert lost.finish_reason == "abort" and "came back empty" in caplog.text
    llm.core.check_integrity()
    assert again.metrics.num_host_cached_tokens == 0
    assert again.token_ids == reference_greedy(tiny_model, a + [1], 4)

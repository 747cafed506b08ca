"""Pipeline-parallel stage actors over a compiled graph give the reference's tokens."""

import asyncio

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def test_pp_1_2_3_give_identical_greedy_tokens(ray_session, tiny_ckpt, tiny_model):
    prompts = _prompts([3, 130, 300], seed=0)
    expected = [reference_greedy(tiny_model, p, 5) for p in prompts]
    for pp in (1, 2, 3):
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=pp, use_ray=True)
        try:
            assert len(llm.core.pipeline.actors) == pp
            got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        finally:
            llm.shutdown()
        assert got == expected, pp


def test_top_k_crosses_the_stage_boundary(ray_session, tmp_path):
    # C4 layers 1, 3, 4; at pp 2 the second stage [3, 6) starts with layer 3, which shares
    path = make_tiny(
        str(tmp_path), "tiny", seed=2, index_topk_pattern=["compute", "share", "compute"]
    )
    model = load_reference(path, torch.float32)
    assert model.cfg.layers[3].skip_topk and not model.cfg.layers[4].skip_topk
    prompts = _prompts([280, 40], seed=1)
    llm = LLM(path, kv_cache_dtype="fp32", pp_size=2)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    assert got == [reference_greedy(model, p, 5) for p in prompts]


def test_killed_stage_aborts_requests_and_the_pipeline_recovers(ray_session, tiny_ckpt, tiny_model):
    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2)

    async def killed_midway():
        outputs, count = [], 0
        async for update in engine.generate(
            [0, 5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)
        ):
            count += 1
            if count == 3:
                ray.kill(engine.core.pipeline.actors[1], no_restart=True)
            outputs.append(update)
        return outputs[-1].output

    async def after(prompt):
        async for update in engine.generate(prompt, GREEDY):
            if update.output is not None:
                return update.output

    try:
        out = asyncio.run(killed_midway())
        assert out.finish_reason == "abort"
        assert "stage" in out.error and len(out.token_ids) < 400
        prompt = _prompts([50], seed=3)[0]
        again = asyncio.run(after(prompt))
        assert again.finish_reason == "length"
        assert again.token_ids == reference_greedy(tiny_model, prompt, 5)
    finally:
        engine.shutdown()


def test_pp_larger_than_layers_is_a_clear_error(ray_session, tiny_ckpt):
    with pytest.raises(ValueError, match="pp_size"):
        LLM(tiny_ckpt, pp_size=7)

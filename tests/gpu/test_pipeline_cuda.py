"""Stages on separate GPUs with NCCL channels between them give the tokens of one GPU stage and of
the reference, at every pipeline size the machine holds; a stage killed mid-run aborts its
requests and the rebuilt pipeline's later tokens equal the reference."""

import asyncio

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.entrypoints.async_engine import AsyncEngine
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _sizes():
    """2, and 4 where the machine has 4 GPUs (the tiny model has 6 layers)."""
    return [pp for pp in (2, 4) if pp <= torch.cuda.device_count()]


@pytest.mark.parametrize("pp", _sizes())
def test_ppn_nccl_equals_pp1_and_the_reference(tiny_ckpt, tiny_model, pp):
    prompts = _prompts((5, 130, 700), seed=0)
    tokens = {}
    for size in (1, pp):
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=size, use_ray=True)
        try:
            gpus = {info["gpu"] for info in llm.core.pipeline.infos}
            assert len(gpus) == size  # one GPU per stage: NCCL channels between them
            tokens[size] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[pp]
    assert tokens[pp] == [reference_greedy(tiny_model, p, 6) for p in prompts]


def test_a_stage_killed_mid_run_is_rebuilt_on_its_gpu(tiny_ckpt, tiny_model):
    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2)

    async def killed_midway():
        outputs = []
        async for update in engine.generate(
            [0, 5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)
        ):
            outputs.append(update)
            if len(outputs) == 3:
                ray.kill(engine.core.pipeline.actors[1], no_restart=True)
        return outputs[-1].output

    async def after(prompt):
        async for update in engine.generate(prompt, GREEDY):
            if update.output is not None:
                return update.output

    try:
        out = asyncio.run(killed_midway())
        assert out.finish_reason == "abort" and "stage" in out.error
        prompts = _prompts((50, 300), seed=3)
        for prompt in prompts:
            again = asyncio.run(after(prompt))
            assert again.token_ids == reference_greedy(tiny_model, prompt, 6)
        assert len({info["gpu"] for info in engine.core.pipeline.infos}) == 2
    finally:
        engine.shutdown()

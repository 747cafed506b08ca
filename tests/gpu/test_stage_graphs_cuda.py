"""Every stage of a pipeline replays CUDA graphs: pipelines of 1 to 3 stages sharing one GPU, in
this process or as Ray stage actors, with and without drafts, give the tokens of eager steps and
of the reference, and compile no kernel while they serve."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# pipelines on one GPU: (pp, stage actors, draft tokens)
SHAPES = [(2, False, 0), (3, False, 0), (1, True, 0), (2, True, 0), (3, True, 0), (2, False, 2),
          (1, True, 2), (2, True, 2)]  # fmt: skip


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _engine(ckpt, pp: int, use_ray: bool, k: int, cuda_graphs: bool = True) -> LLM:
    if use_ray:
        pytest.importorskip("ray")
    options = {"num_gpus_per_stage": 1 / pp} if use_ray else {}
    return LLM(ckpt, kv_cache_dtype="fp32", device="cuda", pp_size=pp, use_ray=use_ray,
               speculative_num_steps=k, cuda_graphs=cuda_graphs, max_running_requests=8,
               max_model_len=20000, max_num_batched_tokens=8192, **options)  # fmt: skip


def _generate(llm, prompts, max_tokens):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("pp,use_ray,k", SHAPES, ids=[f"pp{p}-{'ray' if r else 'local'}-k{k}"
                                                      for p, r, k in SHAPES])  # fmt: skip
def test_every_stage_replays_graphs_and_equals_eager_and_reference(
    tiny_ckpt, tiny_model, pp, use_ray, k
):
    # requests finish after 2 to 16 tokens (the batch shrinks 4 -> 1); the 4090-token one
    # crosses from the 4k context bucket into the 16k one while it decodes
    prompts, max_tokens = _prompts([3, 129, 300, 4090], seed=pp + k), [16, 2, 7, 10]
    llm = _engine(tiny_ckpt, pp, use_ray, k)
    try:
        graphed = _generate(llm, prompts, max_tokens)
        stats = llm.core.pipeline.stage_stats()
    finally:
        llm.shutdown()
    eager_llm = _engine(tiny_ckpt, pp, use_ray, k, cuda_graphs=False)
    try:
        eager = _generate(eager_llm, prompts, max_tokens)
    finally:
        eager_llm.shutdown()
    assert graphed == eager
    assert graphed == [reference_greedy(tiny_model, p, n) for p, n in zip(prompts, max_tokens)]
    assert len(stats) == pp
    for stage in stats:
        buckets = stage["graph_steps"]
        assert {key.split("x")[0] for key in buckets} >= {"1", "2", "4"}, buckets
        assert {key.split("x")[1] for key in buckets} >= {"4096", "16384"}, buckets


@pytest.mark.parametrize("pp,use_ray,k", [(2, False, 0), (2, False, 2), (2, True, 0)])
def test_pipelines_compile_nothing_while_serving(tiny_ckpt, pp, use_ray, k):
    llm = _engine(tiny_ckpt, pp, use_ray, k)
    try:
        ready = [s["num_kernel_variants"] for s in llm.core.pipeline.stage_stats()]
        assert min(ready) > 0
        drawn = SamplingParams(max_tokens=7, temperature=0.8, top_k=20, top_p=0.95, logprobs=3)
        for lengths, params in (
            ([1, 2, 3], SamplingParams(max_tokens=9)),
            ([17, 129, 255, 256, 257, 600, 1100], drawn),
            ([3000, 5], SamplingParams(max_tokens=3, ignore_eos=True)),
            ([4100, 40, 1, 999, 77, 300, 2, 12], drawn),
        ):
            prompts = _prompts(lengths, seed=len(lengths))
            llm.generate(prompts + prompts[:1], params)
        assert [s["num_kernel_variants"] for s in llm.core.pipeline.stage_stats()] == ready
    finally:
        llm.shutdown()

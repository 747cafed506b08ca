"""The engine on a GPU (Triton kernels, CUDA pools) against the reference on the CPU."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def test_cuda_engine_greedy_equals_reference_fp32_pages(tiny_ckpt, tiny_model):
    prompts = _prompts([1, 127, 129, 300, 700], seed=0)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", device="cuda", max_num_batched_tokens=512)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 6), len(prompt)


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_cuda_engine_lossy_pages_pass_kl_gates(tiny_ckpt, tiny_model, kv_dtype):
    prompts = _prompts([600, 333], seed=1)
    llm = LLM(tiny_ckpt, kv_cache_dtype=kv_dtype, device="cuda", max_num_batched_tokens=512)
    try:
        scored = llm.score(prompts)
    finally:
        llm.shutdown()
    for prompt, logp in zip(prompts, scored):
        ref = torch.log_softmax(tiny_model(torch.tensor([prompt]))[0], dim=-1)
        logp = logp.cpu()
        assert (logp.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.98
        assert (ref.exp() * (ref - logp)).sum(-1).mean() <= 0.005


# in process; two Ray stages and the draft actor sharing the GPU, whose processes hold their
# device memory until they have exited, seconds after Ray reports them dead (shutdown waits)
ENGINES = {"in-process": {}, "ray-pp2-drafts": dict(use_ray=True, pp_size=2, num_gpus_per_stage=0.5,
                                                     speculative_num_steps=2)}  # fmt: skip


@pytest.mark.parametrize("kind", ENGINES)
def test_an_engine_after_shutdown_gets_its_memory_back(tiny_ckpt, kind):
    # engines started one after another in one process (a notebook, a test run) size their pools
    # from free memory: what a shut-down engine held must count as free again
    if kind != "in-process":
        pytest.importorskip("ray")

    def num_pages() -> int:
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", device="cuda", cuda_graphs=True,
                  **ENGINES[kind])  # fmt: skip
        try:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
            return llm.core.stats()["num_pages"]
        finally:
            llm.shutdown()

    first = num_pages()
    later = [num_pages() for _ in range(2)]
    assert min(later) >= 0.95 * first, (first, later)

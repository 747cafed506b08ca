"""No kernel compiles while the engine serves: the startup warm-up reaches every variant."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.kernels.jit_cache import compiled_variants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_serving_varied_prompts_compiles_nothing_after_startup(tiny_ckpt, cuda_graphs, kv_dtype):
    llm = LLM(tiny_ckpt, kv_cache_dtype=kv_dtype, device="cuda", cuda_graphs=cuda_graphs,
              max_running_requests=8, max_model_len=8192)  # fmt: skip
    try:
        ready = compiled_variants()
        assert sum(ready.values()) > 0
        drawn = SamplingParams(max_tokens=7, temperature=0.8, top_k=20, top_p=0.95, logprobs=3)
        for lengths, params in (
            ([1, 2, 3], SamplingParams(max_tokens=9)),
            ([17, 129, 255, 256, 257, 600, 1100], drawn),
            ([3000, 5], SamplingParams(max_tokens=3, ignore_eos=True)),
            ([4100, 40, 1, 999, 77, 300, 2, 12], drawn),
        ):
            prompts = _prompts(lengths, seed=len(lengths))
            llm.generate(prompts + prompts[:1], params)  # the repeat hits the prefix cache
        assert compiled_variants() == ready
    finally:
        llm.shutdown()

"""The engine with its Triton kernels (under the interpreter on CPU) gives the reference's tokens.

Kernel unit tests pin each kernel to its torch reference; this pins how the engine calls them
(strides, index lists, pool views), which the torch path alone would not exercise.
"""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.kernels import dispatch
from tests.oracle import reference_greedy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA run is tests/gpu")
def test_engine_on_triton_kernels_equals_reference(tiny_ckpt, tiny_model):
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (9, 131)]
    with dispatch.use_backend("triton"):
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=256)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        finally:
            llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 2)

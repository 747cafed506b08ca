"""The engine with its Triton kernels (under the interpreter on CPU) gives the reference's tokens.

Kernel unit tests pin each kernel to its torch reference; this pins how the engine calls them
(strides, index lists, pool views), which the torch path alone would not exercise. The model is
the tiny shape cut to one layer of each attention kind (window, C4 with its indexer, C128) and
two query heads: the interpreter's cost grows with layers x heads, while the calls the engine
makes are the same for every layer of a kind.
"""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.kernels import dispatch
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy

SMALL = dict(
    num_hidden_layers=3,
    compress_ratios=[4, 128, 0, 0],
    num_attention_heads=2,
    index_n_heads=4,
    num_hash_layers=1,
)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> str:
    return make_tiny(str(tmp_path_factory.mktemp("small")), seed=5, **SMALL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA run is tests/gpu")
def test_engine_on_triton_kernels_equals_reference(small_ckpt):
    model = load_reference(small_ckpt, torch.float32)
    g = torch.Generator().manual_seed(21)
    # 9 tokens: window only; 131: one C128 entry and 32 C4 entries (more than index_topk)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (9, 131)]
    with dispatch.use_backend("triton"):
        llm = LLM(small_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=256)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        finally:
            llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(model, prompt, 2)

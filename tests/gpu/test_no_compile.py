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


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_indexer_variants_compiled_up_front_cover_every_step_shape(kv_dtype):
    from dsv4ray.cache.page_layout import PageLayout
    from dsv4ray.kernels import indexer

    layout = PageLayout("indexer", kv_dtype)
    indexer.compile_variants(16, layout, "cuda")
    ready = compiled_variants()
    pages = torch.zeros(8, layout.page_bytes, dtype=torch.uint8, device="cuda")
    g = torch.Generator().manual_seed(0)
    for num_tokens in (1, 7, 64, 100, 131, 700, 2048, 8192):
        for cols in (1, 3, 16, 33, 64, 257):
            q = torch.randn(num_tokens, 16, 128, generator=g).cuda()
            w = torch.rand(num_tokens, 16, generator=g).cuda()
            table = torch.randint(0, 8, (2, cols), generator=g).cuda()
            req = torch.randint(0, 2, (num_tokens,), generator=g).cuda()
            bound = torch.randint(0, cols * 64 + 1, (num_tokens,), generator=g).cuda()
            indexer.indexer_scores(q, w, pages, table, req, bound, layout)
    assert compiled_variants() == ready


def test_native_weights_compile_nothing_after_startup(tmp_path):
    """Native FP8 linears and FP4 experts (group-major scales): decode batches of 1 to 12
    requests and prefills of every size take each expert tile variant (narrow and wide few-pair
    tiles, listed, sorted, decoded first) and every FP8 linear bucket, all compiled at startup."""
    from dsv4ray.model.tiny import make_tiny

    path = make_tiny(str(tmp_path / "q"), "tiny", seed=1, quantize="fp8+fp4-experts")
    llm = LLM(path, weight_format="native", device="cuda", dtype="bfloat16",
              max_running_requests=12, max_model_len=8192)  # fmt: skip
    try:
        ready = compiled_variants()
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        for lengths in ([1], [2, 3], [9, 40, 7], [300, 5, 1, 2, 17, 64, 3, 3, 8, 120, 33, 2],
                        [2500], [6000, 4]):  # fmt: skip
            llm.generate(_prompts(lengths, seed=len(lengths)), params)
        assert compiled_variants() == ready
    finally:
        llm.shutdown()

"""FP8 / FP4 weights kept quantised on the GPU ("native") against their references and against the
checkpoint dequantised at load.

Kernels at dsv4-mini's layer shapes (V4-Flash per-layer shapes) in bf16 against the fp32 torch
references; the engine on a release-format tiny checkpoint: fp32 logits of the native path within
1e-3 of the dequantised path's (the kernels apply FP8 block scales per K step and sum in another
order: fp32 rounding only), the same greedy tokens, bf16 teacher-forced top-1 >= 98% and mean KL
<= 0.005 against the dequantised bf16 engine, and no kernel compiled after startup.

Needs CUDA; DSV4RAY_SMOKE_ON_CPU=1 runs the same code on CPU at tiny shapes (kernels under the
Triton interpreter, the engine on the torch backend) to check the file itself.
"""

import functools
import os

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.kernels import fp8_act
from dsv4ray.kernels.fp8_linear import fp8_linear, fp8_linear_ref
from dsv4ray.kernels.jit_cache import compiled_variants
from dsv4ray.kernels.moe import fused_moe, fused_moe_ref
from dsv4ray.kernels.testing import assert_close
from dsv4ray.model.quant import quantize_fp4, quantize_fp8
from dsv4ray.model.tiny import make_tiny

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("DSV4RAY_SMOKE_ON_CPU") != "1",
    reason="needs CUDA (DSV4RAY_SMOKE_ON_CPU=1 runs it on CPU at tiny shapes)",
)
DEVICE = "cuda" if CUDA else "cpu"
# (N, K, groups) of dsv4-mini's FP8 linears: wq_a, wkv, wq_b, wo_a (8 groups), wo_b
LINEARS = [(1024, 4096, 1), (512, 4096, 1), (32768, 1024, 1), (8192, 4096, 8), (4096, 8192, 1)]
ROWS = [1, 64, 2048] if CUDA else [1, 5, 70]
MOE = dict(hidden=4096, inter=2048, experts=9) if CUDA else dict(hidden=96, inter=64, experts=5)
if not CUDA:
    LINEARS = [(200, 300, 1), (144, 96, 2)]


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("n,k,groups", LINEARS)
def test_fp8_linear_at_model_shapes(n, k, groups, num_rows):
    w = torch.randn(n, k, device=DEVICE) * k**-0.5
    weight, scale = quantize_fp8(w.cpu(), (128, 128), "ue8m0")
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(num_rows, groups * k, device=DEVICE).bfloat16()
    ref = fp8_linear_ref(x, weight, scale, groups=groups)
    # bf16 products are exact in fp32; sums reorder, then one rounding to bf16 each
    assert_close("fp8_linear", fp8_linear(x, weight, scale, groups=groups), ref,
                 1e-3 * ref.float().abs().max().item(), 2**-7)  # fmt: skip


@functools.lru_cache(maxsize=2)
def _expert_stacks(fmt: str):
    hidden, inter, experts = MOE["hidden"], MOE["inter"], MOE["experts"]

    def quantize(rows, cols):
        w = torch.randn(rows, cols) * cols**-0.5
        return quantize_fp4(w) if fmt == "fp4" else quantize_fp8(w, (128, 128), "ue8m0")

    w13, s13, w2, s2 = [], [], [], []
    for _ in range(experts):
        (g, gs), (u, us), (d, ds) = (
            quantize(inter, hidden),
            quantize(inter, hidden),
            quantize(hidden, inter),
        )
        w13.append(torch.cat([g, u]))
        s13.append(torch.cat([gs, us]))
        w2.append(d)
        s2.append(ds)
    stack = lambda ts: torch.stack(ts).to(DEVICE)  # noqa: E731
    return stack(w13), stack(w2), (stack(s13), stack(s2))


@pytest.mark.parametrize("num_tokens", ROWS)
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fused_moe_quantized_at_model_shapes(fmt, num_tokens):
    w13, w2, scales = _expert_stacks(fmt)
    x = torch.randn(num_tokens, MOE["hidden"], device=DEVICE).bfloat16()
    ids = torch.randint(0, MOE["experts"], (num_tokens, 3), device=DEVICE)
    weights = torch.rand(num_tokens, 3, device=DEVICE)
    ref = fused_moe_ref(x, ids, weights, w13, w2, 10.0, scales, fmt)
    out = fused_moe(x, ids, weights, w13, w2, 10.0, scales, fmt)
    # h is rounded to bf16 by both; reordered fp32 sums can move an h value by one bf16 step
    assert_close(f"moe {fmt}", out, ref, 1e-2 * ref.float().abs().max().item(), 2e-2)


@pytest.fixture(scope="module", params=["fp8+fp4-experts", "fp8"])
def quant_ckpt(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    return make_tiny(str(out), "tiny", seed=4, quantize=request.param)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _engine(path, weight_format, dtype, prompts, **kw):
    """(teacher-forced log-probs per prompt, greedy tokens per prompt)."""
    llm = LLM(path, kv_cache_dtype="fp32", device=DEVICE, weight_format=weight_format,
              dtype=dtype, max_num_batched_tokens=512, **kw)  # fmt: skip
    try:
        scored = [s.float().cpu() for s in llm.score(prompts)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        return scored, [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def test_native_fp32_logits_and_tokens_equal_dequantized(quant_ckpt):
    prompts = _prompts([1, 129, 300, 700], seed=0)
    native = _engine(quant_ckpt, "native", "float32", prompts)
    dense = _engine(quant_ckpt, "dequantized", "float32", prompts)
    for got, want in zip(native[0], dense[0]):
        assert (got - want).abs().max() <= 1e-3
    assert native[1] == dense[1]


def test_native_bf16_passes_the_lossy_gates(quant_ckpt):
    """bf16 engines against the fp32 one (the dequantized weights' exact math, which the native
    fp32 engine equals above), over every teacher-forced position of four prompts (1,833): the
    native kernels and the dequantized bf16 weights each pass the gates of a lossy format."""
    prompts = _prompts([600, 333, 500, 400], seed=1)
    ref = torch.cat(_engine(quant_ckpt, "dequantized", "float32", prompts)[0])
    for weights in ("native", "dequantized"):
        logp = torch.cat(_engine(quant_ckpt, weights, "bfloat16", prompts)[0])
        agree = (logp.argmax(-1) == ref.argmax(-1)).float().mean()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean()
        assert agree >= 0.98 and kl <= 0.005, (weights, agree.item(), kl.item())


@pytest.mark.skipif(not CUDA or not fp8_act.supported(torch.device("cuda")),
                    reason="FP8 activations need FP8 tensor cores")  # fmt: skip
def test_fp8_prefill_passes_its_looser_gates(quant_ckpt):
    """EngineConfig.fp8_prefill (FP8 activations in the prefill chunks' FP8 linears: 512-row
    chunks here) against the fp32 engine over the same positions: FP8 activations keep 3
    mantissa bits, so the gates are the looser ones the README states for this option (top-1
    agreement >= 0.93, mean KL <= 0.01), not those of bf16 or fp8 pages."""
    prompts = _prompts([600, 333, 500, 400], seed=1)
    ref = torch.cat(_engine(quant_ckpt, "dequantized", "float32", prompts)[0])
    logp = torch.cat(_engine(quant_ckpt, "native", "bfloat16", prompts, fp8_prefill=True)[0])
    agree = (logp.argmax(-1) == ref.argmax(-1)).float().mean()
    kl = (ref.exp() * (ref - logp)).sum(-1).mean()
    assert agree >= 0.93 and kl <= 0.01, (agree.item(), kl.item())


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_native_serving_compiles_nothing_after_startup(quant_ckpt, cuda_graphs):
    llm = LLM(quant_ckpt, kv_cache_dtype="fp8", device=DEVICE, weight_format="native",
              dtype="bfloat16", cuda_graphs=cuda_graphs, max_running_requests=8,
              max_model_len=8192)  # fmt: skip
    try:
        ready = compiled_variants()
        assert sum(ready.values()) > 0 or not CUDA  # the interpreter compiles nothing
        for lengths, tokens in (([1, 2, 3], 9), ([17, 129, 600, 1100], 5), ([3000, 5, 77], 3)):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            llm.generate(_prompts(lengths, seed=len(lengths)), params)
        assert compiled_variants() == ready
    finally:
        llm.shutdown()


def test_native_drafts_give_the_tokens_of_plain_decoding_and_compile_nothing(quant_ckpt):
    """MTP drafts from the draft layer's native weights (graphed verification and draft passes):
    the tokens of the same engine without drafts (random weights: drafts verified, rarely
    accepted), and no kernel compiled after startup by the draft layer's FP8 linears or
    experts."""
    prompts = _prompts([1, 129, 300], seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for k in (0, 2):
        llm = LLM(quant_ckpt, kv_cache_dtype="fp32", device=DEVICE, weight_format="native",
                  dtype="float32", speculative_num_steps=k, use_ray=False)  # fmt: skip
        try:
            ready = compiled_variants()
            runs[k] = [o.token_ids for o in llm.generate(prompts, params)], llm.core.stats()
            assert compiled_variants() == ready, k
            if k:
                assert llm.core.pipeline.draft.block.e_proj.kind == "fp8"
        finally:
            llm.shutdown()
    assert runs[2][0] == runs[0][0]
    assert runs[2][1]["num_draft_tokens"] > 0, runs[2][1]

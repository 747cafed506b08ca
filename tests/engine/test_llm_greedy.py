"""The paged engine gives the reference's greedy tokens (fp32 pages) and stays serving on errors."""

import pytest
import torch

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from tests.oracle import reference_greedy

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def fp32_llm(tiny_ckpt):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    yield llm
    llm.shutdown()


def test_mixed_batch_equals_reference(fp32_llm, tiny_model):
    # around the 4 / 128 / 256 edges, plus one long prompt that chunks (budget 2048 > 1500)
    lengths = [1, 3, 127, 128, 129, 255, 256, 257, 511, 1500]
    prompts = _prompts(lengths)
    outs = fp32_llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 6), len(prompt)
        assert out.finish_reason == "length"
        assert out.metrics.num_prompt_tokens == len(prompt)


def test_chunked_prefill_equals_unchunked(tiny_ckpt, fp32_llm):
    prompts = _prompts([700, 300], seed=1)
    chunked = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=256)
    try:
        got = [o.token_ids for o in chunked.generate(prompts, GREEDY)]
    finally:
        chunked.shutdown()
    assert got == [o.token_ids for o in fp32_llm.generate(prompts, GREEDY)]


def test_prefix_hit_reports_cached_tokens_and_same_tokens(tiny_ckpt, tiny_model):
    base = _prompts([600], seed=2)[0]
    follow = base[:520] + _prompts([40], seed=3)[0]
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    try:
        first = llm.generate([base], GREEDY)[0]
        second = llm.generate([follow], GREEDY)[0]
    finally:
        llm.shutdown()
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 512  # two 256-token pages of the shared prefix
    assert second.token_ids == reference_greedy(tiny_model, follow, 6)


def test_small_pool_makes_requests_wait_and_all_finish(tiny_ckpt, tiny_model):
    prompts = _prompts([300, 280, 260, 200, 100], seed=4)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_total_tokens=1024, max_num_batched_tokens=512)
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 6)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda llm: llm.generate([[]], GREEDY), "empty"),
        (lambda llm: llm.generate([[5, 600, 7]], GREEDY), "vocabulary"),
        (lambda llm: llm.generate([[5, -1]], GREEDY), "vocabulary"),
        (
            lambda llm: llm.generate([[0, True]], GREEDY),
            "list of int token ids; this list holds bool",
        ),
        (lambda llm: llm.generate([[5] * 70000], GREEDY), "max_model_len"),
        (lambda llm: llm.generate(["hi"], SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.generate(["hi"], SamplingParams(top_p=0)), "top_p"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate(["hi"], [GREEDY, GREEDY]), "sampling_params"),
    ],
    ids=[
        "empty",
        "vocab-high",
        "vocab-negative",
        "bool-id",
        "too-long",
        "temperature",
        "top_p",
        "max_tokens",
        "params-count",
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(fp32_llm, tiny_model, bad, match):
    with pytest.raises(ValueError, match=match):
        bad(fp32_llm)
    prompt = _prompts([20], seed=5)[0]
    assert fp32_llm.generate([prompt], GREEDY)[0].token_ids == reference_greedy(
        tiny_model, prompt, 6
    )


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(bogus_option=1), "bogus_option"),
        (dict(max_num_batched_tokens=16), "max_num_batched_tokens"),
        (dict(max_total_tokens=-5), "max_total_tokens"),
        (dict(cuda_graphs="yes"), "cuda_graphs"),
        (dict(model_source=123), "model_source"),
    ],
)
def test_unknown_or_bad_options_are_named(tiny_ckpt, kw, name):
    with pytest.raises(ValueError, match=name):
        LLM(tiny_ckpt, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_asked_for_in_a_process_without_it_is_named(tiny_ckpt):
    with pytest.raises(ValueError, match="device='cuda'"):
        LLM(tiny_ckpt, device="cuda", use_ray=False)


def test_stop_conditions(fp32_llm, tiny_model):
    prompt = _prompts([50], seed=6)[0]
    ref = reference_greedy(tiny_model, prompt, 8)
    out = fp32_llm.generate(
        [prompt], SamplingParams(max_tokens=8, stop_token_ids=[ref[3]], ignore_eos=True)
    )[0]
    assert out.token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"
    text = fp32_llm.tokenizer.decode(ref)
    stop = text[len(fp32_llm.tokenizer.decode(ref[:4])) :][:1]
    if stop:
        got = fp32_llm.generate(
            [prompt], SamplingParams(max_tokens=8, stop=[stop], ignore_eos=True)
        )[0]
        assert got.finish_reason == "stop" and stop not in got.text

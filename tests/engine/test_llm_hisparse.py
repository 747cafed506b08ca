"""HiSparse engine (pp 1) against the all-on-device engine: the same greedy tokens with fp32
pages while hot rows miss, for a batch of different lengths with a preemption and for a request
that starts from a cached prefix, with MTP drafts (verification steps of several tokens a
request); fp8 pages pass the KL gates; the host store refuses what it
cannot hold; stats report hits, misses and bytes."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model.tiny import make_tiny

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
POOL_TOKENS = 1024  # 4 pages: four prompts near 256 tokens cannot all grow past a page


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def topk4_ckpt(tmp_path_factory) -> str:
    """The tiny preset with index_topk 4 (8 hot rows): decode steps keep missing."""
    return make_tiny(str(tmp_path_factory.mktemp("topk4")), "tiny", seed=3, index_topk=4)


@pytest.fixture(scope="module")
def engines(topk4_ckpt):
    """(HiSparse, all on device): fp32 pages, the same capacity (the host store caps HiSparse's)
    and a 512-token budget, so prompts prefill in chunks that reload their history."""
    common = dict(kv_cache_dtype="fp32", max_num_batched_tokens=512)
    hisparse = LLM(topk4_ckpt, enable_hisparse=True, hisparse_host_tokens=POOL_TOKENS, **common)
    device = LLM(topk4_ckpt, max_total_tokens=POOL_TOKENS, **common)
    assert hisparse.core.pipeline.capacity.num_pages == device.core.pipeline.capacity.num_pages
    yield hisparse, device
    hisparse.shutdown()
    device.shutdown()


def _check(llm) -> None:
    llm.core.check_integrity()
    for worker in llm.core.pipeline.workers:
        if worker.pools.hisparse is not None:
            worker.pools.hisparse.check_integrity()


def test_mixed_lengths_with_a_preemption_equal_all_on_device(engines):
    hisparse, device = engines
    prompts = _prompts([250, 245, 20, 9], seed=1)
    before = hisparse.core.stats()
    got = hisparse.generate(prompts, GREEDY)
    want = device.generate(prompts, GREEDY)
    after = hisparse.core.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert after["num_preemptions"] > before["num_preemptions"]  # 250 + 12 outgrows its page
    assert after["hisparse_misses"] - before["hisparse_misses"] > 0
    assert after["hisparse_hits"] - before["hisparse_hits"] > 0
    _check(hisparse)


def test_drafts_with_hisparse_in_process_equal_all_on_device(engines, topk4_ckpt):
    # verification steps of k + 1 tokens a request read their history pages through the host
    # store too (the pages a step needs counted by its last position, not its first)
    _, device = engines
    prompts = _prompts([250, 129, 9], seed=4)
    options = dict(enable_hisparse=True, hisparse_host_tokens=POOL_TOKENS, use_ray=False)
    llm = LLM(topk4_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=512,
              speculative_num_steps=2, **options)  # fmt: skip
    try:
        got = llm.generate(prompts, GREEDY)
        stats = llm.core.stats()
        _check(llm)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in device.generate(prompts, GREEDY)]
    assert stats["num_draft_tokens"] > 0 and stats["hisparse_misses"] > 0


def test_a_cached_prefix_is_read_from_host_history(engines):
    hisparse, device = engines
    base = _prompts([600], seed=2)[0]
    follow = base[:520] + _prompts([40], seed=3)[0]
    outs = {}
    for name, llm in (("hisparse", hisparse), ("device", device)):
        llm.generate([base], GREEDY)
        outs[name] = llm.generate([follow], GREEDY)[0]
    assert outs["hisparse"].metrics.num_cached_tokens == 512  # two pages of C4 history reused
    assert outs["hisparse"].token_ids == outs["device"].token_ids
    _check(hisparse)


def test_the_host_store_refuses_a_history_it_cannot_hold(engines):
    hisparse, _ = engines
    with pytest.raises(ValueError, match="hisparse_host_tokens"):
        hisparse.generate([[5] * POOL_TOKENS], GREEDY)


def test_stats_report_hot_rows_and_bytes(engines):
    hisparse, _ = engines
    hisparse.generate(_prompts([300], seed=4), GREEDY)
    stats = hisparse.core.stats()
    assert 0 < stats["hisparse_hit_rate"] < 1
    pools = hisparse.core.pipeline.workers[0].pools
    page_bytes = pools.layouts["c4"].page_bytes
    assert stats["hisparse_host_bytes"] == len(pools.c4) * pools.sizes.num_pages * page_bytes
    per_request = stats["hisparse_device_c4_bytes_per_request"]
    assert per_request == 8 * len(pools.c4) * page_bytes / 64  # 2 x index_topk rows per layer
    # at a 16k-token context the all-on-device pools hold 16384 / 4 entries per C4 layer
    assert per_request <= 16384 * stats["hisparse_all_on_device_c4_bytes_per_token"] / 4


def test_fp8_pages_pass_the_kl_gates_and_decode_like_all_on_device(tiny_ckpt, tiny_model):
    prompts = _prompts([600, 333], seed=7)
    hisparse = LLM(tiny_ckpt, kv_cache_dtype="fp8", max_num_batched_tokens=512,
                   enable_hisparse=True)  # fmt: skip
    try:
        scored = hisparse.score(prompts)
        got = [o.token_ids for o in hisparse.generate(prompts, GREEDY)]
        misses = hisparse.core.stats()["hisparse_misses"]
    finally:
        hisparse.shutdown()
    device = LLM(tiny_ckpt, kv_cache_dtype="fp8", max_num_batched_tokens=512)
    try:
        want = [o.token_ids for o in device.generate(prompts, GREEDY)]
    finally:
        device.shutdown()
    assert got == want and misses > 0
    for prompt, logp in zip(prompts, scored):
        ref = torch.log_softmax(tiny_model(torch.tensor([prompt]))[0].float(), dim=-1)
        top1 = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        assert top1 >= 0.98 and kl <= 0.005, (top1, kl)

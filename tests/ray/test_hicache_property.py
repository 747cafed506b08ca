"""Random workloads on the host tier at pp 1, 2 and 3 give the reference's greedy tokens.

Prompts are built from a few shared prefixes with suffixes around the 128/256-token edges, so
requests hit cached prefixes, evict each other to the host tier and load back, several of them
share a step, and at pp > 1 micro-batches are in flight while requests are preempted. Every
token of every request is compared with the reference (fp32 pages); after each workload every
request is gone and every page is accounted for.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4ray import LLM, SamplingParams
from tests.oracle import reference_greedy

MAX_NEW = 5
SUFFIX_LENS = [1, 127, 128, 129, 255, 256, 257]
_PREFIXES = [
    torch.randint(2, 258, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (0, 256)
]

_request = st.tuples(
    st.integers(0, len(_PREFIXES) - 1),  # shared prefix
    st.sampled_from(SUFFIX_LENS),
    st.integers(0, 3),  # suffix seed: equal seeds give equal prompts (full prefix hits)
    st.integers(1, MAX_NEW),  # max_tokens
)
_workload = st.lists(st.lists(_request, min_size=1, max_size=4), min_size=1, max_size=3)


def _prompt(prefix: int, suffix_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return _PREFIXES[prefix] + torch.randint(2, 258, (suffix_len,), generator=gen).tolist()


@pytest.fixture(scope="module", params=[1, 2, 3])
def hicache_llm(request, ray_session, tiny_ckpt):
    # 1024 device tokens (4 pages): a wave of up to four ~500-token prompts cannot stay on the
    # device, so prefixes go to the host tier and come back
    llm = LLM(
        tiny_ckpt,
        pp_size=request.param,
        kv_cache_dtype="fp32",
        enable_hicache=True,
        max_total_tokens=1024,
        host_cache_tokens=8192,
        max_num_batched_tokens=512,
        max_running_requests=4,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def greedy_of(tiny_model):
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = reference_greedy(tiny_model, prompt, MAX_NEW)
        return cache[tuple(prompt)]

    return greedy


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=_workload)
def test_random_workloads_with_the_host_tier_match_the_reference(hicache_llm, greedy_of, workload):
    for wave in workload:
        prompts = [_prompt(p, n, seed) for p, n, seed, _ in wave]
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for *_, m in wave]
        outs = hicache_llm.generate(prompts, params)
        for prompt, sp, out in zip(prompts, params, outs, strict=True):
            assert out.token_ids == greedy_of(prompt)[: sp.max_tokens]
            assert out.metrics.num_host_cached_tokens <= out.metrics.num_cached_tokens
        stats = hicache_llm.core.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        hicache_llm.core.check_integrity()

"""Features together: the host tier (H), HiSparse (S), MTP drafts k = 2 (D) and prefill/decode
disaggregation (P). Every pair of them, and all four at once, at pp 1 and 2 (prefill side too),
on the random tiny checkpoint and on an IndexShare one (its C4 layers' indexer ids are not their
compress ids), fp32 pages: greedy tokens equal the reference's, and each feature moved real
bytes (prefixes loaded from the host tier, HiSparse misses, drafts verified, handoffs).

Pairs tested elsewhere: H+S (tests/ray/test_hisparse_pipeline.py), H+D (test_hicache.py), S+P
(test_pd.py). The cells here are the rest and all four."""

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy
from tests.ray.test_pd import assert_nothing_held

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)

# name: (engine options, IndexShare checkpoint)
CELLS = {
    "D+P decode pp2": (dict(speculative_num_steps=2, prefill_pp_size=1, pp_size=2), False),
    "S+D pp2": (
        dict(speculative_num_steps=2, enable_hisparse=True, hisparse_hot_rows=17, pp_size=2),
        False,
    ),  # fmt: skip
    "H+D+P prefill pp2": (
        dict(enable_hicache=True, speculative_num_steps=2, prefill_pp_size=2, pp_size=1),
        False,
    ),  # fmt: skip
    "H+S+D+P IndexShare": (
        dict(
            enable_hicache=True,
            enable_hisparse=True,
            hisparse_hot_rows=17,
            speculative_num_steps=2,
            prefill_pp_size=1,
            pp_size=1,
        ),
        True,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def index_share(tmp_path_factory):
    ckpt = make_tiny(str(tmp_path_factory.mktemp("share")), "tiny", seed=0,
                     index_topk_pattern=["compute", "share", "compute"])  # fmt: skip
    return ckpt, load_reference(ckpt, torch.float32)


def _prompts(seed: int, host: bool) -> list[list[int]]:
    """With the host tier three 600-token prompts (with 1024 device tokens each evicts the one
    before it); always one across the first page edge and two around the window edge."""
    g = torch.Generator().manual_seed(seed)
    lengths = (600, 600, 600) * host + (300, 129, 3)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("cell", list(CELLS))
def test_features_together_give_the_reference_tokens(ray_session, tiny_ckpt, tiny_model,
                                                     index_share, cell):  # fmt: skip
    options, share = CELLS[cell]
    ckpt, model = index_share if share else (tiny_ckpt, tiny_model)
    host = options.get("enable_hicache", False)
    prompts = _prompts(len(cell), host)
    llm = LLM(ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=512,
              max_total_tokens=1024 if host else None, **options)  # fmt: skip
    try:
        outs = []
        if host:  # each alone, evicting the one before; then the first again, longer
            outs = [llm.generate([p], GREEDY)[0] for p in prompts[:3]]
            prompts.insert(3, prompts[0] + [9, 10])
        outs += llm.generate(prompts[len(outs) :], GREEDY)
        stats = llm.core.stats()
        if options.get("prefill_pp_size"):
            assert_nothing_held(llm)
            described = llm.core.describe()
            assert described["prefill_pp_size"] == options["prefill_pp_size"]
            # the decode side drafts; the prefill side keeps the rings, runs no draft layer
            assert described["draft_worker"] == bool(options.get("speculative_num_steps"))
            assert described["prefill_draft_worker"] is False
        llm.core.check_integrity()
        assert len(llm.core.pipeline.actors) == options["pp_size"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_greedy(model, prompt, 6)
    if host:  # the prefix of the first came back from a host tier (the prefill side's with PD)
        assert outs[3].metrics.num_host_cached_tokens > 0
    if options.get("enable_hisparse"):
        assert stats["hisparse_misses"] > 0
    if options.get("speculative_num_steps"):
        assert stats["num_draft_tokens"] > 0 and stats["num_verify_steps"] > 0
    if options.get("prefill_pp_size"):  # every prompt handed over, every handoff verified
        assert stats["pd_remote_prefills"] == len(prompts) and stats["pd_local_prefills"] == 0
        assert stats["pd_checksum_failures"] == 0 and stats["pd_transfer_bytes"] > 0
        assert all(o.metrics.kv_transfer_s > 0 for o in outs)

"""Speculative decoding on CUDA with verification and draft steps replayed from CUDA graphs: the
tokens of eager steps, of plain decoding and of the reference, with the graphs doing the work."""

import os

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _run(ckpt, k: int, cuda_graphs: bool, prompts, max_tokens, structured=None):
    """(token ids per prompt, verification bucket replays, draft bucket replays, stats), in
    process; structured: every request's structured_output."""
    llm = LLM(ckpt, kv_cache_dtype="fp32", device="cuda", use_ray=False, cuda_graphs=cuda_graphs,
              speculative_num_steps=k, max_running_requests=8, max_model_len=4096)  # fmt: skip
    try:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, structured_output=structured)
                  for n in max_tokens]  # fmt: skip
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        pipe = llm.core.pipeline
        stage = pipe.workers[0].graphs
        draft = pipe.draft.graphs if pipe.draft is not None else None
        return (outs, dict(stage.replays) if stage else {}, dict(draft.replays) if draft else {},
                llm.core.stats())  # fmt: skip
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind,k", [("window", 3), ("dsa", 2)], ids=["window-k3", "dsa-k2"])
def test_graphed_speculation_equals_eager_and_reference(tiny_ckpt, tiny_model, tmp_path, kind, k):
    if kind == "dsa":
        ckpt = make_tiny(str(tmp_path), "tiny", seed=1, compress_ratios=[0, 4, 128, 4, 4, 128, 4])
        ref = load_reference(ckpt, torch.float32)
    else:
        ckpt, ref = tiny_ckpt, tiny_model
    # requests finish at different steps: the batch shrinks through the 4, 2 and 1 buckets
    prompts, max_tokens = _prompts([5, 126, 254], seed=k), [4, 12, 8]
    graphed, verify_replays, draft_replays, stats = _run(ckpt, k, True, prompts, max_tokens)
    eager, none, none_either, _ = _run(ckpt, k, False, prompts, max_tokens)
    assert none == {} and none_either == {}
    assert {b for b, _ in verify_replays} == {1, 2, 4}, verify_replays
    assert {b for b, _ in draft_replays} == {1, 2, 4}, draft_replays
    assert graphed == eager
    assert graphed == [reference_greedy(ref, p, n) for p, n in zip(prompts, max_tokens)]
    if kind == "dsa":
        assert stats["num_topk_reuse_rows"] > 0


def test_trained_checkpoint_drafts_are_accepted_and_tokens_equal_plain_decoding():
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n"]
    plain, _, _, _ = _run(TRAINED, 0, True, prompts, [48, 48])
    spec, verify_replays, draft_replays, stats = _run(TRAINED, 3, True, prompts, [48, 48])
    assert spec == plain
    assert sum(verify_replays.values()) > 0 and sum(draft_replays.values()) > 0
    assert stats["num_draft_graph_passes"] == sum(draft_replays.values())
    assert stats["num_accepted_draft_tokens"] > stats["num_verify_steps"]  # > 2 tokens a step
    assert stats["num_failed_draft_passes"] == 0


def test_a_grammar_verified_on_graphed_drafts_gives_the_tokens_of_plain_decoding():
    """The masks of replayed verification steps follow drafts still on the device when the step
    was planned (the stage reads them before masking)."""
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n"]
    spec = {"regex": "([^e\\n][^t\\n])*[^e\\n]?"}  # no e at even characters, no t at odd
    plain, _, _, _ = _run(TRAINED, 0, True, prompts, [40, 40], spec)
    drafted, verify_replays, _, stats = _run(TRAINED, 3, True, prompts, [40, 40], spec)
    assert drafted == plain
    assert sum(verify_replays.values()) > 0 and stats["num_accepted_draft_tokens"] > 0
    assert stats["num_failed_draft_passes"] == 0


def test_stage_and_draft_actors_replay_graphs_with_the_tokens_of_plain_decoding():
    """One stage actor and its draft actor (the default with drafts): both capture graphs."""
    pytest.importorskip("ray", reason="the stage actors need ray")
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n"]
    plain, _, _, _ = _run(TRAINED, 0, True, prompts, [40, 40])
    llm = LLM(TRAINED, kv_cache_dtype="fp32", device="cuda", use_ray=True,
              speculative_num_steps=3, max_running_requests=8, max_model_len=4096)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        spec = [o.token_ids for o in llm.generate(prompts, params)]
        stats, stage = llm.core.stats(), llm.core.pipeline.stage_stats()[0]
    finally:
        llm.shutdown()
    assert spec == plain
    assert stage["num_graph_steps"] > 0
    assert 0 < stats["num_draft_graph_passes"] <= stats["num_draft_passes"]
    assert stats["num_failed_draft_passes"] == 0  # every pass fitted beside the stage

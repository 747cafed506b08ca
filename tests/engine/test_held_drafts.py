"""A draft worker in an actor of its own holds its proposals: the stage workers and the draft
worker run here the way RayPipeline's compiled graph calls their actors (``proposals`` first,
each stage's ``step`` with them, the draft pass after the last stage, nothing but the results and
the proposals between them), the last stage's rows reaching the draft worker through a device
link as on one GPU. Greedy tokens equal the reference at pp 1 and 2; the driver commits each
step before its proposals are read back, and requests a plan leaves out keep theirs pending
until a later step brings them; proposals that never come are verified as fillers, tokens exact.
"""

import copy
import os

import pytest
import torch
from tokenizers import Tokenizer

from dsv4ray.engine.plan import PENDING_DRAFT, DraftPlan, StepPlan
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from dsv4ray.worker.spec.draft_fill import FILLER_DRAFT, HeldDrafts, fill_held_drafts
from tests.engine.skipped_drafts import watch_skipped_drafts
from tests.oracle import reference_greedy

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")


class HeldDraftPipeline:
    """The engine's pipeline protocol over in-process workers called as the Ray graph calls the
    stage and draft actors; every other attribute is the in-process pipeline's."""

    def __init__(self, local, lose_every: int = 0, buckets: bool = False) -> None:
        self.local, self.workers, self.draft = local, local.workers, local.draft
        self.draft.held, self.draft.defer_drafts = HeldDrafts(), False
        ec = local.config
        rows = max(ec.max_num_batched_tokens, 4 * (ec.speculative_num_steps + 1))
        if buckets:  # the fixed-shape buckets CUDA graphs replay, run eagerly
            for worker in self.workers:
                worker.capture_graphs(4, 4096, ec.speculative_num_steps, capture=False)
            self.draft.capture_graphs(4, 4096, capture=False)
            self.workers[-1].hand_off_verifications()
        self.workers[-1].map_link(self.draft.open_link(2, rows))
        self.draft.link_peer(self.workers[-1].out_link.fences.export())
        self.depth, self.lose_every, self.steps = 1, lose_every, 0
        self.tickets = self.drafting = self.fillers = 0
        self.results: dict = {}

    def __getattr__(self, name):
        return getattr(self.local, name)

    def submit(self, plan: StepPlan) -> int:
        self.steps += 1
        if self.lose_every and self.steps % self.lose_every == 0:
            self.draft.held.passes.clear()  # as after a draft actor was replaced
        values = self.draft.held_values()
        self.fillers += sum(
            1 for r in plan.draft_lookahead if r not in values
        )  # requests whose proposals never came
        result = None
        for worker in self.workers:  # each actor decodes its own copy of the plan
            result = worker.step(copy.deepcopy(plan), result, drafts=values)
        plan = copy.deepcopy(plan)
        self.tickets += result.link is not None
        self.drafting += plan.draft and bool(plan.batch) and result.failed is None
        prepared = self.draft.prepare(plan, values)
        drafted = self.draft.execute_prepared(prepared, result)
        self.results[plan.step_id] = self.workers[-1].settle(drafted)
        return plan.step_id

    def collect(self, step_id: int):
        return self.results.pop(step_id)


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dsa"))
    path = make_tiny(out, "tiny", seed=1, compress_ratios=[0, 4, 128, 4, 4, 128, 4])
    return path, load_reference(path)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def _run(ckpt, k, pp, prompts, max_tokens, lose_every=0, buckets=False, **options):
    llm = LLM(ckpt, kv_cache_dtype="fp32", speculative_num_steps=k, pp_size=pp, use_ray=False,
              max_running_requests=4, **options)  # fmt: skip
    try:
        pipe = llm.core.pipeline = HeldDraftPipeline(llm.core.pipeline, lose_every, buckets)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)
                                      for n in max_tokens])  # fmt: skip
        llm.core.check_integrity()
        stats = llm.core.stats()
    finally:
        llm.shutdown()
    return outs, stats, pipe


@pytest.mark.parametrize(
    "kind,k,pp,buckets",
    [("window", 1, 1, False), ("dsa", 3, 1, False), ("dsa", 2, 2, False), ("window", 3, 1, True),
     ("dsa", 2, 2, True)],
)  # fmt: skip
def test_held_proposals_give_the_reference_tokens(
    request, tiny_ckpt, dsa_ckpt, kind, k, pp, buckets
):
    """With buckets, the last stage hands a replayed verification's rows and target tokens to
    the draft worker, which readied the step's bucket before the stage computed."""
    if kind == "window":
        ckpt, ref = tiny_ckpt, request.getfixturevalue("tiny_model")
    else:
        ckpt, ref = dsa_ckpt
    prompts, max_tokens = _prompts([3, 126, 250], seed=k), [10, 7, 9]
    outs, stats, pipe = _run(ckpt, k, pp, prompts, max_tokens, buckets=buckets)
    for prompt, out, n in zip(prompts, outs, max_tokens):
        assert out.token_ids == reference_greedy(ref, prompt, n)
        assert out.metrics.num_draft_tokens > 0
    assert stats["num_verify_steps"] > 0 and stats["num_failed_draft_passes"] == 0
    assert pipe.fillers == 0  # every pending draft came from the draft worker
    assert pipe.tickets == pipe.drafting > 0  # every step's rows went through the link
    if buckets:  # every replayed verification's rows fed the draft's bucket on the device
        verified = pipe.draft.graphs.num_verified
        assert verified == sum(pipe.workers[-1].graphs.replays.values()) > 0


def test_the_trained_model_accepts_held_proposals():
    """Held proposals are the requests' own MTP chains: the trained model accepts most."""
    ref = load_reference(TRAINED)
    tokenizer = Tokenizer.from_file(os.path.join(TRAINED, "tokenizer.json"))
    texts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n"]
    prompts = [tokenizer.encode(text).ids for text in texts]
    outs, stats, _ = _run(TRAINED, 3, 1, prompts, [24, 24])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 24)
    assert stats["num_accepted_draft_tokens"] > stats["num_verify_steps"] // 2


def test_proposals_that_never_come_are_verified_as_fillers(tiny_ckpt, tiny_model):
    prompts, max_tokens = _prompts([4, 60, 130], seed=7), [12, 12, 12]
    outs, stats, pipe = _run(tiny_ckpt, 2, 1, prompts, max_tokens, lose_every=3)
    assert pipe.fillers > 0
    for prompt, out, n in zip(prompts, outs, max_tokens):
        assert out.token_ids == reference_greedy(tiny_model, prompt, n)


def test_requests_a_full_budget_skips_get_their_proposals_with_a_later_step(tiny_ckpt, tiny_model):
    """66 decodes of 1 + 3 tokens do not fit a 256-token step: the requests a plan leaves out
    stay pending (their values are on the draft worker, not the host) and take them from the
    result of a later step; no plan ever waits for them."""
    prompts = _prompts([2] * 66, seed=5)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", speculative_num_steps=3, use_ray=False,
              max_num_batched_tokens=256, max_running_requests=80)  # fmt: skip
    skipped = watch_skipped_drafts(llm.core.scheduler)
    try:
        pipe = llm.core.pipeline = HeldDraftPipeline(llm.core.pipeline)
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    assert max(skipped) > 0 and pipe.fillers == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 5)


def test_fill_held_drafts_writes_pending_positions_and_fills_what_is_missing():
    from dsv4ray.engine.plan import BatchEntry

    plan = StepPlan(step_id=3)
    plan.batch = [BatchEntry("a", 10, 3, True, num_drafts=2), BatchEntry("b", 4, 1, True),
                  BatchEntry("c", 7, 4, True, num_drafts=3)]  # fmt: skip
    plan.token_ids = [5, PENDING_DRAFT, PENDING_DRAFT, 6, 9, PENDING_DRAFT, PENDING_DRAFT,
                      PENDING_DRAFT]  # fmt: skip
    plan.drafts = DraftPlan(lookahead=["a", "c"])
    resolved = fill_held_drafts(plan, {"a": [11, 12, 13], "z": [1, 2, 3]})
    assert plan.token_ids == [5, 11, 12, 6, 9] + [FILLER_DRAFT] * 3
    assert resolved == {"a": [11, 12, 13], "z": [1, 2, 3], "c": [FILLER_DRAFT] * 3}
    assert plan.draft_lookahead == []
    untouched = StepPlan(step_id=4, batch=[BatchEntry("a", 3, 2, True, num_drafts=1)],
                         token_ids=[1, PENDING_DRAFT])  # fmt: skip
    untouched.drafts = DraftPlan(lookahead=["a"])
    assert fill_held_drafts(untouched, None) == {} and untouched.draft_lookahead == ["a"]

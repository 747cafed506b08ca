"""Stages that share a GPU hand rows on through device links. Here the stage workers run in this
process the way stage actors run them (``step`` per stage, the last stage one step late and
writing its sampled ids into the first stage's table, posting each execution in the count the
first stage waits on before it fills, nothing but the results between them), linked as
RayPipeline links actors on one GPU, through a ring of two slots: greedy tokens equal the
reference at pp 2 and 3, with lookahead entries, hash-routed experts that read the filled token
ids, eager steps and static buckets, every step's rows go through the rings, and the last stage
posted every execution (a missed one would hold the first stage's next fill)."""

from collections import deque

import pytest
import torch

from dsv4ray.engine.pipeline import StepResults
from dsv4ray.engine.plan import FLUSH_STEP, StepPlan
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from dsv4ray.worker.graphs import overlap
from dsv4ray.worker.graphs.overlap import PostedCount, SampledTokens
from tests.oracle import reference_greedy


class LinkedStages:
    """The engine's pipeline protocol over stage workers called as the stage actors' compiled
    graph calls them; every other attribute is the in-process pipeline's."""

    def __init__(self, local, ring_depth: int) -> None:
        self.local, self.workers = local, local.workers
        self.depth, self.tickets, self.batches = 2, 0, 0
        self.outputs: deque = deque()
        self.results = StepResults()
        rows = local.config.max_num_batched_tokens
        for sender, receiver in zip(self.workers, self.workers[1:]):
            receiver.link_peer(sender.map_link(receiver.open_link(ring_depth, rows)))
        first, last = self.workers[0], self.workers[-1]
        first.sampled.export()  # creates the count of posted executions
        self.posted = PostedCount(first.sampled.posted.path, create=False)
        first.sampled.posted.unlink()
        # the table and the count, no edge back
        last.sampler.peer_tokens = SampledTokens(first.sampled.ids, posted=self.posted)

    def __getattr__(self, name):
        return getattr(self.local, name)

    def submit(self, plan: StepPlan) -> int:
        plan.lag, plan.take = True, False
        self.batches += bool(plan.batch)
        result = None
        for worker in self.workers:
            result = worker.step(plan, result)
            self.tickets += result.link is not None
        self.outputs.append(result)
        return plan.step_id

    def collect(self, step_id: int):
        return self.results.collect(step_id, self._next_output)

    def _next_output(self):
        if not self.outputs:
            self.submit(StepPlan(step_id=FLUSH_STEP))
        return self.outputs.popleft()


@pytest.fixture(scope="module")
def hash_ckpt(tmp_path_factory):
    """Hash-routed experts in layers 0-2: later stages route by the ids the first one filled."""
    path = make_tiny(str(tmp_path_factory.mktemp("hash3")), "tiny", seed=3, num_hash_layers=3)
    return path, load_reference(path, torch.float32)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("pp,buckets", [(2, False), (3, True)])
def test_linked_stages_equal_the_reference(hash_ckpt, pp, buckets, monkeypatch):
    monkeypatch.setattr(overlap, "POSTED_TIMEOUT_S", 5.0)  # a missed post fails, not hangs
    path, model = hash_ckpt
    prompts, max_tokens = _prompts([3, 130, 300, 254], seed=pp), [9, 4, 7, 12]
    llm = LLM(path, kv_cache_dtype="fp32", pp_size=pp, use_ray=False, overlap_scheduling=True,
              max_running_requests=4, max_model_len=4096)  # fmt: skip
    try:
        if buckets:  # the fixed-shape buckets CUDA graphs replay, run eagerly
            for worker in llm.core.pipeline.workers:
                worker.capture_graphs(4, 4096, 0, capture=False)
        linked = llm.core.pipeline = LinkedStages(llm.core.pipeline, ring_depth=2)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate(prompts, params)
        lookahead = llm.core.scheduler.lookahead_steps
        llm.core.check_integrity()
        replays = [w.stats()["num_graph_steps"] for w in linked.workers]
        executions = [w.executions for w in linked.workers]
        waited_for = linked.workers[0].sampled.awaited
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [
        reference_greedy(model, p, n) for p, n in zip(prompts, max_tokens)
    ]
    assert lookahead > 0
    assert linked.tickets == linked.batches * (pp - 1)  # every step's rows went through a ring
    assert (min(replays) > 0) == buckets
    # every stage ran every execution, the last posted each, the first waited for all before
    assert linked.posted.read() == executions[-1] == executions[0] == waited_for + 1

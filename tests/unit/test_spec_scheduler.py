"""Speculative decoding in the scheduler: drafts scheduled behind a decode, verified tokens
appended up to the first stop, rejected positions rolled back (pages, rings, snapshots).

The fake stage of scheduler_harness verifies drafts as the last stage does (the target token at
every scheduled position, the longest matching prefix accepted) and honours rollback diffs; a
fake draft worker proposes the true continuation with some tokens corrupted. Outputs must equal
the plain generation loop whatever was accepted, and every id must stay accounted for.
"""

import dataclasses
import random
from collections import deque

import pytest

from dsv4ray.engine.plan import PENDING_DRAFT
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.scheduler import Scheduler
from dsv4ray.engine.spec import MAX_DRAFT_STEPS, SpecConfig
from tests.unit.scheduler_harness import VOCAB, FakeStage, next_token, reference, small_config


class VerifyingStage(FakeStage):
    """FakeStage that verifies draft entries, applies rollbacks and proposes drafts."""

    def __init__(self, config, num_steps, p_wrong=0.35):
        super().__init__(config)
        self.num_steps, self.p_wrong, self.rng = num_steps, p_wrong, random.Random(0)
        self.rollbacks, self.num_cuts, self.num_preempted = [], 0, 0

    def run(self, plan):
        """-> (sampled, accepted, drafts) as the draft worker's result carries them."""
        self._roll_back(plan.diffs)
        self.num_preempted += len(plan.preempted_ids)
        batch, snapshots = plan.batch, plan.snapshots
        super().run(dataclasses.replace(plan, batch=[], token_ids=[], snapshots=[]))
        sampled, accepted, drafts, offset = {}, {}, {}, 0
        for entry in batch:
            tokens = plan.token_ids[offset : offset + entry.num_tokens]
            offset += entry.num_tokens
            context = self._run_entry(entry, tokens)
            if not entry.sample:
                continue
            d = entry.num_drafts
            base = len(context) - d  # context[:base] ends with the last committed token
            targets = [next_token(context[: base + j]) for j in range(d + 1)]
            a = 0
            while a < d and targets[a] == context[base + a]:
                a += 1
            sampled[entry.req_id], accepted[entry.req_id] = targets[a], context[base : base + a]
            drafts[entry.req_id] = self._propose(context[: base + a] + [targets[a]])
        for req_id, slot in snapshots:
            state = self.reqs[req_id]
            assert state[2] % self.page == 0
            self.cached[slot] = self.rings[state[3].state_slot]
        return sampled, accepted, drafts

    def _roll_back(self, diffs):
        """A rollback diff cuts the page table and forgets the rejected positions."""
        for diff in diffs:
            pages, _, computed, new = self.reqs[diff.req_id]
            if diff.num_pages >= 0:
                del pages[diff.num_pages :]
                self.num_cuts += 1
            if diff.rejected:
                first, end = diff.rejected
                assert computed == end
                self.reqs[diff.req_id][2] = first
                self.rings[new.state_slot] = self.rings[new.state_slot][:first]
                self.rollbacks.append((diff.req_id, first, end))

    def _propose(self, context):
        out, ctx = [], list(context)
        for _ in range(self.num_steps):
            tok = next_token(ctx)
            if self.rng.random() < self.p_wrong:
                tok = (tok + 1) % VOCAB
            out.append(tok)
            ctx.append(tok)
        return out


def drive_spec(sched, stage, depth=1, max_steps=3000):
    finished, in_flight = {}, deque()
    for _ in range(max_steps):
        if not sched.has_unfinished() and not in_flight:
            return finished
        while len(in_flight) < depth and (plan := sched.schedule()) is not None:
            assert plan.num_tokens <= sched.config.max_num_batched_tokens
            assert all(e.num_drafts <= stage.num_steps for e in plan.batch)
            sched.check_integrity()
            in_flight.append(plan)
        plan = in_flight.popleft()
        sampled, accepted, drafts = stage.run(plan)
        outcome = sched.commit(plan, sampled, accepted, drafts)
        for done in outcome.finished:
            finished[done.req_id] = done
        sched.check_integrity()
        for req_id in set(sampled) - set(finished):  # no page past the tokens at rest
            req = sched.get_request(req_id)
            if req.in_flight_step is None:
                assert len(req.page_ids) <= -(-req.num_tokens // sched.config.page_size)
    raise AssertionError("requests did not finish")


def spec_config(**overrides):
    return small_config(num_speculative_steps=3, **overrides)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_steps", [1, 3])
def test_outputs_equal_plain_decoding_with_rejections(num_steps, depth, caching):
    prompt = [3, 1, 4, 1, 5]
    free_run = reference(prompt, SamplingParams(max_tokens=30))[0]
    eos, stop_id = free_run[9], free_run[6]
    params = {
        "long": SamplingParams(max_tokens=70, ignore_eos=True),  # crosses pages, hits max len
        "eos": SamplingParams(max_tokens=30),
        "stop_ids": SamplingParams(max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        "short": SamplingParams(max_tokens=2, ignore_eos=True),
        "cut": SamplingParams(max_tokens=7, ignore_eos=True),
    }
    prompts = {"long": [5] * 41, "eos": prompt, "stop_ids": prompt, "short": [2] * 9}
    prompts["cut"] = list(range(21))  # shares its first two pages with nothing; snapshots at 8, 16
    config = spec_config(eos_token_id=eos, num_cached_state_slots=8, enable_prefix_caching=caching)
    sched, stage = Scheduler(config), VerifyingStage(config, num_steps)
    for name, prompt_ids in prompts.items():
        sched.add_request(name, prompt_ids, params[name])
    finished = drive_spec(sched, stage, depth)
    for name, prompt_ids in prompts.items():
        tokens, reason = reference(prompt_ids, params[name], eos=eos, max_model_len=96)
        assert finished[name].output_token_ids == tokens, name
        assert finished[name].finish_reason == reason, name
    assert stage.rollbacks, "no draft was ever rejected: the rollback path went untested"
    # one draft never needs a cut; with prefix caching a step ends at a page boundary at the
    # latest, so drafts never reach a page that a rejection cuts
    assert stage.num_cuts or num_steps == 1 or caching, "no page was cut"
    assert sched.kv.pages.num_in_use == 0 and sched.kv.state_slots.num_in_use == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_under_drafts_keeps_outputs_right(depth):
    config = spec_config(num_pages=8, max_model_len=64, num_cached_state_slots=4)
    sched, stage = Scheduler(config), VerifyingStage(config, 3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": [i + 1] * (17 + i) for i in range(3)}  # 150 tokens into 64 slots
    for name, prompt_ids in prompts.items():
        sched.add_request(name, prompt_ids, params)
    finished = drive_spec(sched, stage, depth)
    for name, prompt_ids in prompts.items():
        assert finished[name].output_token_ids == reference(prompt_ids, params)[0], name
    assert stage.num_preempted and stage.rollbacks


def test_stops_inside_the_accepted_drafts_end_where_plain_decoding_ends():
    prompt = [7, 7, 2]
    free_run = reference(prompt, SamplingParams(max_tokens=20))[0]
    for stop_at in (1, 2, 4):  # a stop token that verification accepts as a draft
        config = spec_config(eos_token_id=free_run[stop_at])
        sched = Scheduler(config)
        stage = VerifyingStage(config, 3, p_wrong=0)  # every draft right
        sched.add_request("r", prompt, SamplingParams(max_tokens=20))
        done = drive_spec(sched, stage)["r"]
        assert done.output_token_ids == free_run[: free_run.index(free_run[stop_at]) + 1]
        assert done.finish_reason == "stop"


def test_drafts_are_budget_and_stay_below_max_tokens():
    config = spec_config(max_num_batched_tokens=16)
    sched = Scheduler(config)
    stage = VerifyingStage(config, 3, p_wrong=0)
    sched.add_request("a", [1] * 8, SamplingParams(max_tokens=6, ignore_eos=True))
    plan = sched.schedule()
    sched.commit(plan, *stage.run(plan))
    assert sched.get_request("a").draft_token_ids  # proposals for the next step
    sched.add_request("b", [2] * 30, SamplingParams(max_tokens=2))
    plan = sched.schedule()
    (a, b) = plan.batch
    assert (a.req_id, a.num_tokens, a.num_drafts) == ("a", 4, 3)  # decodes go first
    assert (b.start_pos, b.num_tokens) == (0, 8)  # the prefill chunk gets what is left, aligned
    sched.commit(plan, *stage.run(plan))
    plan = sched.schedule()
    # 6 tokens asked, 1 + 4 committed: one left, so no draft may be scheduled
    assert plan.batch[0].req_id == "a" and plan.batch[0].num_drafts == 0


def test_a_snapshot_past_the_verified_end_is_dropped():
    config = spec_config()
    sched = Scheduler(config)
    stage = VerifyingStage(config, 3, p_wrong=1)  # every draft wrong
    sched.add_request("a", list(range(4)), SamplingParams(max_tokens=20, ignore_eos=True))
    plan = sched.schedule()  # prefill 0..3, then position 4 + 3 drafts: ends on boundary 8
    sched.commit(plan, *stage.run(plan))
    plan = sched.schedule()
    assert plan.batch[0].start_pos + plan.batch[0].num_tokens == 8 and plan.snapshots
    free_slots = sched.kv.cached_state_slots.num_free
    sched.commit(plan, *stage.run(plan))
    req = sched.get_request("a")
    assert req.num_computed_tokens == 5 and req.snapshot is None
    assert sched.kv.cached_state_slots.num_free == free_slots + 1
    sched.check_integrity()


def test_config_limits_and_tree_drafting_with_reuse_are_refused():
    with pytest.raises(ValueError, match="speculative_num_steps"):
        SpecConfig(MAX_DRAFT_STEPS + 1)
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        SpecConfig(2, 0)
    with pytest.raises(ValueError, match="speculative_eagle_topk=2: tree drafting"):
        SpecConfig(0, 2)  # refused without drafts too, as the docs say
    with pytest.raises(ValueError, match="DSA-style.*chain drafting"):
        SpecConfig(2, 2).check_draft_layer(4, [])
    with pytest.raises(ValueError, match="tree drafting is not supported"):
        SpecConfig(2, 2).check_draft_layer(0, [])
    with pytest.raises(ValueError, match="lacks mtp.0.a, mtp.0.b, mtp.0.c, mtp.0.d and 1 more"):
        SpecConfig(2).check_draft_layer(0, [f"mtp.0.{c}" for c in "abcde"])
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        SpecConfig(2).check_draft_layer(None, [])
    SpecConfig(3).check_draft_layer(4, [])
    SpecConfig(0).check_draft_layer(None, ["mtp.0.a"])  # off: nothing to check


def test_drafts_scheduled_before_they_reach_the_host_give_plain_decoding():
    """An in-process engine commits a step without its proposals (expect_drafts: PENDING_DRAFT
    ids), the next plan schedules them in draft_lookahead, and its drafts are written in
    before the step runs (keep_drafts at commit): outputs equal plain decoding."""
    prompts = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8]}
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    config = spec_config()
    sched, stage = Scheduler(config), VerifyingStage(config, 3)
    for req_id, prompt in prompts.items():
        sched.add_request(req_id, prompt, params)
    held, finished, num_lookahead = {}, {}, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert set(plan.draft_lookahead) == set(sched.pending_drafts())  # none skipped here
        first = 0
        for e in plan.batch:
            drafts = plan.token_ids[first + e.num_tokens - e.num_drafts : first + e.num_tokens]
            if e.req_id in plan.draft_lookahead:
                assert drafts == [PENDING_DRAFT] * e.num_drafts
                plan.token_ids[first + e.num_tokens - e.num_drafts : first + e.num_tokens] = held[
                    e.req_id
                ][: e.num_drafts]  # what DraftFill.resolve writes
                num_lookahead += 1
            first += e.num_tokens
        sampled, accepted, drafts = stage.run(plan)
        sched.keep_drafts({r: held[r] for r in plan.draft_lookahead})
        outcome = sched.commit(plan, sampled, accepted, {})
        finished.update((done.req_id, done) for done in outcome.finished)
        sched.expect_drafts(list(drafts), 3)
        held = drafts
        sched.check_integrity()
    assert num_lookahead > 0
    for req_id, prompt in prompts.items():
        assert finished[req_id].output_token_ids == reference(prompt, params)[0]
    sched.keep_drafts({"a": [1, 2, 3]})  # a finished request waits for nothing


@pytest.mark.parametrize("depth", [1, 2])
def test_pages_filled_while_drafting_enter_the_prefix_cache(depth):
    """Every page a drafting request fills is cached as plain decoding caches it: a step ends
    at each page boundary with all its drafts accepted (a step across it, or one that rejects
    a draft there, takes no snapshot), so the whole context is reused by the next turn."""
    config = spec_config(num_cached_state_slots=16)
    sched, stage = Scheduler(config), VerifyingStage(config, 3)
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=40, ignore_eos=True)
    sched.add_request("turn1", prompt, params)
    out = drive_spec(sched, stage, depth)["turn1"].output_token_ids
    assert out == reference(prompt, params)[0] and stage.rollbacks
    context = prompt + out
    sched.add_request("turn2", context, SamplingParams(max_tokens=1))
    done = drive_spec(sched, stage, depth)["turn2"]
    assert done.num_cached_tokens == (len(context) - 1) // 8 * 8  # every full page but the last

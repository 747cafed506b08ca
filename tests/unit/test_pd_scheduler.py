"""The decode scheduler of a prefill/decode pair (no tensors): remote requests hold reserved ids
while their KV is written elsewhere, run only once started, and every failed handoff falls back
to a local prefill; ids a late write can still reach are never reused before its answer. The fake
stage turns a wrong or reused id into a wrong output (tests/unit/scheduler_harness.py)."""

import random
from collections import deque

import pytest

from dsv4ray.engine.pd.handoff_plan import trailing_windows
from dsv4ray.engine.pd.scheduler import DecodeScheduler
from dsv4ray.engine.sampling import SamplingParams
from tests.unit.scheduler_harness import (
    FakeStage,
    check_plan,
    commit_and_check,
    next_token,
    reference,
    small_config,
)


def write_kv(stage: FakeStage, config, ids, tokens) -> None:
    """What a prefill engine's stages write: the tokens' full slots, the trailing window and the
    ring of the reserved state slot."""
    page, window = config.page_size, config.window_page_size
    for pos, tok in enumerate(tokens):
        stage.full[ids.page_ids[pos // page] * page + pos % page] = tok
    windows = dict(ids.window_pages)
    for idx in trailing_windows(len(tokens), window):
        for pos in range(idx * window, min(len(tokens), (idx + 1) * window)):
            stage.win[windows[idx] * window + pos % window] = tokens[pos]
    stage.rings[ids.state_slot] = tuple(tokens)


class Prefills:
    """Answers handoffs in random order and ways: verified, failed after the write (a checksum
    mismatch), timed out (the write lands later, into held ids), or after an abort."""

    def __init__(self, sched: DecodeScheduler, stage: FakeStage, rng: random.Random) -> None:
        self.sched, self.stage, self.rng = sched, stage, rng
        self.pending, self.late, self.finished = {}, [], {}

    def tick(self) -> None:
        for transfer in self.sched.reserve_remote():
            tokens = list(transfer.req.token_ids)
            self.pending[transfer.transfer_id] = (transfer, transfer.device_ids, tokens)
        for tid in list(self.pending):
            if self.rng.random() < 0.4:
                continue  # not answered yet
            transfer, ids, tokens = self.pending.pop(tid)
            self._answer(transfer, ids, tokens)
        while self.late and self.rng.random() < 0.5:
            tid, ids, tokens = self.late.pop(0)
            write_kv(self.stage, self.sched.config, ids, tokens)  # reaches held ids only
            self.sched.answered(tid)

    def _answer(self, transfer, ids, tokens) -> None:
        req_id, roll = transfer.req.req_id, self.rng.random()
        if self.sched.transfers.get(req_id) is not transfer:  # aborted meanwhile
            self.late.append((transfer.transfer_id, ids, tokens))
            return
        if roll < 0.15:  # timed out: fall back now, the write comes later
            self.sched.fall_back(req_id)
            self.late.append((transfer.transfer_id, ids, tokens))
            return
        write_kv(self.stage, self.sched.config, ids, tokens)
        done = self.sched.first_token(req_id, next_token(tokens))
        if done is not None:
            self.finished[req_id] = done
        elif roll < 0.3:  # the received bytes did not check out
            self.sched.fall_back(req_id)
        else:
            self.sched.start_remote(req_id)


def run(sched, prefills, depth, abort_rate, rng):
    finished, in_flight, streamed, aborted = prefills.finished, deque(), {}, set()
    for _ in range(20000):
        prefills.tick()
        sched.check_integrity()
        if not sched.has_unfinished() and not in_flight and not prefills.late:
            return finished, aborted
        if rng.random() < abort_rate and sched._requests:
            victim = rng.choice(sorted(sched._requests))
            finished[victim] = sched.abort(victim)
            aborted.add(victim)
        while len(in_flight) < depth and (plan := sched.schedule()) is not None:
            check_plan(sched.config, plan)
            in_flight.append(plan)
        if in_flight:
            commit_and_check(sched, prefills.stage, in_flight.popleft(), finished, streamed)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("seed", range(6))
def test_remote_and_fallback_requests_give_the_reference_tokens(seed):
    rng = random.Random(seed)
    config = small_config(enable_prefix_caching=seed % 2 == 0)
    sched = DecodeScheduler(config)
    prompts = {}
    for i in range(10):
        prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)
        sched.add_request(f"r{i}", prompt, params)
        if rng.random() < 0.8:
            sched.mark_remote(f"r{i}")
        prompts[f"r{i}"] = (prompt, params)
    prefills = Prefills(sched, FakeStage(config), rng)
    finished, aborted = run(sched, prefills, depth=1 + seed % 2, abort_rate=0.02, rng=rng)
    assert set(finished) == set(prompts)
    for req_id, (prompt, params) in prompts.items():
        if req_id not in aborted:
            want = reference(prompt, params, max_model_len=config.max_model_len)
            assert (finished[req_id].output_token_ids, finished[req_id].finish_reason) == want
    assert not sched.held and not sched.transfers
    assert sched.kv.pages.num_free + sched.kv.pages.num_cached == config.num_pages


def test_transferring_ids_stay_held_through_preemption_abort_and_a_late_answer():
    config = small_config(num_pages=6, max_model_len=40, enable_prefix_caching=False)
    sched = DecodeScheduler(config)
    sched.add_request("remote", list(range(1, 20)), SamplingParams(max_tokens=4))
    sched.mark_remote("remote")
    (transfer,) = sched.reserve_remote()
    held_pages = list(transfer.req.page_ids)
    assert len(held_pages) == 3 and sched.num_running == 0  # reserved, not running
    sched.add_request("local", list(range(1, 17)), SamplingParams(max_tokens=20, ignore_eos=True))
    stage, finished, streamed = FakeStage(config), {}, {}
    for _ in range(20):  # "local" outgrows the 3 free pages: it preempts itself, never "remote"
        plan = sched.schedule()
        if plan is not None:
            commit_and_check(sched, stage, plan, finished, streamed)
        assert sched.transfers["remote"] is transfer
        assert all(sched.kv.pages.refcount(p) == 1 for p in held_pages)
        sched.check_integrity()
    assert sched.get_request("local").admit_seq >= 1  # it was preempted and admitted again
    sched.abort("remote")  # before the prefill engine answered: its ids stay held
    assert all(sched.kv.pages.refcount(p) == 1 for p in held_pages)
    sched.check_integrity()
    sched.answered(transfer.transfer_id)
    assert all(sched.kv.pages.refcount(p) == 0 for p in held_pages)
    sched.check_integrity()


def test_a_preempted_request_with_output_resumes_here_never_handed_over_again():
    """Its generated tokens would reach a prefill engine as prompt, where penalties, min_tokens
    and a grammar would see no output: it is prefilled locally, and its tokens stay the
    reference's."""
    config = small_config(num_pages=6, max_model_len=40, enable_prefix_caching=False)
    sched, stage, finished, streamed = DecodeScheduler(config), FakeStage(config), {}, {}
    local, prompt = list(range(1, 17)), list(range(1, 20))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    sched.add_request("local", local, params)
    commit_and_check(sched, stage, sched.schedule(), finished, streamed)  # admitted first
    sched.add_request("remote", prompt, params)
    sched.mark_remote("remote")
    (transfer,) = sched.reserve_remote()
    write_kv(stage, config, transfer.device_ids, prompt)
    sched.first_token("remote", next_token(prompt))
    sched.start_remote("remote")
    preempted, handed_over = [], []
    for _ in range(60):
        handed_over += [t.req.req_id for t in sched.reserve_remote()]
        plan = sched.schedule()
        if plan is None:
            break
        preempted += plan.preempted_ids
        commit_and_check(sched, stage, plan, finished, streamed)
        sched.check_integrity()
    assert "remote" in preempted  # the precondition: it ran, then lost its pages
    assert handed_over == []
    assert finished["remote"].output_token_ids == reference(prompt, params)[0]
    assert finished["local"].output_token_ids == reference(local, params)[0]

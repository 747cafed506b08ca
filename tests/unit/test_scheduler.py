"""Scheduler: budgets, chunking, prefix reuse, preemption, stop conditions, id conservation.

Plans run on the FakeStage of scheduler_harness, which checks every page, window and state id it
is given and makes outputs depend on them; outputs must equal the plain reference loop.
"""

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.scheduler_harness import (
    VOCAB,
    FakeStage,
    check_plan,
    commit_and_check,
    drive,
    reference,
    small_config,
)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_pages": 0}, "num_pages"),
        ({"num_state_slots": 0}, "num_state_slots"),
        ({"num_cached_state_slots": -1}, "num_cached_state_slots"),
        ({"page_size": 6}, "window_page_size"),
        ({"max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"max_model_len": 200}, "max_model_len"),
        ({"num_window_pages": 6}, "num_window_pages"),
        ({"eos_token_id": -1}, "eos_token_id"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        small_config(**overrides)


def test_bad_requests_raise_and_the_scheduler_keeps_serving():
    sched = Scheduler(small_config())
    sched.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("a", [1])
    with pytest.raises(ValueError, match="empty"):
        sched.add_request("b", [])
    with pytest.raises(ValueError, match="96 tokens, max_model_len is 96"):
        sched.add_request("c", [1] * 96)
    with pytest.raises(ValueError, match="token ids"):
        sched.add_request("d", [1, -2])
    assert sched.num_waiting == 1
    assert drive(sched)["a"].output_token_ids == reference([1, 2, 3], SamplingParams())[0]


def test_chunked_prefill_ends_on_page_boundaries_and_samples_at_the_end():
    sched = Scheduler(small_config())
    sched.add_request("a", list(range(20)) * 2, SamplingParams(max_tokens=2))  # 40 tokens
    spans = []
    while (plan := sched.schedule()) is not None:
        spans += [(e.start_pos, e.num_tokens, e.sample) for e in plan.batch]
        sched.commit(plan, {e.req_id: 5 for e in plan.batch if e.sample})
    assert spans == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]


def test_decodes_go_first_and_the_budget_caps_the_step():
    sched = Scheduler(small_config())
    stage = FakeStage(sched.config)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    plan = sched.schedule()
    sched.commit(plan, stage.run(plan))
    sched.add_request("b", list(range(30)))
    plan = sched.schedule()
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in plan.batch] == [("a", 3, 1), ("b", 0, 8)]
    assert plan.new_requests[0].req_id == "b" and plan.diffs == []


def _prompt_progress(sched, stage, prompt_id: str, steps: int) -> list[tuple[int, list[str]]]:
    """(tokens the prompt computed in the step, requests decoded) of the next steps."""
    out = []
    for _ in range(steps):
        plan = sched.schedule()
        done = [e for e in plan.batch if e.req_id == prompt_id and not e.sample]
        decoded = [e.req_id for e in plan.batch if e.req_id != prompt_id and e.num_tokens == 1]
        out.append((sum(e.num_tokens for e in done), decoded))
        sched.commit(plan, stage.run(plan))
    return out


@pytest.mark.parametrize("budget", [8, 9], ids=["one page", "a page and a token"])
def test_decodes_that_take_the_budget_leave_prompts_a_page_every_other_step(budget):
    """Prefill chunks end on page boundaries: decodes leaving less than a page of the budget
    would hold a prompt (and every prompt queued behind it) back for as long as they run. A
    step after one that left a prompt waiting keeps a page for it: both progress, and the
    outputs still equal the reference."""
    config = small_config(max_num_batched_tokens=budget, num_state_slots=4)
    sched, stage = Scheduler(config), FakeStage(config)
    for name in "abc":  # three decodes: with budget 9 they leave 6 tokens, less than a page
        sched.add_request(name, [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
    while sched.num_waiting:
        plan = sched.schedule()
        sched.commit(plan, stage.run(plan))
    sched.add_request("long", list(range(40)), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request("next", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    progress = _prompt_progress(sched, stage, "long", 10)
    assert [n for n, _ in progress[:8]] == [0, 8] * 4  # a page every other step, 32 of 40
    assert all(decoded == ["a", "b", "c"] for n, decoded in progress[:8] if n == 0)
    outputs = drive(sched, stage)
    assert "next" in outputs and "long" in outputs  # the queue behind the prompt moved on
    for name in ("long", "next"):
        prompt = outputs[name].prompt_token_ids
        assert outputs[name].output_token_ids == reference(prompt, SamplingParams(
            max_tokens=2, ignore_eos=True))[0]  # fmt: skip


def test_a_budget_with_room_for_a_page_beside_the_decodes_holds_no_decode_back():
    config = small_config(max_num_batched_tokens=16)
    sched, stage = Scheduler(config), FakeStage(config)
    for name in "abc":
        sched.add_request(name, [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    plan = sched.schedule()
    sched.commit(plan, stage.run(plan))
    sched.add_request("long", list(range(40)))
    progress = _prompt_progress(sched, stage, "long", 4)
    assert all(decoded == ["a", "b", "c"] for _, decoded in progress)
    assert [n for n, _ in progress] == [8, 8, 8, 8]


def test_running_decodes_go_before_running_prefills():
    config = small_config()
    sched, stage = Scheduler(config), FakeStage(config)
    shared = list(range(8))
    sched.add_request("q", shared + [20] * 9, SamplingParams(max_tokens=1))
    drive(sched, stage)  # caches q's first two pages, with a snapshot only at 16
    sched.add_request("p", shared + [30] * 32)  # leaves the cached path after page 0
    sched.add_request("d", [1, 2, 3], SamplingParams(max_tokens=4))
    plan = sched.schedule()
    # p's first chunk ends where it leaves the cached path, so that a snapshot lands there
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in plan.batch] == [("p", 0, 8), ("d", 0, 3)]
    assert plan.snapshots and plan.snapshots[0][0] == "p"
    sched.commit(plan, stage.run(plan))
    plan = sched.schedule()  # p (admitted first) still prefills, d decodes: d goes first
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in plan.batch] == [("d", 3, 1), ("p", 8, 8)]


def test_outputs_equal_the_reference_with_stop_conditions():
    prompt = [2] * 13
    free_run = reference(prompt, SamplingParams(max_tokens=30))[0]
    eos, stop_id = free_run[4], free_run[2]  # tokens the request is known to produce
    params = {
        "plain": SamplingParams(max_tokens=12),
        "stop_ids": SamplingParams(max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        "eos": SamplingParams(max_tokens=30),
        "ignore_eos": SamplingParams(max_tokens=30, ignore_eos=True),
        "long": SamplingParams(max_tokens=90, ignore_eos=True),
    }
    prompts = {
        "plain": [1] * 5,
        "stop_ids": prompt,
        "eos": prompt,
        "ignore_eos": prompt,
        "long": [5] * 41,
    }
    sched = Scheduler(small_config(eos_token_id=eos))
    for name, prompt_ids in prompts.items():
        sched.add_request(name, prompt_ids, params[name])
    finished = drive(sched)
    for name, prompt_ids in prompts.items():
        tokens, reason = reference(prompt_ids, params[name], eos=eos, max_model_len=96)
        assert finished[name].output_token_ids == tokens
        assert finished[name].finish_reason == reason
    assert finished["eos"].output_token_ids[-1] == eos
    assert finished["eos"].finish_reason == "stop"
    assert finished["stop_ids"].output_token_ids == free_run[:3]
    assert finished["stop_ids"].finish_reason == "stop"
    assert finished["ignore_eos"].output_token_ids == free_run
    assert finished["long"].finish_reason == "length"
    assert len(prompts["long"]) + len(finished["long"].output_token_ids) == 96


def test_prefix_hit_reports_cached_tokens_and_shares_pages():
    sched = Scheduler(small_config())
    prompt = list(range(21))  # the last boundary an identical prompt can match: 16
    sched.add_request("a", prompt, SamplingParams(max_tokens=3))
    first = drive(sched)["a"]
    assert first.num_cached_tokens == 0
    sched.add_request("b", prompt, SamplingParams(max_tokens=3))
    plan = sched.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 16 and new.state_copy_from >= 0
    assert plan.batch[0].start_pos == 16 and plan.batch[0].num_tokens == 5
    assert new.window_page_ids[16 // 4 - 1] >= 0  # the window page of positions 12..15
    assert sched.num_cached_tokens("b") == 16
    stage = FakeStage(sched.config)
    stage.cached = {}  # a cold stage cannot serve the hit: the next assert proves it is used
    with pytest.raises(KeyError):
        stage.run(plan)


def test_prefix_is_shared_while_its_request_still_runs():
    config = small_config()
    sched, stage = Scheduler(config), FakeStage(config)
    prompt = list(range(21))
    params = SamplingParams(max_tokens=20)
    sched.add_request("a", prompt, params)
    for _ in range(4):  # chunks 0..16, 16..21, then decodes: "a" is past boundary 16
        plan = sched.schedule()
        sched.commit(plan, stage.run(plan))
    sched.add_request("b", prompt, params)
    finished = drive(sched, stage)
    assert finished["b"].num_cached_tokens == 16
    for name in ("a", "b"):
        assert finished[name].output_token_ids == reference(prompt, params)[0]


def test_commit_ignores_requests_aborted_while_in_flight():
    config = small_config()
    sched, stage = Scheduler(config), FakeStage(config)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    sched.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3))
    plan = sched.schedule()
    sampled = stage.run(plan)
    assert sched.abort("a").output_token_ids == []
    with pytest.raises(ValueError, match="sampled no token for \\['b'\\]"):
        sched.commit(plan, {})
    outcome = sched.commit(plan, sampled)
    assert outcome.finished == [] and outcome.tokens == {"b": sampled["b"]}  # "a" is gone
    with pytest.raises(ValueError, match="not in flight"):
        sched.commit(plan, sampled)
    assert sched.get_request("b").output_token_ids == [sampled["b"]]
    sched.check_integrity()


def test_logprobs_are_requested_for_sampling_entries_only():
    sched = Scheduler(small_config())
    sched.add_request("lp", list(range(12)), SamplingParams(max_tokens=2, logprobs=3))
    sched.add_request("plain", [1, 2], SamplingParams(max_tokens=2))
    plan = sched.schedule()  # "lp" runs up to its prompt's last boundary (8), "plain" samples
    assert [(e.req_id, e.sample) for e in plan.batch] == [("lp", False), ("plain", True)]
    assert plan.logprobs == {}
    sched.commit(plan, {"plain": 0})
    plan = sched.schedule()
    assert [(e.req_id, e.sample) for e in plan.batch] == [("plain", True), ("lp", True)]
    assert plan.logprobs == {"lp": 3}
    assert plan.new_requests == [] and [d.req_id for d in plan.diffs] == ["lp"]


def test_prefix_hit_gives_the_same_tokens_as_a_cold_run():
    config = small_config()
    sched, stage = Scheduler(config), FakeStage(config)
    system = [9, 8, 7, 6, 5, 4, 3, 2] * 3  # 24 tokens shared by every request
    outs = {}
    for i in range(4):
        prompt = system + [i] * (3 + i)
        sched.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4))
        outs.update(drive(sched, stage))
        assert outs[f"r{i}"].output_token_ids == reference(prompt, SamplingParams(max_tokens=4))[0]
    assert outs["r0"].num_cached_tokens == 0
    assert [outs[f"r{i}"].num_cached_tokens for i in (1, 2, 3)] == [24, 24, 24]


def test_pool_too_small_makes_requests_wait_and_all_finish():
    config = small_config(num_pages=12, num_state_slots=2, max_model_len=96)
    sched = Scheduler(config)
    prompts = {f"r{i}": [(i * 7 + k) % VOCAB for k in range(10 + 6 * i)] for i in range(6)}
    for name, prompt in prompts.items():
        sched.add_request(name, prompt, SamplingParams(max_tokens=20))
    stage, finished, max_running = FakeStage(config), {}, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        max_running = max(max_running, sched.num_running)
        for done in sched.commit(plan, stage.run(plan)).finished:
            finished[done.req_id] = done
        sched.check_integrity()
    assert max_running == 2
    for name, prompt in prompts.items():
        assert (
            finished[name].output_token_ids == reference(prompt, SamplingParams(max_tokens=20))[0]
        )


def test_preempted_request_recomputes_and_finishes_with_the_same_tokens():
    # 7 pages of 8 tokens: two requests of 12-token prompts cannot both reach 12 + 30 tokens.
    config = small_config(num_pages=7, max_model_len=56, num_cached_state_slots=0)
    sched, stage = Scheduler(config), FakeStage(config)
    params = SamplingParams(max_tokens=30)
    sched.add_request("old", list(range(12)), params)
    sched.add_request("new", list(range(12, 24)), params)
    finished, preempted = {}, []
    while sched.has_unfinished():
        plan = sched.schedule()
        preempted += plan.preempted_ids
        for done in sched.commit(plan, stage.run(plan)).finished:
            finished[done.req_id] = done
        sched.check_integrity()
    assert preempted and set(preempted) == {"new"}
    assert finished["new"].output_token_ids == reference(list(range(12, 24)), params)[0]
    assert finished["old"].output_token_ids == reference(list(range(12)), params)[0]


@pytest.mark.parametrize("num_pages", [3, 4])
def test_a_request_computing_every_position_finishes_beside_its_cached_prefix(num_pages):
    """A request that does not read the prefix cache (prompt logprobs, scoring) in a pool it
    fills with a copy of a cached prefix: shared while it ran, its pages hung under the cached
    prefix and pinned it, so it preempted itself and started over forever."""
    config = small_config(
        num_pages=num_pages, max_model_len=8 * num_pages, max_num_batched_tokens=8
    )
    sched, stage = Scheduler(config), FakeStage(config)
    prompt = [(k * 5 + 3) % VOCAB for k in range(8 * num_pages - 4)]
    sched.add_request("cached", prompt[:12], SamplingParams(max_tokens=1))
    drive(sched, stage)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request("whole", prompt, params, use_prefix_cache=False)
    out = drive(sched, stage, max_steps=200)["whole"]
    assert out.output_token_ids == reference(prompt, params)[0] and out.num_cached_tokens == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_the_next_turn_of_a_conversation_runs_in_a_pool_its_cached_turns_fill(depth):
    """Each turn of a conversation leaves a snapshot on one cached path. A longer turn that
    matches its end locks the path; in a window pool at its minimum the snapshots before the
    match held the window pages its chunks need, and it preempted itself, or waited with
    nothing running, for ever. They are reclaimed now: it runs to its reference tokens."""
    config = small_config(num_window_pages=7, num_cached_state_slots=6)
    assert config.num_window_pages == config.min_window_pages
    sched, stage = Scheduler(config), FakeStage(config)
    conversation = [(7 * k + 3) % VOCAB for k in range(90)]
    for i, length in enumerate((17, 25, 33)):
        sched.add_request(f"turn {i}", conversation[:length], SamplingParams(max_tokens=1))
        drive(sched, stage, depth=depth)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched.add_request("long", conversation, params)
    out = drive(sched, stage, depth=depth, max_steps=100)["long"]
    assert out.output_token_ids == reference(conversation, params)[0]
    assert out.num_cached_tokens == 32


def test_abort_and_finish_release_everything_and_tell_the_stages():
    sched = Scheduler(small_config())
    stage = FakeStage(sched.config)
    sched.add_request("run", list(range(10)), SamplingParams(max_tokens=50))
    sched.add_request("stop", list(range(5)), SamplingParams(max_tokens=50))
    plan = sched.schedule()
    sched.commit(plan, stage.run(plan))
    sched.add_request("wait", [1])
    assert sched.abort("wait").finish_reason == "abort"
    assert sched.abort("run").finish_reason == "abort"
    assert sched.finish("stop", "stop").finish_reason == "stop"
    assert sched.abort("nobody") is None
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("x", "eos")
    plan = sched.schedule()
    assert sorted(plan.finished_ids) == ["run", "stop"] and plan.batch == []
    stage.run(plan)
    sched.commit(plan, {})
    assert not sched.has_unfinished() and sched.schedule() is None
    stats = sched.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]
    window_pages = stats["num_free_window_pages"] + stats["num_cached_window_pages"]
    assert window_pages == stats["num_window_pages"]
    sched.check_integrity()


def test_two_plans_in_flight_give_the_same_tokens():
    config = small_config(num_state_slots=4)
    sched = Scheduler(config)
    prompts = {f"r{i}": [(3 * i + k) % VOCAB for k in range(6 + 9 * i)] for i in range(5)}
    for name, prompt in prompts.items():
        sched.add_request(name, prompt, SamplingParams(max_tokens=15))
    finished = drive(sched, depth=2)
    for name, prompt in prompts.items():
        assert (
            finished[name].output_token_ids == reference(prompt, SamplingParams(max_tokens=15))[0]
        )


def test_real_page_sizes_with_a_long_shared_prefix():
    config = SchedulerConfig(
        num_pages=24,
        num_window_pages=24,
        num_state_slots=4,
        num_cached_state_slots=8,
        max_model_len=2048,
    )
    sched, stage = Scheduler(config), FakeStage(config)
    shared = [k % VOCAB for k in range(700)]
    sched.add_request("a", shared + [1, 2], SamplingParams(max_tokens=3))
    first = drive(sched, stage)
    sched.add_request("b", shared + [3], SamplingParams(max_tokens=3))
    second = drive(sched, stage)
    assert (
        first["a"].output_token_ids == reference(shared + [1, 2], SamplingParams(max_tokens=3))[0]
    )
    assert second["b"].output_token_ids == reference(shared + [3], SamplingParams(max_tokens=3))[0]
    assert second["b"].num_cached_tokens == 512


_actions = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "abort", "finish"]),
        st.integers(0, 3),  # which shared prefix / which request
        st.integers(1, 40),  # suffix length
        st.integers(1, 12),  # max_tokens
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(actions=_actions, depth=st.integers(1, 2), lookahead=st.booleans())
def test_random_workloads_conserve_ids_and_match_the_reference(actions, depth, lookahead):
    # lookahead: with two plans in flight, decodes get their next token scheduled early
    config = small_config(num_pages=14, num_state_slots=3, num_cached_state_slots=4,
                          lookahead=lookahead)  # fmt: skip
    sched, stage = Scheduler(config), FakeStage(config)
    prefixes = [[p] * 8 + [p + 1] * 8 for p in range(4)]
    prompts, ended, in_flight, finished, streamed = {}, set(), deque(), {}, {}
    for i, (action, which, length, max_tokens) in enumerate(actions):
        live = sorted(set(prompts) - ended - set(finished))
        if action == "add":
            prompt = prefixes[which] + [(i + k) % VOCAB for k in range(length)]
            prompts[f"r{i}"] = (prompt, SamplingParams(max_tokens=max_tokens))
            sched.add_request(f"r{i}", prompt, prompts[f"r{i}"][1])
        elif action in ("abort", "finish") and live:
            req_id = live[which % len(live)]
            done = sched.abort(req_id) if action == "abort" else sched.finish(req_id)
            assert done.finish_reason == ("abort" if action == "abort" else "stop")
            ended.add(req_id)
        elif action == "step":
            _step(sched, stage, in_flight, depth, finished, streamed)
        sched.check_integrity()
    while in_flight:
        commit_and_check(sched, stage, in_flight.popleft(), finished, streamed)
    finished.update(drive(sched, stage, depth=depth, streamed=streamed))
    for req_id, (prompt, params) in prompts.items():
        if req_id not in ended:
            assert finished[req_id].output_token_ids == reference(prompt, params)[0]
            assert streamed[req_id] == finished[req_id].output_token_ids


def _step(sched, stage, in_flight, depth, finished, streamed):
    """Schedule one more plan if there is room, run the oldest when the pipeline is full."""
    plan = sched.schedule() if len(in_flight) < depth else None
    if plan is not None:
        check_plan(sched.config, plan)
        in_flight.append(plan)
    if in_flight and (len(in_flight) == depth or plan is None):
        commit_and_check(sched, stage, in_flight.popleft(), finished, streamed)


def test_a_request_preempted_while_in_flight_streams_no_token_of_that_step():
    # two plans in flight: "new" is admitted while "old" decodes; when "old" next needs a page
    # the pool is short, so "new" is preempted and the token its in-flight step samples is dropped
    config = small_config(num_pages=4, max_model_len=32, enable_prefix_caching=False)
    sched, stage = Scheduler(config), FakeStage(config)
    sched.add_request("old", list(range(15)), SamplingParams(max_tokens=4))
    sched.commit(first := sched.schedule(), stage.run(first))
    decode = sched.schedule()  # "old" writes position 15, the last of its 2 pages
    sched.add_request("new", list(range(20, 36)), SamplingParams(max_tokens=4))
    in_flight = sched.schedule()  # "new" takes the 2 other pages and samples
    assert [e.req_id for e in in_flight.batch] == ["new"]
    sched.commit(decode, stage.run(decode))
    preempting = sched.schedule()  # "old" needs a third page while "new" is in flight
    assert preempting.preempted_ids == ["new"]
    outcome = sched.commit(in_flight, stage.run(in_flight))
    assert "new" not in outcome.tokens and sched.get_request("new").output_token_ids == []
    sched.check_integrity()


def test_lookahead_schedules_decodes_early_and_keeps_outputs_and_ids_right():
    config = small_config(lookahead=True)
    sched, stage = Scheduler(config), FakeStage(config)
    prompts = {f"r{i}": [(3 * i + k) % VOCAB for k in range(5 + 7 * i)] for i in range(3)}
    params = {"r0": SamplingParams(max_tokens=9), "r1": SamplingParams(max_tokens=2),
              "r2": SamplingParams(max_tokens=20, stop_token_ids=[5])}  # fmt: skip
    for req_id, prompt in prompts.items():
        sched.add_request(req_id, prompt, params[req_id])
    finished = drive(sched, stage, depth=2)
    assert sched.lookahead_steps > 0
    for req_id, prompt in prompts.items():
        out, reason = reference(prompt, params[req_id])
        assert (finished[req_id].output_token_ids, finished[req_id].finish_reason) == (out, reason)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_micro_batches_split_the_running_decodes_between_the_plans_in_flight(micro_batches):
    config = small_config(micro_batches=micro_batches, num_state_slots=6, num_pages=32,
                          num_window_pages=30, max_model_len=64)  # fmt: skip
    sched, stage = Scheduler(config), FakeStage(config)
    prompts = {f"r{i}": [(5 * i + k) % VOCAB for k in range(3 + i)] for i in range(6)}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for req_id, prompt in prompts.items():
        sched.add_request(req_id, prompt, params)
    sizes, in_flight, finished = [], deque(), {}
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < micro_batches and (plan := sched.schedule()) is not None:
            check_plan(config, plan)
            batch_ids = {e.req_id for e in plan.batch}
            for other in in_flight:  # micro-batches in flight never share a request
                assert not batch_ids & {e.req_id for e in other.batch}
            if all(e.num_tokens == 1 for e in plan.batch):
                sizes.append(len(plan.batch))
            in_flight.append(plan)
        commit_and_check(sched, stage, in_flight.popleft(), finished, {})
    # 6 running decodes: each plan takes its share, never the whole batch
    assert sizes and max(sizes) == -(-6 // micro_batches)
    for req_id, prompt in prompts.items():
        assert finished[req_id].output_token_ids == reference(prompt, params)[0]

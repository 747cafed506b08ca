"""Host-tier prefix cache bookkeeping: pages survive device eviction on the host and come back
intact (checked by a fake stage that moves tokens between device and host), for every write
policy; the host allocators conserve their ids under random workloads."""

import copy
import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ray.cache.hicache import WRITE_POLICIES
from dsv4ray.cache.radix import EvictResult
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.scheduler import Scheduler
from tests.unit.scheduler_harness import (
    FakeStage,
    commit_and_check,
    drive,
    reference,
    small_config,
)
from tests.unit.test_radix import scan_evict


def _config(policy, **kw):
    values = dict(
        num_pages=8,
        num_window_pages=12,
        num_host_pages=24,
        num_host_snapshots=8,
        hicache_write_policy=policy,
        max_model_len=64,
    )
    values.update(kw)
    return small_config(**values)


def _run_rounds(sched, stage, prompts, params):
    """Each prompt runs alone, in order, so the device pool must evict between rounds."""
    results = []
    for i, prompt in enumerate(prompts):
        sched.add_request(f"r{i}", prompt, params)
        results.append(drive(sched, stage)[f"r{i}"])
    return results


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_evicted_prefix_comes_back_from_the_host(policy):
    sched = Scheduler(_config(policy))
    stage = FakeStage(sched.config)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    a, b, c = ([k] * 30 for k in (3, 5, 7))  # 30 tokens: 3 pages of 8 + a partial page
    # selective backs a prefix up at its second hit: a runs three times before b and c evict it
    prompts = [a, b, a, c, a, b] if policy != "write_through_selective" else [a, a, a, b, c, a]
    results = _run_rounds(sched, stage, prompts, params)
    for prompt, done in zip(prompts, results):
        assert (done.output_token_ids, done.finish_reason) == reference(prompt, params)
    assert sum(d.num_host_cached_tokens for d in results) > 0
    assert all(d.num_host_cached_tokens <= d.num_cached_tokens for d in results)
    sched.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_short_prefixes_come_back_though_host_snapshots_are_few(policy):
    """Prefixes of one page each with host snapshots for two: a prefix's snapshot is kept when
    it leaves the device (resident prefixes give theirs up first), so the most recently
    evicted prefixes come back from the host whatever the write policy."""
    sched = Scheduler(_config(policy, num_host_snapshots=2))
    stage = FakeStage(sched.config)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = [3] * 10  # one page of 8 and a partial page
    prompts = [a] + [[10 + i] * 10 for i in range(7)] + [a]  # the device holds fewer
    results = _run_rounds(sched, stage, prompts, params)
    for prompt, done in zip(prompts, results):
        assert (done.output_token_ids, done.finish_reason) == reference(prompt, params)
    assert results[-1].num_host_cached_tokens == 8
    sched.check_integrity()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), policy=st.sampled_from(WRITE_POLICIES), host=st.integers(2, 12))
def test_random_workloads_conserve_host_ids(seed, policy, host):
    rng = random.Random(seed)
    sched = Scheduler(_config(policy, num_host_pages=host, num_host_snapshots=max(1, host // 3)))
    stage = FakeStage(sched.config)
    bases = [[rng.randrange(37) for _ in range(40)] for _ in range(3)]
    expected = {}
    for i in range(8):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(9, 40)] + [rng.randrange(37)]
        params = SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True)
        sched.add_request(f"q{i}", prompt, params)
        expected[f"q{i}"] = reference(prompt, params)
        if rng.random() < 0.5:
            for req_id, done in drive(sched, stage, depth=rng.choice([1, 2])).items():
                assert (done.output_token_ids, done.finish_reason) == expected.pop(req_id)
    for req_id, done in drive(sched, stage).items():
        assert (done.output_token_ids, done.finish_reason) == expected.pop(req_id)
    sched.check_integrity()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), policy=st.sampled_from(WRITE_POLICIES), host=st.integers(2, 12))
def test_evictions_follow_their_definition(seed, policy, host):
    """Every device and host eviction under random workloads leaves what a walk over the whole
    index would: device copies go least recently used first among unlocked nodes without a
    device-resident child (backed up to the host as they go), host-only leaves least recently
    used first."""
    rng = random.Random(seed)
    sched = Scheduler(_config(policy, num_host_pages=host, num_host_snapshots=max(1, host // 3)))
    index, evictions = sched.kv.radix, []
    evict, evict_host = index.evict, index.evict_host

    def twin_of(index):
        twin = copy.deepcopy(index)
        del twin.evict, twin.evict_host  # the twin evicts by walking, through its own methods
        return twin

    def checked(*want):
        twin = twin_of(index)
        expected = scan_evict(twin, twin._device_evictable, twin._evict_device, want)
        got = evict(*want)
        assert got == expected
        assert _state(index) == _state(twin)
        evictions.append(got)
        return got

    def checked_host(*want):
        twin = twin_of(index)
        _scan_evict_host(twin, *want)
        evict_host(*want)
        assert _state(index) == _state(twin)
        evictions.append("host")

    index.evict, index.evict_host = checked, checked_host
    stage = FakeStage(sched.config)
    bases = [[rng.randrange(37) for _ in range(40)] for _ in range(3)]
    for i in range(8):
        # three prefixes of 24+ tokens each: more than the device's 8 pages hold together
        prompt = bases[i % 3][: rng.randrange(24, 40)] + [rng.randrange(37)]
        params = SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True)
        sched.add_request(f"q{i}", prompt, params)
        done = drive(sched, stage, depth=rng.choice([1, 2]))[f"q{i}"]
        assert (done.output_token_ids, done.finish_reason) == reference(prompt, params)
    sched.check_integrity()
    assert any(e != "host" and e.page_ids for e in evictions)


def _scan_evict_host(index, num_pages=0, num_snapshots=0, keep_host_only=False):
    """evict_host by its definition, over every node of the index."""

    def enough():
        pages_ok = index.host_pages.num_free >= num_pages
        return pages_ok and index.host_snapshots.num_free >= num_snapshots

    if index.host_snapshots.num_free < num_snapshots:
        index._free_resident(enough, pages=False)
    if keep_host_only:
        return
    heap = [(n.tick, n.serial, n) for n in index._iter_nodes() if index._host_evictable(n)]
    heapq.heapify(heap)
    while heap and not enough():
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        index._remove_subtree(node, EvictResult([], [], []))
        if index._host_evictable(parent):
            heapq.heappush(heap, (parent.tick, parent.serial, parent))
    index._free_resident(enough, pages=True)


def _state(index):
    """Each node's ids and the host allocators' free counts."""
    nodes = sorted(index._iter_nodes(), key=lambda n: n.serial)
    ids = [(n.serial, n.page_id, n.host_page, n.host_snapshot, n.snapshot) for n in nodes]
    return ids, index.host_pages.num_free, index.host_snapshots.num_free


def test_lost_stage_forgets_unconfirmed_backups_and_device_copies():
    sched = Scheduler(_config("write_through"))
    stage = FakeStage(sched.config)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [9] * 30
    _run_rounds(sched, stage, [prompt], params)
    radix = sched.kv.radix
    radix.drop_device_residency()
    sched.check_integrity()
    assert sched.kv.pages.num_free == sched.config.num_pages  # nothing on the device any more
    assert radix.host_held_ids()[0]  # the committed backups stay
    fresh = FakeStage(sched.config)  # a restarted stage: empty device memory, same host tier
    fresh.host_pages, fresh.host_snaps = stage.host_pages, stage.host_snaps
    again = _run_rounds(sched, fresh, [prompt], params)[0]
    assert again.output_token_ids == reference(prompt, params)[0]
    assert again.num_host_cached_tokens > 0


def test_lost_host_tier_drops_host_residency():
    sched = Scheduler(_config("write_through"))
    stage = FakeStage(sched.config)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    _run_rounds(sched, stage, [[4] * 30, [6] * 30, [8] * 30], params)
    sched.kv.radix.drop_host_residency()
    sched.check_integrity()
    assert sched.kv.radix.host_held_ids() == ([], [])
    done = _run_rounds(sched, stage, [[4] * 30], params)[0]
    assert done.output_token_ids == reference([4] * 30, params)[0]
    assert done.num_host_cached_tokens == 0


def test_host_tier_options_without_the_host_tier_are_refused_by_name(tiny_ckpt):
    from dsv4ray.engine.config import EngineConfig

    with pytest.raises(ValueError, match="host_cache_tokens is set but enable_hicache"):
        EngineConfig(tiny_ckpt, host_cache_tokens=4096)
    with pytest.raises(ValueError, match="hicache_write_policy='write_back' is set but enable_hi"):
        EngineConfig(tiny_ckpt, hicache_write_policy="write_back")
    EngineConfig(tiny_ckpt, hicache_write_policy="write_back", enable_hicache=True)


def test_a_step_abandoned_with_its_backups_is_forgotten_when_a_later_one_commits():
    """A caller interrupted while a step with host backups ran (the stage ran it; its commit
    never came) aborts its request: the next committed step confirms those backups and the
    scheduler tracks no step of it."""
    sched = Scheduler(_config("write_through"))
    stage = FakeStage(sched.config)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    sched.add_request("lost", [6] * 30, params)
    finished: dict = {}
    while (plan := sched.schedule()).host is None:  # steps until one carries backups
        commit_and_check(sched, stage, plan, finished, {})
    assert plan.host.backups and "lost" not in finished
    stage.run(plan)  # ...and its caller gives up before the commit
    sched.abort("lost")
    done = _run_rounds(sched, stage, [[8] * 30], params)[0]
    assert done.output_token_ids == reference([8] * 30, params)[0]
    assert not sched._in_flight and not sched.kv.radix._unconfirmed
    sched.check_integrity()

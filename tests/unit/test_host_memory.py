"""What the CPU pool check counts as available memory: MemAvailable, or a container's cgroup room
when that is less; a cgroup without a limit ("max") does not count."""

import pytest

from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.worker import pool_sizing


def _files(tmp_path, monkeypatch, available_kb: int, limit: str, usage: int) -> None:
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(f"{usage}\n")
    monkeypatch.setattr(pool_sizing, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(pool_sizing, "CGROUP_FILES",
                        ((str(tmp_path / "max"), str(tmp_path / "current")),))  # fmt: skip


def test_a_containers_limit_below_the_machines_memory_wins(tmp_path, monkeypatch):
    _files(tmp_path, monkeypatch, available_kb=8 * 2**20, limit=str(3 * 2**30), usage=2**30)
    assert pool_sizing.available_host_memory() == 2 * 2**30


def test_a_cgroup_without_a_limit_leaves_the_machines_memory(tmp_path, monkeypatch):
    _files(tmp_path, monkeypatch, available_kb=8 * 2**20, limit="max", usage=2**30)
    assert pool_sizing.available_host_memory() == 8 * 2**30


def _stage(node: str, start: int, end: int, need_gib: float, have_gib: float | None) -> dict:
    have = None if have_gib is None else int(have_gib * 2**30)
    return {"node": node, "start": start, "end": end, "need": int(need_gib * 2**30), "have": have}


SIZES = PoolSizes(num_pages=4096, num_window_pages=64, num_state_slots=65, num_cached_state_slots=0)


def test_stages_sharing_a_machine_are_refused_when_their_pools_only_fit_one_at_a_time():
    stages = [_stage("a", 0, 2, 6, 10), _stage("a", 2, 4, 6, 10)]
    match = (
        r"stages \[0, 2\), \[2, 4\) share one machine: .* 12\.0 GiB together, more than "
        r"the 10\.0 GiB .*\(4096 pages, 64 running"
    )
    with pytest.raises(ValueError, match=match):
        pool_sizing.check_shared_host_memory(stages, SIZES)


def test_stages_on_machines_of_their_own_or_fitting_together_pass():
    apart = [_stage("a", 0, 2, 6, 10), _stage("b", 2, 4, 6, 10)]
    together = [_stage("a", 0, 2, 4, 10), _stage("a", 2, 4, 5.5, 10)]
    unknown = [_stage("a", 0, 2, 6, None), _stage("a", 2, 4, 6, None)]
    for stages in (apart, together, unknown):
        pool_sizing.check_shared_host_memory(stages, SIZES)


def test_the_draft_layers_pools_count_with_the_stages_beside_it():
    draft = {"node": "a", "name": "the draft layer", "need": 2 * 2**30, "have": 9 * 2**30}
    stages = [_stage("a", 0, 2, 4, 10), _stage("a", 2, 4, 4, 10)]
    pool_sizing.check_shared_host_memory(stages, SIZES)  # 8 GiB of 9: they fit alone
    with pytest.raises(ValueError, match=r"\[0, 2\), \[2, 4\), the draft layer share .* 10\.0"):
        pool_sizing.check_shared_host_memory([*stages, draft], SIZES)


def test_the_least_memory_a_stage_of_the_machine_saw_is_what_they_share():
    # each stage measured the machine at its own moment: the lower figure is the safe one
    stages = [_stage("a", 0, 1, 3, 9), _stage("a", 1, 2, 3, 5), _stage("b", 2, 3, 1, 1)]
    with pytest.raises(ValueError, match=r"\[0, 1\), \[1, 2\) share .* 5\.0 GiB"):
        pool_sizing.check_shared_host_memory(stages, SIZES)


def test_a_worker_prices_exactly_the_pools_it_allocates(tiny_ckpt):
    """The memory checks price the CPU pools with the pad slot allocate adds: what they count is
    what the stages of a running engine hold."""
    from dsv4ray import LLM

    llm = LLM(tiny_ckpt, use_ray=False, pp_size=2, max_total_tokens=4096)
    try:
        pipe = llm.core.pipeline
        sizes = pool_sizing.pool_sizes(pipe.capacity, llm.core.config.ring_scale)
        for worker in pipe.workers:
            assert worker.host_pool_bytes(sizes) == worker.pools.nbytes() > 0
    finally:
        llm.shutdown()


def test_the_draft_worker_prices_exactly_the_pools_it_allocates(tiny_ckpt):
    from dsv4ray import LLM

    llm = LLM(tiny_ckpt, use_ray=False, speculative_num_steps=2, max_total_tokens=4096)
    try:
        pipe = llm.core.pipeline
        sizes = pool_sizing.pool_sizes(pipe.capacity, llm.core.config.ring_scale)
        assert pipe.draft.host_pool_bytes(sizes) == pipe.draft.pools.nbytes() > 0
    finally:
        llm.shutdown()

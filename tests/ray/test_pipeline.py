"""Pipeline-parallel stages, as Ray actors over a compiled graph or in this process, give the
reference's tokens: plain steps, overlap scheduling with lookahead tokens handed from the last
stage back to the first, fixed-shape buckets on every stage; and a pipeline that cannot be
placed says why."""

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from dsv4ray import LLM, SamplingParams
from dsv4ray.cluster.placement import wait_for_placement
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


def test_pp_1_2_3_give_identical_greedy_tokens(ray_session, tiny_ckpt, tiny_model, idle_cpu_s):
    prompts = _prompts([3, 130, 300], seed=0)
    expected = [reference_greedy(tiny_model, p, 5) for p in prompts]
    # the 300-token prompt's logprobs come back from the last stage actor with its prefill
    ref = torch.log_softmax(tiny_model(torch.tensor([prompts[2]]))[0], dim=-1)
    want = [ref[i - 1, prompts[2][i]].item() for i in range(1, len(prompts[2]))]
    params = [GREEDY, GREEDY, dataclasses.replace(GREEDY, prompt_logprobs=0)]
    for pp in (1, 2, 3):
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=pp, use_ray=True)
        try:
            assert len(llm.core.pipeline.actors) == pp
            wall, cpu = time.monotonic(), time.process_time()
            outs = llm.generate(prompts, params)
            wall, cpu = time.monotonic() - wall, time.process_time() - cpu
            idle = idle_cpu_s(llm.core.pipeline.actors, 1.0)
        finally:
            llm.shutdown()
        assert [o.token_ids for o in outs] == expected, pp
        # the driver sleeps while the stages compute: a read of the graph's output that spins
        # (Ray's own) keeps a core busy for the whole run, taking it from the stages
        assert cpu < 0.5 * wall, (pp, cpu, wall)
        assert max(idle) < 0.3, (pp, idle)  # and so does each stage actor between steps
        got = [entries[0][1] for entries in outs[2].prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, pp


def test_top_k_crosses_the_stage_boundary(ray_session, tmp_path):
    # C4 layers 1, 3, 4; at pp 2 the second stage [3, 6) starts with layer 3, which shares
    path = make_tiny(
        str(tmp_path), "tiny", seed=2, index_topk_pattern=["compute", "share", "compute"]
    )
    model = load_reference(path, torch.float32)
    assert model.cfg.layers[3].skip_topk and not model.cfg.layers[4].skip_topk
    prompts = _prompts([280, 40], seed=1)
    llm = LLM(path, kv_cache_dtype="fp32", pp_size=2)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    assert got == [reference_greedy(model, p, 5) for p in prompts]


def test_a_stuck_stage_ends_its_request_after_the_step_timeout_and_is_replaced(
    ray_session, tiny_ckpt, tiny_model, monkeypatch
):
    """A stage that stops answering (SIGSTOP) fails the step after execution_timeout_s; the
    next request rebuilds the pipeline, whose fresh actors take longer to start than that step
    timeout (startup has its own bound), and gets the reference tokens."""
    from dsv4ray.cluster import pipeline

    monkeypatch.setattr(pipeline, "EXIT_TIMEOUT_S", 2.0)  # the stuck actor is killed sooner
    timeout_s = 3.0
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2, execution_timeout_s=timeout_s)
    stuck = llm.core.pipeline.dag.local_pids[-1]
    prompt = _prompts([30], seed=8)[0]
    try:
        os.kill(stuck, signal.SIGSTOP)
        t0 = time.monotonic()
        out = llm.generate([prompt], GREEDY)[0]
        assert out.finish_reason == "abort" and "stage" in out.error
        assert timeout_s <= time.monotonic() - t0 < timeout_s + 15
        again = llm.generate([prompt], GREEDY)[0]
        assert again.error is None and again.token_ids == reference_greedy(tiny_model, prompt, 5)
        assert llm.core.num_rebuilds == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck, signal.SIGCONT)
        llm.shutdown()


@pytest.mark.parametrize("name", ["pp_size", "prefill_pp_size"])
def test_pp_larger_than_layers_is_a_clear_error(ray_session, tiny_ckpt, name):
    """Refused by the option's own name before any actor starts."""
    with pytest.raises(ValueError, match=rf"^{name} 7 is more than the model's 6 layers"):
        LLM(tiny_ckpt, **{name: 7})


@pytest.fixture(scope="module")
def hash_ckpt(tmp_path_factory):
    """Hash-routed experts in layers 0-2: at pp 3 the second stage [2, 4) routes by the token
    ids the first stage filled in on the device."""
    path = make_tiny(str(tmp_path_factory.mktemp("hash3")), "tiny", seed=3, num_hash_layers=3)
    return path, load_reference(path, torch.float32)


def _static_buckets(llm, max_batch: int) -> None:
    """Every stage replays its decode steps in fixed-shape buckets: eagerly on CPU, the same
    layouts, inputs and hand-over that CUDA graphs replay."""
    pipe = llm.core.pipeline
    if hasattr(pipe, "actors"):
        ray.get([a.capture_graphs.remote(max_batch, 4096, 0, False) for a in pipe.actors])
    else:
        for worker in pipe.workers:
            worker.capture_graphs(max_batch, 4096, 0, capture=False)


@pytest.mark.parametrize("pp,use_ray", [(2, False), (3, False), (1, True), (3, True)])
def test_overlap_and_stage_buckets_on_both_transports_equal_the_reference(
    ray_session, hash_ckpt, pp, use_ray
):
    path, model = hash_ckpt
    prompts = _prompts([3, 130, 300, 254, 17, 60], seed=5)
    # the batch shrinks 6 -> 5 -> 4 -> 3 -> 2 -> 1 while decoding: buckets of 8 and 4 rows
    # hold steps of fewer requests (pad rows, fewer sampled rows than the bucket)
    max_tokens = [9, 4, 7, 12, 3, 5]
    llm = LLM(path, kv_cache_dtype="fp32", pp_size=pp, use_ray=use_ray, overlap_scheduling=True,
              max_running_requests=6, max_model_len=4096)  # fmt: skip
    try:
        assert llm.core.pipeline.depth == (max(2, pp) if use_ray else 2)
        _static_buckets(llm, 8)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate(prompts, params)
        stats = llm.core.pipeline.stage_stats()
        lookahead = llm.core.scheduler.lookahead_steps
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    assert [o.token_ids for o in outs] == expected
    assert lookahead > 0
    assert stats[0]["num_graph_steps"] > 0
    assert stats == [stats[0]] * pp  # every stage ran each step the same way


@pytest.mark.parametrize(
    "mode",
    [
        dict(overlap_scheduling=True),  # lookahead entries; samples go back to the first stage
        dict(pp_micro_batches=3),  # more micro-batches than stages: the last stage lags alone
    ],
    ids=["lookahead", "micro-batches"],
)
def test_lagged_pipelines_of_stage_actors_stop_abort_and_preempt_like_plain_decoding(
    ray_session, tiny_ckpt, tiny_model, mode
):
    # small pools: four long requests preempt each other while their lagged steps run
    prompts = _prompts([200, 230, 250, 180], seed=6)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2, max_total_tokens=768,
              max_num_batched_tokens=256, **mode)  # fmt: skip
    assert llm.core.pipeline.lag
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(tiny_model, prompt, 24)
        assert llm.core.stats()["num_preemptions"] > 0
        # a stop token in the middle of the lookahead, and an abort while two steps run
        want = reference_greedy(tiny_model, prompts[0][:20], 12)
        stop = SamplingParams(max_tokens=12, stop_token_ids=[want[3]])
        out = llm.generate([prompts[0][:20]], stop)[0]
        assert out.token_ids == want[: want.index(want[3]) + 1]
        core = llm.core
        core.add_request("abort-0", prompts[1][:50], SamplingParams(max_tokens=10))
        core.add_request("abort-1", prompts[2][:60], SamplingParams(max_tokens=10, ignore_eos=True))
        for _ in range(3):
            core.step()
        assert core.abort("abort-0") is not None
        core.run_until_done({"abort-1"})
        assert core.pop_output("abort-1").token_ids == reference_greedy(
            tiny_model, prompts[2][:60], 10
        )
        core.pop_output("abort-0")
        # plans run one at a time, as a GPU engine's warm-up runs them: each is collected
        # before the next (the lagged result comes with a flush), the last has no batch
        core.add_request("one-0", prompts[3][:30], SamplingParams(max_tokens=3, ignore_eos=True))
        core.add_request("one-1", prompts[3][:9], SamplingParams(max_tokens=1, ignore_eos=True))
        while (plan := core.scheduler.schedule()) is not None:
            core.run_plan(plan)
        assert core.pop_output("one-0").token_ids == reference_greedy(
            tiny_model, prompts[3][:30], 3
        )
        core.pop_output("one-1")
        core.check_integrity()
        stats = core.stats()
        assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]
    finally:
        llm.shutdown()


def test_a_pipeline_no_node_can_hold_fails_at_once_saying_what_it_asked(ray_session, tiny_ckpt):
    bundles = [{"CPU": 0.5, "accelerator_nowhere": 1}] * 2
    pg = placement_group(bundles, strategy="PACK")
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match="cannot be placed: 2 bundles .*accelerator_nowhere"):
            wait_for_placement(pg, bundles, timeout_s=60)
    finally:
        remove_placement_group(pg)
    assert time.perf_counter() - t0 < 5
    # GPU stages on a cluster without GPUs, through LLM(...): refused before any actor starts
    with pytest.raises(ValueError, match=r"no node has \{'GPU': 1"):
        LLM(tiny_ckpt, pp_size=2, device="cuda")


def test_a_build_that_fails_says_which_timeout_and_gives_back_what_it_took(
    ray_session, tiny_ckpt, tiny_model
):
    # stage actors cannot import torch and load weights within a second: the build fails, names
    # the option to raise, and leaves no placement group behind (each failure kept one, and a
    # few of them left no CPU for the next engine)
    def groups() -> int:
        return sum(pg["state"] != "REMOVED" for pg in ray.util.placement_group_table().values())

    before = groups()
    with pytest.raises(TimeoutError, match="startup_timeout_s=1 s"):
        LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2, use_ray=True, startup_timeout_s=1.0)
    assert groups() == before
    # then one that starts in time, from a URI: the driver and each stage actor resolve it into
    # their machine's cache
    llm = LLM("file://" + os.path.abspath(tiny_ckpt), kv_cache_dtype="fp32", pp_size=2)
    try:
        assert llm.core.config.model_source.startswith("file://")
        prompt = _prompts([40], seed=5)[0]
        got = llm.generate([prompt], GREEDY)[0].token_ids
    finally:
        llm.shutdown()
    assert got == reference_greedy(tiny_model, prompt, 5)


def test_a_pipeline_waiting_for_busy_resources_gives_up_saying_what_is_free(ray_session):
    # the head node's own resource (1.0, which no other test asks for): a holder takes 0.9, so
    # two stages of 0.1 each can be placed some day, not now
    key = "node:__internal_head__"
    hold = placement_group([{key: 0.9}])
    ray.get(hold.ready(), timeout=60)
    bundles = [{"CPU": 0.5, key: 0.1}] * 2
    pg = placement_group(bundles, strategy="PACK")
    try:
        t0 = time.perf_counter()
        said = r"waits 2 s for 2 bundles .*'node:__internal_head__': 0.1\} free"
        with pytest.raises(ValueError, match=said):
            wait_for_placement(pg, bundles, timeout_s=2)
        assert time.perf_counter() - t0 < 10
    finally:
        remove_placement_group(pg)
        remove_placement_group(hold)


IDLE_KILLS = 2  # stages killed between requests (each stage once), each replaced before the next


@pytest.fixture(scope="module")
def async_pp2(ray_session, tiny_ckpt):
    """One pp 2 AsyncEngine for the two tests that kill its stages, the last of this file (idle
    stages poll their channels: kept beside other tests they would cost more than a build).
    Each kill is followed by a rebuild that the test verifies with the reference's tokens."""
    engine = AsyncEngine(tiny_ckpt, kv_cache_dtype="fp32", pp_size=2)
    yield engine
    engine.shutdown()


async def _answer(engine: AsyncEngine, prompt: list[int]):
    async for update in engine.generate(prompt, GREEDY):
        if update.output is not None:
            return update.output


def test_killed_stage_aborts_requests_and_the_pipeline_recovers(async_pp2, tiny_model):
    engine = async_pp2

    async def killed_midway():
        outputs, count = [], 0
        async for update in engine.generate(
            [0, 5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)
        ):
            count += 1
            if count == 3:
                ray.kill(engine.core.pipeline.actors[1], no_restart=True)
            outputs.append(update)
        return outputs[-1].output

    out = asyncio.run(killed_midway())
    assert out.finish_reason == "abort"
    assert "stage" in out.error and len(out.token_ids) < 400
    prompt = _prompts([50], seed=3)[0]
    again = asyncio.run(_answer(engine, prompt))
    assert again.finish_reason == "length"
    assert again.token_ids == reference_greedy(tiny_model, prompt, 5)


def test_stages_killed_while_idle_are_replaced_before_the_next_request(
    async_pp2, tiny_model, monkeypatch
):
    """A stage that dies between requests is found by the idle engine's ping and the pipeline
    rebuilt before the next request arrives: no request fails for it, tokens stay exact, and
    the stats call answers throughout."""
    from dsv4ray.entrypoints import async_engine

    monkeypatch.setattr(async_engine, "LIVENESS_S", 1.0)  # the check's period (5 s by default)
    engine = async_pp2
    prompt = _prompts([40], seed=5)[0]
    rebuilds = asyncio.run(engine.stats())["num_pipeline_rebuilds"]  # by earlier tests
    for kill in range(IDLE_KILLS):  # the first stage, then the second, and so on
        ray.kill(engine.core.pipeline.actors[kill % 2], no_restart=True)
        deadline = time.monotonic() + 60
        while asyncio.run(engine.stats())["num_pipeline_rebuilds"] <= rebuilds + kill:
            assert time.monotonic() < deadline, "the dead stage was not replaced"
            time.sleep(0.5)
        out = asyncio.run(_answer(engine, prompt))
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == reference_greedy(tiny_model, prompt, 5)


@ray.remote(num_cpus=0)
class _TorchActor:
    """Exits as slowly as a stage actor does: torch's teardown runs after Ray reports it dead."""

    def where(self) -> tuple:
        torch.ones(2).sum()
        return ray.get_runtime_context().get_node_id(), os.getpid()


def test_stopped_gpu_stage_processes_are_gone_before_the_next_pools_are_sized(ray_session):
    # a GPU stage's memory is free again only when its process has exited, which happens up to
    # seconds after Ray reports the actor dead: the teardown waits for the processes, so that the
    # next engine (or a rebuild) sizes its pools from memory that is really free
    from dsv4ray.actors.processes import process_running
    from dsv4ray.cluster.pipeline import _await_exits, _end_processes_task, _stop_actors

    actors = [_TorchActor.remote() for _ in range(2)]
    processes = ray.get([a.where.remote() for a in actors])
    _stop_actors(actors)
    _await_exits(processes)
    assert not any(process_running(pid) for _, pid in processes), processes
    # on another node the wait runs in a task pinned there (here: this node, by hand)
    actor = _TorchActor.remote()
    node, pid = ray.get(actor.where.remote())
    _stop_actors([actor])
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False)
    task = _end_processes_task.options(scheduling_strategy=strategy)
    assert ray.get(task.remote([pid], 10.0), timeout=60) == []
    assert not process_running(pid)

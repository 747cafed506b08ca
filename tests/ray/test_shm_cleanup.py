"""Graph builds and teardowns, pipeline rebuilds, stages killed while running or while a
rebuild runs, and shutdowns leave no files in /dev/shm.

Each compiled graph's shared-memory channel has two semaphore files,
``/dev/shm/sem.{obj,hdr}<raylet pid>-<ns>``; Ray removes them only when a process that used
the channel exits cleanly, so graphs torn down while their actors lived on, and stage actors
killed, used to leave them behind (12 files per pp 2 graph). Host tier regions are
``/dev/shm/dsv4ray-<pipeline key>-s<stage>``. Only files of this session's Ray node and of this
test's pipelines are counted: other Ray instances on the machine may come and go meanwhile.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import ray

from dsv4ray import LLM, SamplingParams
from dsv4ray.cluster import pipeline as ray_pipeline
from dsv4ray.cluster import stage_graph
from dsv4ray.cluster.channel_files import mapped_by_any_process
from dsv4ray.cluster.stage_graph import StageGraph
from tests.ray.shm_files import ShmFiles

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
NUM_CYCLES = 5  # each cycle asserts that its own teardown left no file behind


@ray.remote(num_cpus=0.5)
class _Stage:
    """A stage with a pipeline stage's graph methods and no model: builds cost no weights."""

    def first(self, x: int) -> int:
        return x + 1

    def prepare(self, x: int) -> int:
        return x

    def receive(self, prev: int) -> int:
        return prev

    def next(self, x: int, prev: int) -> int:
        return prev + 1


def test_repeated_graph_builds_and_teardowns_leave_no_files(ray_session):
    shm = ShmFiles()
    baseline = shm.now()
    actors = [_Stage.remote(), _Stage.remote()]  # pp 2; they outlive every graph
    try:
        for cycle in range(NUM_CYCLES):
            graph = StageGraph(actors, depth=2, timeout_s=60, warmup=0)
            assert ray.get(graph.execute(cycle)) == cycle + 2
            assert len(graph.channel_files) >= 8  # both stages' channels and the driver's
            graph.teardown()
            assert shm.now() - baseline == set(), cycle
    finally:
        ray.wait([a.__ray_terminate__.remote() for a in actors], num_returns=2, timeout=30)
    assert shm.settle(0, baseline) == set()


def test_a_teardown_waiting_on_a_live_stage_ends_and_leaves_no_files(ray_session, monkeypatch):
    # Ray's teardown of a graph with a dead stage has been seen to wait for the live one's
    # loop until that stage died too (minutes later, at the next kill); here it does so always
    shm = ShmFiles()
    baseline = shm.now()
    actors = [_Stage.remote(), _Stage.remote()]
    graph = StageGraph(actors, depth=2, timeout_s=60, warmup=0)
    ray.kill(actors[0], no_restart=True)
    raw_teardown, ended = graph.dag.teardown, threading.Event()

    def teardown_until_the_live_stage_dies():
        while True:
            try:
                ray.get(actors[1].__ray_ready__.remote(), timeout=30)
            except Exception:  # dead: Ray's wait would end now
                raw_teardown()
                ended.set()
                return
            time.sleep(0.1)

    monkeypatch.setattr(graph.dag, "teardown", teardown_until_the_live_stage_dies)
    monkeypatch.setattr(stage_graph, "TEARDOWN_TIMEOUT_S", 1.0)
    start = time.monotonic()
    graph.teardown()
    assert ended.is_set() and time.monotonic() - start < 10
    assert shm.settle(0, baseline) == set()


def test_stages_killed_while_serving_and_while_rebuilding_leave_no_files(
    ray_session, tiny_ckpt, monkeypatch
):
    shm = ShmFiles()
    baseline = shm.now()
    llm = LLM(
        tiny_ckpt, pp_size=2, kv_cache_dtype="fp32", enable_hicache=True, max_total_tokens=1024
    )
    shm.track(llm)
    kills = []

    def graph_of_a_stage_killed_meanwhile(actors, *args, **kwargs):
        if not kills:  # the first rebuild: a stage dies between its start and its graph
            kills.append(actors[1])
            ray.kill(actors[1], no_restart=True)
        return StageGraph(actors, *args, **kwargs)

    try:
        llm.generate([[5, 6, 7]], GREEDY)
        live = shm.now() - baseline
        num_sems = sum(name.startswith("sem.") for name in live)
        assert num_sems >= 4 and len(live) == num_sems + 2, live  # channels + 2 stage regions
        monkeypatch.setattr(ray_pipeline, "StageGraph", graph_of_a_stage_killed_meanwhile)
        ray.kill(llm.core.pipeline.actors[-1], no_restart=True)  # it cannot clean up after itself
        assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "abort"
        refused = llm.generate([[5, 6, 8]], GREEDY)[0]
        assert kills and "could not be restarted" in refused.error
        assert llm.generate([[5, 6, 9]], GREEDY)[0].finish_reason == "length"
        assert len(shm.settle(len(live), baseline)) == len(live)
    finally:
        llm.shutdown()
    assert shm.settle(0, baseline) == set()


def test_a_dead_middle_stage_and_shutdown_leave_no_files(ray_session, tiny_ckpt):
    shm = ShmFiles()
    baseline = shm.now()
    llm = LLM(tiny_ckpt, pp_size=3, kv_cache_dtype="fp32")
    shm.track(llm)
    try:
        llm.generate([[5, 6, 7]], GREEDY)
        live = len(shm.now() - baseline)
        ray.kill(llm.core.pipeline.actors[1], no_restart=True)
        assert llm.generate([[5, 6, 7]], GREEDY)[0].finish_reason == "abort"
        assert llm.generate([[5, 6, 8]], GREEDY)[0].finish_reason == "length"
        assert len(shm.settle(live, baseline)) == live
    finally:
        llm.shutdown()
    assert shm.settle(0, baseline) == set()


KILLED_DRIVER = textwrap.dedent("""
    import json, os, sys, time, ray
    from dsv4ray.cluster import stage_graph
    from dsv4ray.cluster.stage_graph import StageGraph

    @ray.remote(num_cpus=0.5)
    class Stage:
        def pid(self): return os.getpid()
        def first(self, x): return x + 1 if isinstance(x, int) else x
        def prepare(self, x): return x
        def receive(self, prev): return prev
        def next(self, x, prev): return prev + 1 if isinstance(prev, int) else prev

    ray.init(address=os.environ["RAY_ADDRESS"])
    actors = [Stage.remote(), Stage.remote()]
    pids = ray.get([a.pid.remote() for a in actors])
    grow = sys.argv[1:] == ["grow"]
    if grow:  # every read looks for grown channels
        stage_graph.LEDGER_REFRESH_S = 0.0
    graph = StageGraph(actors, depth=2, timeout_s=60, warmup=0, local_pids=pids)
    built = list(graph.channel_files)
    if grow:  # a message larger than the channels' buffers
        graph.get(graph.execute(b"x" * (8 << 20)), 60)
    with open(graph.ledger) as f:
        ledger = json.load(f)
    print(json.dumps({"files": built, "ledger": graph.ledger, "recorded": ledger, "pids": pids}))
    time.sleep(600)
""")


def _killed_driver(ray_session, *args) -> dict:
    """Runs KILLED_DRIVER, kills it with SIGKILL once it built its graph -> what it printed."""
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, *args], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        return json.loads(driver.stdout.readline())
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)


def _unmapped(files: list[str]) -> None:
    deadline = time.monotonic() + 60  # Ray ends the dead driver's actors
    while mapped_by_any_process() & set(files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not mapped_by_any_process() & set(files)


def _left_alone(files, ledger: str) -> bool:
    """Whether the dead driver's files are all there, or were removed by a sweep: a graph that
    another test builds meanwhile sweeps them and then drops their ledger, so files gone while
    the ledger stands were removed by something else."""
    present = all(os.path.exists(f) for f in files)
    return present or not os.path.exists(ledger)


def test_the_next_build_removes_the_files_of_a_killed_drivers_graph(ray_session):
    """A replica or driver killed outright (SIGKILL) never tears its graph down, and the raylet
    lives on: the next graph built on the machine removes its files once its actors are gone,
    and leaves the files of live graphs alone."""
    built = _killed_driver(ray_session)
    files = built["files"]
    assert len(files) >= 8 and os.path.exists(built["ledger"])
    _unmapped(files)
    assert _left_alone(files, built["ledger"])  # nobody removed them: Ray leaves them
    actors = [_Stage.remote(), _Stage.remote()]
    try:
        graph = StageGraph(actors, depth=2, timeout_s=60, warmup=0)  # the next build
        assert not any(os.path.exists(f) for f in files)
        assert not os.path.exists(built["ledger"])
        assert ray.get(graph.execute(5)) == 7
        assert all(os.path.exists(f) for f in graph.channel_files)  # its own stay
        ledger = graph.ledger
        graph.teardown()
        assert not os.path.exists(ledger)
    finally:
        ray.wait([a.__ray_terminate__.remote() for a in actors], num_returns=2, timeout=30)


def test_channels_a_killed_drivers_graph_grew_are_in_its_ledger(ray_session):
    """A message larger than a channel's buffer grows the channel into new files while the
    graph runs; the running graph adds them to its ledger, so the next build removes them too
    when the driver is killed."""
    built = _killed_driver(ray_session, "grow")
    grown = set(built["recorded"]) - set(built["files"])
    assert grown and set(built["files"]) <= set(built["recorded"])
    _unmapped(built["recorded"])
    assert _left_alone(grown, built["ledger"])
    actors = [_Stage.remote(), _Stage.remote()]
    try:
        graph = StageGraph(actors, depth=2, timeout_s=60, warmup=0)  # the next build
        assert not any(os.path.exists(f) for f in built["recorded"])
        graph.teardown()
    finally:
        ray.wait([a.__ray_terminate__.remote() for a in actors], num_returns=2, timeout=30)

"""One local Ray per test worker (the tests in tests/ray that run on a worker share it); the Serve
app on it."""

import os
import socket
import time

import pytest


@pytest.fixture(scope="session")
def ray_session(request):
    import ray

    # Ray's log monitor globs the logs folder every 0.1 s until it holds 1000 files; the suite
    # starts hundreds of workers, each with its log files: every 0.5 s is enough for tests (its
    # own default past that count). Heads the tests start inherit it.
    os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
    # Each node's dashboard agent reads every worker's process stats (psutil) every 5 s for
    # Ray's node metrics, which no test reads: once a minute. The dsv4ray series the tests
    # scrape are pushed by the workers themselves, on their own interval.
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
    if not ray.is_initialized():
        # logical CPUs: pipelines of 0.5-CPU stages, a Serve replica and the proxy share 2 cores
        options = dict(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        ray.init(**options)
        request.config.local_ray_options = options  # tests/conftest.py stops it after tests/ray
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def free_port():
    """free_port() -> a TCP port on 127.0.0.1 that nothing listens on now."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="session")
def idle_cpu_s():
    """idle_cpu_s(actors, seconds) -> CPU seconds each actor's process used while the caller
    slept `seconds` (actors on this machine; a pipeline between steps)."""

    def used(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def measure(actors, seconds: float) -> list[float]:
        import ray

        pids = [ray.get(actor.ready.remote())["pid"] for actor in actors]
        before = [used(pid) for pid in pids]
        time.sleep(seconds)
        return [used(pid) - b for pid, b in zip(pids, before)]

    return measure


@pytest.fixture(scope="session")
def start_server(ray_session, free_port):
    """start_server(ckpt, **config) -> base URL: the dsv4ray Serve app (``build_app(config)``)
    on the shared Ray at 127.0.0.1:<free port>; the caller shuts Serve down."""
    from ray import serve

    from dsv4ray.entrypoints.serve import APP_NAME, build_app

    def start(ckpt: str, **config) -> str:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": ckpt, **config}), name=APP_NAME, route_prefix="/")
        return f"http://127.0.0.1:{port}"

    return start

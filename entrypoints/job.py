"""``dsv4ray job``: batch generation over a JSONL file on Ray Data (the ``ray job submit``
entrypoint).

Ray Data streams the input (local or any URI pyarrow reads) through one read task that checks
each line (bad ones are reported with their line number and skipped) and marks the ids whose
last output line finished; a pool of ``--replicas`` actors, each owning one engine
(entrypoints/job_replica.py), runs the rest, and the driver appends each finished request to the
output as its block comes back. The driver holds no input row: its memory stays flat however
long the input (it keeps the ids of an earlier run's output, to resume). An output line is
``{"id", "text", "token_ids", "finish_reason", "metrics"}`` (+ ``"error"`` for aborted ones;
+ ``"content"`` and ``"tool_calls"`` for chat lines with tools). The output is
append-only and keyed by id: the last line of an id wins, and a rerun with the same output
skips finished ids and retries the others (last line with finish_reason "abort" or an "error",
or a line cut short).

SIGINT (Ctrl-C) and SIGTERM (what ``ray job stop`` sends first) stop the job: requests whose
lines were not written are left for a rerun, the summary says how many input lines were not
done, and the replicas (with their engines) go down with the driver.

Exit codes: 0 every request finished; 1 some input line was bad or some request was aborted;
2 usage error (no input file or checkpoint, no folder for the output, an invalid option);
130 interrupted by SIGINT; 143 stopped by SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import ray

from dsv4ray.actors.processes import process_alive
from dsv4ray.cluster.placement import (
    DEVICES,
    check_accelerator,
    declared_node_types,
    ensure_ray,
    resolve_accelerator,
    stage_bundle,
    started_local_ray,
    stop_local_ray,
    unplaceable,
)
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.job_input import (
    JobLines,
    JobStats,
    is_uri,
    job_rows,
    last_results,
    open_output,
    report_bad,
    scan_input,
    usage_problem,
)
from dsv4ray.entrypoints.stop_signals import (
    TERMINATED,
    by_sigterm,
    restore_sigterm,
    signals_held,
    sigterm_interrupts,
    stop_asked,
)

log = logging.getLogger("dsv4ray.job")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
REPLICA_CPUS = 0.5  # the actor drives its engine; the stages have bundles of their own
# reading lines is light; with Ray Data's default of a whole CPU the read task of a pp 2 job on
# a 2-core machine would wait for ever behind the replica and its stages' bundles
READ_CPUS = 0.25
REPLICA_EXIT_S = 30.0  # how long the driver waits for the replicas to shut their engines down
MAX_CHUNK_ROWS = 128  # output lines come back a chunk at a time
# chunks a replica runs at once: its engine batches their lines together, and a chunk whose
# lines finish early is written while a slower one still runs
CHUNKS_PER_REPLICA = 2


@dataclass(frozen=True)
class JobOptions:
    replicas: int = 1
    accelerator: str = "auto"
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        check_accelerator(self.accelerator)
        for name in ("replicas", "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def run_job(
    model: str, input_path: str, output_path: str, job: JobOptions | None = None, **options
) -> int:
    """Runs the job; returns its exit code (EXIT_*). Usage errors return before Ray starts."""
    job = job or JobOptions()
    joined = bool(os.environ.get("RAY_ADDRESS"))
    problem, config = usage_problem(model, input_path, output_path, joined), None
    if problem is None and options.get("use_ray", True) not in ("auto", True):
        problem = (f"use_ray={options['use_ray']!r}: a job's engines always run as Ray actors "
                   "(its replica pool on Ray Data); leave --use-ray out")  # fmt: skip
    if problem is None:
        try:
            config = EngineConfig.build(model, check_model=False, **{**options, "use_ray": True})
        except (ValueError, TypeError) as exc:
            problem = str(exc)
    if problem is not None:
        return usage_error(problem)
    if options.get("speculative_num_steps"):
        print(f"dsv4ray job: {describe(options['speculative_num_steps'])}", file=sys.stderr)
    stats, started_ray, shortfall = JobStats(), False, None
    start = time.perf_counter()
    TERMINATED.clear()
    previous = sigterm_interrupts()
    try:
        prior = last_results(output_path)
        stats.lines, runs = scan_input(input_path, prior, job.default_max_tokens)
        if runs:
            started_ray = not joined and not ray.is_initialized()
            # a local Ray is this machine: its view decides the device before Ray starts
            device = _device(job, options) if started_ray else None
            cpus = _local_cpus(job, config, device) if started_ray else None
            ensure_ray(cpus)
            sigterm_interrupts()  # again: starting Ray installs its own SIGTERM handler
            if started_ray and not started_local_ray():  # it joined a `ray start` here
                device = None  # that cluster's view decides, as for any joined cluster
            elif cpus is not None:
                _say_shared_cores(job, config, device, cpus)
            engine = {**options, "use_ray": True, "device": device or _device(job, options)}
            shortfall = _shortfall(job, config, engine["device"])
            if shortfall is None:
                where = input_path if is_uri(input_path) else os.path.abspath(input_path)
                source = JobLines(where, prior, job.default_max_tokens,
                                  _rows_per_chunk(stats.lines, job.replicas))  # fmt: skip
                pids = _run(source, model, engine, job, input_path, output_path, stats)
                _wait_for_exit(pids, REPLICA_EXIT_S)
        else:  # every line finished before (or is bad): nothing to run, nothing to start
            for row in job_rows(input_path, prior, job.default_max_tokens):
                _account(None, stats, input_path, row["line"], row["kind"], "", row["problem"], "")
    except (KeyboardInterrupt, SystemExit) as exc:
        if not stop_asked(exc):
            raise
        _stopped(stats, by_sigterm(exc))
    finally:
        with _signals_noted(stats, previous):  # the cleanup runs to its end
            # not a `ray start` on this machine, which ray.init joins by itself (a signal may
            # have cut the start short anywhere after that)
            if started_ray and not (ray.is_initialized() and not started_local_ray()):
                stop_local_ray()
    if shortfall is not None:
        return usage_error(shortfall)
    _summary(stats, time.perf_counter() - start)
    if stats.interrupted:
        return EXIT_TERMINATED if stats.terminated else EXIT_INTERRUPTED
    return EXIT_FAILED if stats.failed or stats.bad_lines else EXIT_OK


def _job_bundles(job: JobOptions, config: EngineConfig, device: str) -> list[dict]:
    """What the job holds at once: the read task, each replica and its stages' bundles."""
    stages = config.pp_size + config.prefill_pp_size
    stage = stage_bundle(device == "cuda", num_gpus=config.num_gpus_per_stage)
    replica = [{"CPU": REPLICA_CPUS}] + [stage] * stages
    return [{"CPU": READ_CPUS}] + replica * job.replicas


def _local_cpus(job: JobOptions, config: EngineConfig, device: str) -> int:
    """Logical CPUs for the local Ray this job starts: the machine's cores, or what the read
    task, the replicas and their stages' bundles ask for when that is more (two replicas on a
    2-core machine would otherwise hold every CPU, and the read task would wait for ever)."""
    return max(os.cpu_count() or 1, math.ceil(_cpus_asked(job, config, device)))


def _cpus_asked(job: JobOptions, config: EngineConfig, device: str) -> float:
    return sum(bundle.get("CPU", 0.0) for bundle in _job_bundles(job, config, device))


def _say_shared_cores(job: JobOptions, config: EngineConfig, device: str, cpus: int) -> None:
    """A local Ray given more logical CPUs than the machine's cores (``_local_cpus``) is said."""
    need, cores = _cpus_asked(job, config, device), os.cpu_count() or 1
    if cpus > cores:
        print(f"dsv4ray job: the read task, {job.replicas} replicas and their stages ask for "
              f"{need:g} CPUs; the local Ray gets {cpus} on this {cores}-core machine, and "
              "they share its cores", file=sys.stderr)  # fmt: skip


def _shortfall(job: JobOptions, config: EngineConfig, device: str) -> str | None:
    """Why the cluster can never run the job (the read task waits until every replica holds
    its resources, so a job larger than the cluster would wait for ever), or None; a cluster
    with an autoscaler may add nodes and is given the chance."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    problem = unplaceable(_job_bundles(job, config, device), nodes)
    if not problem or declared_node_types():
        return None
    one = _job_bundles(dataclasses.replace(job, replicas=1), config, device)
    stages = len(one) - 2
    replica = f"{REPLICA_CPUS} CPU and {stages} stage bundle{'s' * (stages > 1)} of {one[2]}"
    alone = unplaceable(one, nodes)
    if alone:  # even one replica: fewer would not help
        return (f"the read task ({READ_CPUS} CPU) and a replica ({replica}) cannot run: {alone}, "
                "and no autoscaler can add nodes; check --accelerator and --pp")  # fmt: skip
    return (f"the read task ({READ_CPUS} CPU) and {job.replicas} replicas (each {replica}) "
            f"cannot run at once: {problem}, and no autoscaler can add nodes; use fewer "
            "--replicas")  # fmt: skip


def _rows_per_chunk(num_lines: int, replicas: int) -> int:
    """Chunks small enough that every replica gets work from a short input."""
    return max(1, min(MAX_CHUNK_ROWS, math.ceil(num_lines / (4 * replicas))))


def usage_error(message: str) -> int:
    print(f"dsv4ray job: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _device(job: JobOptions, options: dict) -> str:
    """The stages' device, decided here (the driver may run on a head without GPUs, and the
    replicas hold none themselves); an explicit --device wins."""
    return options.get("device") or DEVICES[resolve_accelerator(job.accelerator)]


def _run(source, model, engine, job, input_path, output_path, stats) -> None:
    """Ray Data: the input lines in blocks from ``source`` (JobLines), a pool of
    ``job.replicas`` JobReplica actors, and each block's results appended to the output as it
    arrives."""
    import ray.data
    from tqdm import tqdm

    from dsv4ray.entrypoints.job_replica import JobReplica

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job's own bar counts input lines
    # every replica builds its engine (stage actors, weights, graphs) before the first block
    context.wait_for_min_actors_s = int(engine.get("startup_timeout_s",
                                                   EngineConfig.startup_timeout_s))  # fmt: skip
    with warnings.catch_warnings():  # ray_remote_args is the one way to pin it to a node
        warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
        read = ray.data.read_datasource(
            source, num_cpus=READ_CPUS, ray_remote_args=_read_on(source.path)
        )
    results = read.map_batches(
        JobReplica,
        fn_constructor_kwargs={"model": model, "options": engine},
        batch_size=1,  # one chunk of up to rows_per_chunk lines a call
        compute=ray.data.ActorPoolStrategy(
            size=job.replicas,
            max_tasks_in_flight_per_actor=CHUNKS_PER_REPLICA,
            max_concurrent_calls_per_actor=CHUNKS_PER_REPLICA,  # else one call at a time
        ),
        num_cpus=REPLICA_CPUS,
    )
    blocks = results.iter_batches(batch_size=None, batch_format="numpy")
    pids: set[int] = set()
    here = ray.util.get_node_ip_address()  # replica pids of other nodes mean nothing here
    with (
        open_output(output_path) as out,
        tqdm(total=stats.lines, desc="lines", unit="line", file=sys.stderr) as bar,
    ):
        for block in blocks:
            for row in zip(block["line"], block["kind"], block["result"], block["problem"],
                           block["replica"]):  # fmt: skip
                _account(out, stats, input_path, *row)
                bar.update(1)
            pids.update(int(p) for p, r in zip(block["pid"], block["replica"])
                        if str(r).split("/", 1)[0] == here)  # fmt: skip
    return pids


def _wait_for_exit(pids: set[int], timeout_s: float) -> None:
    """Waits until the replica processes of this node exit: once the pool is done they shut
    their engines down (host-tier regions and channel files go with them), which a Ray shut
    down at once, or this process exiting, would cut short."""
    deadline = time.monotonic() + timeout_s
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _read_on(path: str) -> dict:
    """Where the read task runs: a local input on this node (its path means nothing on the
    others), a URI anywhere."""
    if is_uri(path):
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def _account(out, stats: JobStats, input_path: str, line_no, kind, result, problem, replica):
    """One input line back from the pool: its output line written, or counted."""
    stats.seen += 1
    if kind == "done":
        stats.skipped += 1
        return
    stats.retried += kind == "retry"
    if problem:
        report_bad(stats, input_path, int(line_no), str(problem))
    else:
        _write(out, str(result), str(replica), stats)


def _write(out, line: str, replica: str, stats: JobStats) -> None:
    out.write(line + "\n")
    out.flush()
    row = json.loads(line)
    num_tokens = len(row["token_ids"])
    stats.done += 1
    stats.tokens += num_tokens
    stats.failed += row["finish_reason"] == "abort"
    counts = stats.by_replica.setdefault(replica, [0, 0])
    counts[0] += 1
    counts[1] += num_tokens
    if row["metrics"].get("ttft_s") is not None:
        stats.add_ttft(row["metrics"]["ttft_s"])


def _stopped(stats: JobStats, terminated: bool) -> None:
    stats.interrupted, stats.terminated = True, stats.terminated or terminated
    stats.left = stats.lines - stats.seen if stats.lines else None


@contextlib.contextmanager
def _signals_noted(stats: JobStats, previous_sigterm):
    """While the job shuts down (its replicas, a local Ray: seconds), SIGINT and SIGTERM are
    noted instead of cutting the cleanup short (a raylet's files would stay in /dev/shm, and no
    summary); then SIGTERM's handler from before the job is back."""
    try:
        with signals_held() as noted:
            yield
    finally:
        restore_sigterm(previous_sigterm)
        if noted:
            _stopped(stats, signal.SIGTERM in noted)


def _summary(stats: JobStats, seconds: float) -> None:
    pct = stats.ttft_percentile
    head = "dsv4ray job: "
    how = "stopped by SIGTERM" if stats.terminated else "interrupted"
    if stats.interrupted and stats.left is None:
        head += f"{how} while reading the input; "
    elif stats.interrupted:
        head += f"{how}, {stats.left} input lines not reached (a rerun does the unfinished); "
    ttft = (f"TTFT p50 {pct(0.5):.3f} s p99 {pct(0.99):.3f} s" if stats.ttft_buckets
            else "no first token timed")  # fmt: skip
    print(
        f"{head}{stats.done} requests ({stats.failed} failed, {stats.bad_lines} bad lines, "
        f"{stats.skipped} already done, {stats.retried} retried), "
        f"{stats.tokens / max(seconds, 1e-9):.1f} tokens/s, {ttft}",
        file=sys.stderr,
    )
    for name, (num_requests, num_tokens) in sorted(stats.by_replica.items()):
        print(
            f"dsv4ray job: replica {name}: {num_requests} requests, {num_tokens} tokens",
            file=sys.stderr,
        )

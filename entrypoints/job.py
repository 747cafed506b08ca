"""``dsv4ray job``: batch generation over a JSONL file on Ray Data (the ``ray job submit``
entrypoint).

The driver reads the input (local or any URI pyarrow reads), checks each line (bad ones are
reported with their line number and skipped) and leaves out the ids whose last output line
finished. Ray Data runs the rest through a pool of ``--replicas`` actors, each owning one engine
(entrypoints/job_replica.py), and the driver appends each finished request to the output as its
block comes back: ``{"id", "text", "token_ids", "finish_reason", "metrics"}`` (+ ``"error"`` for
aborted ones; + ``"content"`` and ``"tool_calls"`` for chat lines with tools). The output is
append-only and keyed by id: the last line of an id wins, and a rerun with the same output
skips finished ids and retries the others (last line with finish_reason "abort" or an "error",
or a line cut short).

SIGINT (Ctrl-C) and SIGTERM (what ``ray job stop`` sends first) stop the job: requests whose
lines were not written are left for a rerun, the summary says how many, and the replicas (with
their engines) go down with the driver.

Exit codes: 0 every request finished; 1 some input line was bad or some request was aborted;
2 usage error (no input file or checkpoint, no folder for the output, an invalid option);
130 interrupted by SIGINT; 143 stopped by SIGTERM.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import ray

from dsv4ray.cluster.channel_files import sweep_dead_raylets
from dsv4ray.cluster.placement import DEVICES, check_accelerator, ensure_ray, resolve_accelerator
from dsv4ray.engine.config import EngineConfig
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.job_input import (
    JobStats,
    last_results,
    open_output,
    read_requests,
    report_bad,
    usage_problem,
)

log = logging.getLogger("dsv4ray.job")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
REPLICA_CPUS = 0.5  # the actor drives its engine; the stages have bundles of their own
BATCH_SIZE = 16  # requests per map_batches call; Ray Data keeps 4 calls in flight per block
MAX_BLOCK_ROWS = 256  # output lines come back a block at a time


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
    problem = usage_problem(model, input_path, output_path, joined)
    if problem is None:
        try:
            EngineConfig.build(model, check_model=False, **{**options, "use_ray": True})
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        return usage_error(problem)
    if options.get("speculative_num_steps"):
        print(f"dsv4ray job: {describe(options['speculative_num_steps'])}", file=sys.stderr)
    stats, rows, started_ray = JobStats(), None, False
    start = time.perf_counter()
    _TERMINATED.clear()
    previous = _raise_on_sigterm()
    try:
        rows = read_requests(input_path, last_results(output_path), stats, job.default_max_tokens)
        if rows:
            started_ray = not joined and not ray.is_initialized()
            ensure_ray()
            _raise_on_sigterm()  # again: starting Ray installs its own SIGTERM handler
            engine = {**options, "use_ray": True, "device": _device(job, options)}
            _run(rows, model, engine, job, input_path, output_path, stats)
    except KeyboardInterrupt:
        stats.interrupted, stats.terminated = True, _TERMINATED.is_set()
        stats.left = len(rows) - stats.returned if rows is not None else None
    finally:
        _restore_sigterm(previous)
        if started_ray:  # the local Ray this call started, and then its leftover files
            ray.shutdown()
            sweep_dead_raylets()
    _summary(stats, time.perf_counter() - start)
    if stats.interrupted:
        return EXIT_TERMINATED if stats.terminated else EXIT_INTERRUPTED
    return EXIT_FAILED if stats.failed or stats.bad_lines else EXIT_OK


def usage_error(message: str) -> int:
    print(f"dsv4ray job: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _device(job: JobOptions, options: dict) -> str:
    """The stages' device, decided here (the driver may run on a head without GPUs, and the
    replicas hold none themselves); an explicit --device wins."""
    return options.get("device") or DEVICES[resolve_accelerator(job.accelerator)]


def _run(rows, model, engine, job, input_path, output_path, stats) -> None:
    """Ray Data: the rows in blocks, a pool of ``job.replicas`` JobReplica actors, and each
    block's results appended to the output as it arrives."""
    import ray.data
    from tqdm import tqdm

    from dsv4ray.entrypoints.job_replica import JobReplica

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job's own bar counts requests
    context.wait_for_min_actors_s = int(engine.get("execution_timeout_s", 600))  # all replicas
    rows_per_block = max(1, min(MAX_BLOCK_ROWS, math.ceil(len(rows) / (4 * job.replicas))))
    dataset = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / rows_per_block))
    results = dataset.map_batches(
        JobReplica,
        fn_constructor_kwargs={"model": model, "options": engine},
        batch_size=min(BATCH_SIZE, rows_per_block),
        compute=ray.data.ActorPoolStrategy(size=job.replicas, max_tasks_in_flight_per_actor=2),
        num_cpus=REPLICA_CPUS,
    )
    blocks = results.iter_batches(batch_size=None, batch_format="numpy")
    with (
        open_output(output_path) as out,
        tqdm(total=len(rows), desc="requests", unit="req", file=sys.stderr) as bar,
    ):
        for block in blocks:
            for line_no, result, problem, replica in zip(
                block["line"], block["result"], block["problem"], block["replica"]
            ):
                if problem:
                    report_bad(stats, input_path, int(line_no), str(problem))
                else:
                    _write(out, str(result), str(replica), stats)
                stats.returned += 1
                bar.update(1)


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
        stats.ttfts.append(row["metrics"]["ttft_s"])


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the job stops as on SIGINT. A KeyboardInterrupt because Ray turns one
    that lands inside its blocking calls back into a KeyboardInterrupt (any other exception
    raised there comes out as a logged SystemError); ``_TERMINATED`` tells the two apart."""


_TERMINATED = threading.Event()


def _on_sigterm(signum, frame) -> None:
    _TERMINATED.set()
    raise Terminated


def _raise_on_sigterm():
    """Installs the SIGTERM handler; returns the one it replaced (None off the main thread,
    where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _summary(stats: JobStats, seconds: float) -> None:
    def pct(p: float) -> float:
        values = sorted(stats.ttfts)
        return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")

    head = "dsv4ray job: "
    how = "stopped by SIGTERM" if stats.terminated else "interrupted"
    if stats.interrupted and stats.left is None:
        head += f"{how} while reading the input; "
    elif stats.interrupted:
        head += f"{how}, {stats.left} requests left (a rerun does them); "
    print(
        f"{head}{stats.done} requests ({stats.failed} failed, {stats.bad_lines} bad lines, "
        f"{stats.skipped} already done, {stats.retried} retried), "
        f"{stats.tokens / max(seconds, 1e-9):.1f} tokens/s, "
        f"TTFT p50 {pct(0.5):.3f} s p99 {pct(0.99):.3f} s",
        file=sys.stderr,
    )
    for name, (num_requests, num_tokens) in sorted(stats.by_replica.items()):
        print(
            f"dsv4ray job: replica {name}: {num_requests} requests, {num_tokens} tokens",
            file=sys.stderr,
        )

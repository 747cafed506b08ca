"""``dsv4ray job``: the ``ray job submit`` entrypoint for batch generation over a JSONL file.

Input lines: ``{"id", "prompt" | "messages", "max_tokens", "temperature", "top_p", "top_k",
"seed", "stop", "stop_token_ids", "logprobs", "ignore_eos"}``. Bad input lines are reported with
their line number and skipped.

Output lines, appended as requests finish: ``{"id", "text", "token_ids", "finish_reason",
"metrics"}`` (+ ``"error"`` for aborted ones). The output file is append-only and keyed by id:
the last line of an id wins. A rerun with the same output skips ids whose last line finished
("length" or "stop") and retries the others (last line with finish_reason "abort" or an
"error", or a line cut short), appending their new lines.

SIGINT (Ctrl-C) and SIGTERM (what ``ray job stop`` sends first) stop submitting, abort the
requests that run (they get no output line, so a rerun does them), print the summary with the
number of requests left and shut the engine down.

Exit codes: 0 every request finished; 1 some input line was bad or some request was aborted;
2 usage error (no input file or checkpoint, no folder for the output, an invalid option);
130 interrupted by SIGINT; 143 stopped by SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dsv4ray.engine.core import EngineCore
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.engine.spec import describe
from dsv4ray.entrypoints.engines import build_engine_core, engine_config
from dsv4ray.model.tokenizer import Tokenizer

log = logging.getLogger("dsv4ray.job")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143

PARAM_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "ignore_eos",
)


@dataclass
class JobStats:
    done: int = 0
    failed: int = 0
    bad_lines: int = 0
    skipped: int = 0  # ids whose last output line finished
    retried: int = 0  # ids whose last output line was aborted, run again
    left: int | None = None  # requests not finished when interrupted (None: input not read)
    interrupted: bool = False
    terminated: bool = False  # the interrupt was SIGTERM
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


def read_requests(path: str, prior: dict, tokenizer, stats: JobStats, default_max_tokens: int):
    """Yields (id, prompt ids, SamplingParams) for good lines whose id has not finished.
    prior: id -> whether its last output line finished (``last_results``)."""
    seen = set()
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req_id, ids, params = _parse(line, tokenizer, default_max_tokens)
                if req_id in seen:
                    raise ValueError(f"duplicate id {req_id!r}")
            except (ValueError, TypeError) as exc:
                stats.bad_lines += 1
                print(f"dsv4ray job: {path}: line {line_no}: {exc}; skipped", file=sys.stderr)
                continue
            seen.add(req_id)
            if prior.get(req_id) is True:
                stats.skipped += 1
                continue
            stats.retried += req_id in prior
            yield req_id, ids, params


def _parse(line: str, tokenizer, default_max_tokens: int):
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError("a line must be a JSON object")
    req_id = item.get("id")
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ValueError("'id' must be a string or an integer")
    unknown = sorted(set(item) - {"id", "prompt", "messages", *PARAM_KEYS})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError("give exactly one of 'prompt' and 'messages'")
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise ValueError("'prompt' must be a string")
        ids = tokenizer.encode(item["prompt"])
    else:
        ids = tokenizer.encode_chat(_messages(item["messages"]))
    params = {k: item[k] for k in PARAM_KEYS if k in item}
    params.setdefault("max_tokens", default_max_tokens)
    return str(req_id), ids, SamplingParams(**params)


def _messages(messages) -> list[dict]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError("'messages' must be a non-empty list of {role, content} strings")
    return messages


def last_results(path: str) -> dict[str, bool]:
    """id -> whether the id's last line in the output finished (not aborted, no error)."""
    results: dict[str, bool] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    req_id = str(row["id"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by an interrupted run: its id is redone
                ok = row.get("finish_reason") not in (None, "abort") and not row.get("error")
                results[req_id] = ok
    return results


def usage_problem(model: str, input_path: str, output_path: str) -> str | None:
    """What makes the command unusable before any work starts, or None."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return f"no checkpoint at {model!r} (no config.json); pass --model /path/to/checkpoint"
    if not os.path.isfile(input_path):
        return f"no input file {input_path!r}"
    folder = os.path.dirname(os.path.abspath(output_path))
    if os.path.isdir(output_path) or not os.path.isdir(folder):
        return f"cannot write the output {output_path!r} (a folder, or its folder is missing)"
    return None


def usage_error(message: str) -> int:
    print(f"dsv4ray job: error: {message}", file=sys.stderr)
    return EXIT_USAGE


@dataclass
class _Work:
    """Requests not yet submitted (todo) and submitted but not finished (running)."""

    todo: deque
    running: set = field(default_factory=set)

    @property
    def left(self) -> int:
        return len(self.todo) + len(self.running)


def run_job(
    model: str,
    input_path: str,
    output_path: str,
    pp_size: int = 1,
    default_max_tokens: int = 16,
    **options,
) -> int:
    """Runs the job; returns its exit code (EXIT_*). Usage errors return before Ray starts."""
    problem = usage_problem(model, input_path, output_path)
    if problem is not None:
        return usage_error(problem)
    try:
        config = engine_config(model, pp_size=pp_size, use_ray=True, **options)
    except ValueError as exc:
        return usage_error(str(exc))
    stats, work, core = JobStats(), None, None
    start = time.perf_counter()
    previous = _raise_on_sigterm()
    try:
        prior = last_results(output_path)
        todo = read_requests(input_path, prior, Tokenizer(model), stats, default_max_tokens)
        work = _Work(deque(todo))
        core = build_engine_core(config)
        _raise_on_sigterm()  # again: starting Ray installs its own SIGTERM handler
        if config.speculative_num_steps:
            print(f"dsv4ray job: {describe(config.speculative_num_steps)}", file=sys.stderr)
        _run(core, work, output_path, stats, 2 * config.max_running_requests)
    except ValueError as exc:
        if core is not None:
            raise  # only the engine's construction reports bad options this way
        return usage_error(str(exc))
    except (KeyboardInterrupt, Terminated) as exc:
        stats.interrupted, stats.terminated = True, isinstance(exc, Terminated)
        stats.left = work.left if work is not None else None
    finally:
        if core is not None:
            _stop(core, stats.interrupted)
        _restore_sigterm(previous)
    _summary(stats, time.perf_counter() - start)
    if stats.interrupted:
        return EXIT_TERMINATED if stats.terminated else EXIT_INTERRUPTED
    return EXIT_FAILED if stats.failed or stats.bad_lines else EXIT_OK


def _run(core: EngineCore, work: _Work, output_path: str, stats: JobStats, max_queued: int):
    """Keeps up to max_queued requests in the engine (the rest wait in work.todo, so an
    interrupt stops submitting) and appends each finished one to the output."""
    from tqdm import tqdm

    with (
        _open_output(output_path) as out,
        tqdm(total=len(work.todo), desc="requests", unit="req", file=sys.stderr) as bar,
    ):
        while work.todo or work.running:
            while work.todo and len(work.running) < max_queued:
                req_id, ids, params = work.todo.popleft()
                if _submit(core, req_id, ids, params, stats):
                    work.running.add(req_id)
            for update in core.step():
                if update.output is not None and update.request_id in work.running:
                    work.running.discard(update.request_id)
                    _write(out, core.pop_output(update.request_id), stats)
                    bar.update(1)


def _open_output(path: str):
    """The output for appending; a last line cut short by a killed run is ended first, so the
    next line stays whole (the cut line does not parse, and its id is redone)."""
    if os.path.isfile(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with open(path, "a") as f:
                f.write("\n")
    return open(path, "a")


def _submit(core: EngineCore, req_id: str, ids: list[int], params, stats: JobStats) -> bool:
    try:
        core.add_request(req_id, ids, params)
    except ValueError as exc:
        stats.bad_lines += 1
        print(f"dsv4ray job: request {req_id!r}: {exc}; skipped", file=sys.stderr)
        return False
    return True


def _stop(core: EngineCore, interrupted: bool) -> None:
    """Aborts what still runs (after an interrupt) and shuts the engine down; a second
    SIGINT or SIGTERM meanwhile is ignored, as it would leave the stage actors behind."""
    with _signals_ignored():
        if interrupted:
            try:
                core.abort_all("the job was interrupted")
            except Exception as exc:  # an interrupt can land mid-step; shut down regardless
                log.warning("aborting the running requests: %s", exc)
        core.shutdown()


class Terminated(BaseException):
    """SIGTERM arrived: the job stops as on SIGINT (a BaseException, like KeyboardInterrupt,
    so that no ``except Exception`` on the way takes it for a failure)."""


def _on_sigterm(signum, frame) -> None:
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


@contextlib.contextmanager
def _signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change signal handlers
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write(out, result, stats: JobStats) -> None:
    row = {
        "id": result.request_id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "metrics": result.metrics.to_dict(),
    }
    if result.error:
        row["error"] = result.error
    out.write(json.dumps(row) + "\n")
    out.flush()
    stats.done += 1
    stats.tokens += len(result.token_ids)
    stats.failed += result.finish_reason == "abort"
    if result.metrics.ttft_s is not None:
        stats.ttfts.append(result.metrics.ttft_s)


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

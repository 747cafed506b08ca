"""``dsv4ray job``: the ``ray job submit`` entrypoint for batch generation over a JSONL file.

Input lines: ``{"id", "prompt" | "messages", "max_tokens", "temperature", "top_p", "top_k",
"seed", "stop", "stop_token_ids", "logprobs", "ignore_eos"}``. Output lines, appended as requests
finish: ``{"id", "text", "token_ids", "finish_reason", "metrics"}`` (+ ``"error"`` for aborted
ones). A rerun skips ids already in the output. Bad input lines are reported with their line
number and skipped. Exit code 1 when any line was bad or any request was aborted.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

from dsv4ray.engine.core import EngineCore
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.engines import build_engine_core, engine_config

log = logging.getLogger("dsv4ray.job")

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
    skipped: int = 0
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


def read_requests(path: str, done_ids: set, tokenizer, stats: JobStats, default_max_tokens: int):
    """Yields (id, prompt ids, SamplingParams) for good, not yet done lines."""
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
            if req_id in done_ids:
                stats.skipped += 1
                continue
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


def done_ids(path: str) -> set:
    ids = set()
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    ids.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line cut by an interrupted run is redone
    return ids


def run_job(
    model: str,
    input_path: str,
    output_path: str,
    pp_size: int = 1,
    default_max_tokens: int = 16,
    **options,
) -> int:
    from tqdm import tqdm

    if not os.path.isfile(input_path):
        raise SystemExit(f"dsv4ray job: no input file {input_path!r}")
    core = build_engine_core(engine_config(model, pp_size=pp_size, use_ray=True, **options))
    stats = JobStats()
    start = time.perf_counter()
    try:
        pending = _submit(
            core,
            read_requests(
                input_path, done_ids(output_path), core.tokenizer, stats, default_max_tokens
            ),
            stats,
        )
        with (
            open(output_path, "a") as out,
            tqdm(total=len(pending), desc="requests", unit="req", file=sys.stderr) as bar,
        ):
            while pending:
                for update in core.step():
                    if update.output is not None and update.request_id in pending:
                        pending.discard(update.request_id)
                        _write(out, core.pop_output(update.request_id), stats)
                        bar.update(1)
    finally:
        core.shutdown()
    _summary(stats, time.perf_counter() - start)
    return 1 if stats.failed or stats.bad_lines else 0


def _submit(core: EngineCore, requests, stats: JobStats) -> set:
    pending = set()
    for req_id, ids, params in requests:
        try:
            core.add_request(req_id, ids, params)
        except ValueError as exc:
            stats.bad_lines += 1
            print(f"dsv4ray job: request {req_id!r}: {exc}; skipped", file=sys.stderr)
            continue
        pending.add(req_id)
    return pending


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

    print(
        f"dsv4ray job: {stats.done} requests ({stats.failed} failed, {stats.bad_lines} bad "
        f"lines, {stats.skipped} already done), {stats.tokens / max(seconds, 1e-9):.1f} "
        f"tokens/s, TTFT p50 {pct(0.5):.3f} s p99 {pct(0.99):.3f} s",
        file=sys.stderr,
    )

"""The batch job's files: input lines checked with their line numbers, and the output's record
of which ids finished. Nothing here needs the checkpoint: prompts are tokenized by the replicas.

Input lines: ``{"id", "prompt" | "messages"}`` and any SamplingParams field (``max_tokens``,
``temperature``, ..., ``logit_bias`` with token ids as keys, ``structured_output``), or OpenAI's
``response_format`` for structured output; a ``messages`` line may carry OpenAI's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (entrypoints/tool_calls.py). The input is a local
path or a URI that pyarrow's filesystems read (``s3://``, ``gs://``, ``hdfs://``, ...; what Ray
Data reads). The output is a local, append-only JSONL file keyed by id: the last line of an id wins.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
from dataclasses import dataclass, field

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.tool_calls import ChatTools, constrained

PARAM_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))  # a line's sampling
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")  # a chat line's tools


@dataclass
class JobStats:
    done: int = 0
    failed: int = 0
    bad_lines: int = 0
    skipped: int = 0  # ids whose last output line finished
    retried: int = 0  # ids whose last output line was aborted, run again
    returned: int = 0  # requests the replicas gave back (an output line, or why not)
    left: int | None = None  # requests not finished when interrupted (None: input not read)
    interrupted: bool = False
    terminated: bool = False  # the interrupt was SIGTERM
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    by_replica: dict[str, list[int]] = field(default_factory=dict)  # name -> [requests, tokens]


def is_uri(path: str) -> bool:
    return "://" in path


def input_exists(path: str) -> bool:
    if not is_uri(path):
        return os.path.isfile(path)
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    return filesystem.get_file_info(inner).type == fs.FileType.File


def open_input(path: str):
    """A text stream over the input, local or remote."""
    if not is_uri(path):
        return open(path, encoding="utf-8")
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    return io.TextIOWrapper(filesystem.open_input_stream(inner), encoding="utf-8")


def read_requests(path: str, prior: dict, stats: JobStats, default_max_tokens: int) -> list[dict]:
    """Rows ``{"line", "id", "request"}`` (request: JSON of prompt or messages and sampling
    params) for good lines whose id has not finished; bad lines are reported and counted.
    prior: id -> whether its last output line finished (``last_results``)."""
    rows, seen = [], set()
    with open_input(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req_id, request = parse_line(line, default_max_tokens)
                if req_id in seen:
                    raise ValueError(f"duplicate id {req_id!r}")
            except (ValueError, TypeError) as exc:
                report_bad(stats, path, line_no, str(exc))
                continue
            seen.add(req_id)
            if prior.get(req_id) is True:
                stats.skipped += 1
                continue
            stats.retried += req_id in prior
            rows.append({"line": line_no, "id": req_id, "request": json.dumps(request)})
    return rows


def report_bad(stats: JobStats, path: str, line_no: int, problem: str) -> None:
    stats.bad_lines += 1
    print(f"dsv4ray job: {path}: line {line_no}: {problem}; skipped", file=sys.stderr)


def parse_line(line: str, default_max_tokens: int) -> tuple[str, dict]:
    """(id, {"prompt" | "messages", "params"}); ValueError saying what is wrong."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError("a line must be a JSON object")
    req_id = item.get("id")
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ValueError("'id' must be a string or an integer")
    unknown = sorted(set(item) - {"id", "prompt", "messages", "response_format", *TOOL_KEYS,
                                  *PARAM_KEYS})  # fmt: skip
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    tools = {k: item[k] for k in TOOL_KEYS if k in item}
    if tools and "messages" not in item:
        raise ValueError(f"'{next(iter(tools))}' needs 'messages' (tools are a chat's)")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError("give exactly one of 'prompt' and 'messages'")
    if "prompt" in item and not isinstance(item["prompt"], str):
        raise ValueError("'prompt' must be a string")
    if "messages" in item:
        check_messages(item["messages"])
    params = {k: item[k] for k in PARAM_KEYS if k in item}
    params.setdefault("max_tokens", default_max_tokens)
    if "response_format" in item:  # OpenAI's shape, as the chat API takes it
        params["structured_output"] = structured_output(item["response_format"])
    chat_tools = ChatTools.from_request(*(tools.get(k) for k in TOOL_KEYS))
    constrained(sampling_params(params), chat_tools, False, None)  # a bad value is named
    prompt = {k: item[k] for k in ("prompt", "messages") if k in item}
    return str(req_id), {**prompt, **tools, "params": params}


def structured_output(response_format) -> dict | None:
    """A line's OpenAI ``response_format`` as the engine's constraint (ValueError naming it)."""
    from pydantic import ValidationError

    from dsv4ray.entrypoints.openai.errors import APIError
    from dsv4ray.entrypoints.openai.protocol import ResponseFormat

    try:
        return ResponseFormat.model_validate(response_format).structured_output()
    except ValidationError as exc:
        raise ValueError(f"'response_format': {exc.errors()[0]['msg']}") from None
    except APIError as exc:
        raise ValueError(f"'response_format': {exc.message}") from None


def sampling_params(params: dict) -> SamplingParams:
    """A line's sampling fields as SamplingParams (logit_bias keys are JSON strings: ids)."""
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        if not all(isinstance(k, str) and k.isdigit() for k in bias):
            raise ValueError("logit_bias keys must be token ids")
        params = {**params, "logit_bias": {int(k): v for k, v in bias.items()}}
    return SamplingParams(**params)


def check_messages(messages) -> None:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or m.get("tool_calls") and m["content"] is None)
            for m in messages
        )
    ):
        raise ValueError("'messages' must be a non-empty list of {role, content} strings (content "
                         "may be null beside tool_calls)")  # fmt: skip


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


def open_output(path: str):
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


def usage_problem(model: str, input_path: str, output_path: str, joined: bool) -> str | None:
    """What makes the command unusable before any work starts, or None. On a cluster
    (``joined``) the checkpoint may live only on the nodes that run the replicas; a URI is
    fetched by each replica."""
    from dsv4ray.model.sources import is_remote

    joined = joined or is_remote(model)
    if not joined and not os.path.isfile(os.path.join(model, "config.json")):
        return f"no checkpoint at {model!r} (no config.json); pass --model /path/to/checkpoint"
    if not joined:
        from dsv4ray.model.checkpoint_check import check_checkpoint
        from dsv4ray.model.weights import CheckpointError

        try:
            check_checkpoint(model)
        except CheckpointError as exc:
            return f"bad checkpoint: {exc}"
    if not input_exists(input_path):
        return f"no input file {input_path!r}"
    folder = os.path.dirname(os.path.abspath(output_path))
    if is_uri(output_path) or os.path.isdir(output_path) or not os.path.isdir(folder):
        return (
            f"cannot write the output {output_path!r} (a folder, its folder is missing, or not "
            "a local path: the output is appended to as requests finish)"
        )
    return None

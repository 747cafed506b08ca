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
import math
import os
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from dsv4ray.engine.sampling import SamplingParams, check_text
from dsv4ray.entrypoints.tool_calls import ChatTools, constrained

PARAM_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))  # a line's sampling
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")  # a chat line's tools


TTFT_BUCKETS_PER_DECADE = 100  # the summary's TTFT percentiles are within 1.2%


@dataclass
class JobStats:
    lines: int = 0  # the input's non-empty lines
    seen: int = 0  # of them, those back from the replicas (with an output line, or why not)
    done: int = 0
    failed: int = 0
    bad_lines: int = 0
    skipped: int = 0  # ids whose last output line finished
    retried: int = 0  # ids whose last output line was aborted, run again
    left: int | None = None  # input lines not done when interrupted (None: input not read)
    interrupted: bool = False
    terminated: bool = False  # the interrupt was SIGTERM
    tokens: int = 0
    ttft_buckets: dict[int, int] = field(default_factory=dict)  # log-spaced bucket -> count
    by_replica: dict[str, list[int]] = field(default_factory=dict)  # name -> [requests, tokens]

    def add_ttft(self, seconds: float) -> None:
        """A histogram, not a list: the driver's memory stays flat however long the input."""
        bucket = round(TTFT_BUCKETS_PER_DECADE * math.log10(max(seconds, 1e-9)))
        self.ttft_buckets[bucket] = self.ttft_buckets.get(bucket, 0) + 1

    def ttft_percentile(self, p: float) -> float:
        total = sum(self.ttft_buckets.values())
        if not total:
            return float("nan")
        rank, below = min(total - 1, int(p * total)), 0
        for bucket in sorted(self.ttft_buckets):
            below += self.ttft_buckets[bucket]
            if below > rank:
                return 10 ** (bucket / TTFT_BUCKETS_PER_DECADE)
        raise AssertionError("unreachable: rank < total")


def is_uri(path: str) -> bool:
    return "://" in path


def input_exists(path: str) -> bool:
    if not is_uri(path):
        return os.path.isfile(path)
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    return filesystem.get_file_info(inner).type == fs.FileType.File


def open_input(path: str):
    """A binary stream over the input, local or remote: each line is decoded on its own
    (``line_text``), so that one line that is not UTF-8 is a bad line, not a failed job."""
    if not is_uri(path):
        return open(path, "rb")
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    return io.BufferedReader(filesystem.open_input_stream(inner))


def line_text(line: bytes) -> str:
    """A line of the input as text; ValueError naming the first byte that is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte 0x{line[exc.start]:02x} at column "
                         f"{exc.start + 1})") from None  # fmt: skip


def local_path(path: str) -> str | None:
    """The local file a path or a file:// URI names; None for other URIs."""
    if not is_uri(path):
        return path
    parsed = urllib.parse.urlparse(path)
    return urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else None


def job_rows(path: str, prior: dict, default_max_tokens: int) -> Iterator[dict]:
    """The input's non-empty lines in order as rows ``{"line", "id", "kind", "request",
    "problem"}``: kind "new" or "retry" (request: JSON of prompt or messages and sampling
    params), "done" (the id's last output line finished) or "bad" (problem says why).
    prior: id -> whether its last output line finished (``last_results``). Holds one line at a
    time, and the ids seen (a duplicate id is a bad line)."""
    seen: set[str] = set()
    with open_input(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = {"line": line_no, "id": "", "kind": "bad", "request": "", "problem": ""}
            try:
                req_id, request = parse_line(line_text(line), default_max_tokens)
                if req_id in seen:
                    raise ValueError(f"duplicate id {req_id!r}")
            except (ValueError, TypeError) as exc:
                yield {**row, "problem": str(exc)}
                continue
            seen.add(req_id)
            kind = "done" if finished(prior, req_id) else "retry" if req_id in prior else "new"
            request_json = json.dumps(request) if kind != "done" else ""
            yield {**row, "id": req_id, "kind": kind, "request": request_json}


def finished(prior: dict, req_id: str) -> bool:
    """Whether the id's last line in an earlier run's output finished (``last_results``)."""
    return prior.get(req_id) is True


def scan_input(path: str, prior: dict, default_max_tokens: int) -> tuple[int, bool]:
    """(the input's non-empty lines, whether any of them runs: a good line, not a duplicate,
    whose id has no finished output line). A pass that keeps the ids only up to the first line
    that runs: the progress bar's total, and no engine starts for a job whose lines all
    finished or are bad."""
    num_lines, runs, seen = 0, False, set()
    with open_input(path) as f:
        for line in f:
            if not line.strip():
                continue
            num_lines += 1
            if runs:
                continue
            try:
                req_id, _ = parse_line(line_text(line), default_max_tokens)
            except (ValueError, TypeError):
                continue  # a bad line: reported where the lines are checked
            runs = req_id not in seen and not finished(prior, req_id)
            seen.add(req_id)
    return num_lines, runs


class JobLines(Datasource):
    """The input as a Ray Data source: one read task streams the file in order (line numbers
    and duplicate ids need one reader) and checks each line where it runs. Each Ray Data row is
    a chunk: ``{"rows": JSON list of up to rows_per_chunk job_rows}``. Ray Data joins a read's
    small blocks into one of up to 128 MiB, splits that by rows and moves blocks between
    operators about one per scheduling round: rows of single lines would reach the pool slower
    than one replica runs them and leave the others idle. A chunk is the unit a replica takes,
    whatever Ray Data does with blocks."""

    def __init__(self, path: str, prior: dict, default_max_tokens: int, rows_per_chunk: int):
        super().__init__()
        self.path, self.prior = path, prior
        self.default_max_tokens, self.rows_per_chunk = default_max_tokens, rows_per_chunk

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
        metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ReadTask(self._blocks, metadata)]

    def _blocks(self) -> Iterator:
        import pyarrow as pa

        rows = []
        for row in job_rows(self.path, self.prior, self.default_max_tokens):
            rows.append(row)
            if len(rows) == self.rows_per_chunk:
                yield pa.table({"rows": [json.dumps(rows)]})
                rows = []
        if rows:
            yield pa.table({"rows": [json.dumps(rows)]})


def report_bad(stats: JobStats, path: str, line_no: int, problem: str) -> None:
    from tqdm import tqdm

    stats.bad_lines += 1
    # above the progress bar, not inside its line
    tqdm.write(f"dsv4ray job: {path}: line {line_no}: {problem}; skipped", file=sys.stderr)


def parse_line(line: str, default_max_tokens: int) -> tuple[str, dict]:
    """(id, {"prompt" | "messages", "params"}); ValueError saying what is wrong."""
    try:
        item = json.loads(line.removeprefix("\ufeff"))  # a file's byte order mark
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
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
    if "prompt" in item:
        check_text("'prompt'", item["prompt"])
    if "messages" in item:
        item["messages"] = checked_messages(item["messages"])
    params = {k: item[k] for k in PARAM_KEYS if k in item}
    if params.get("max_tokens") is None:  # absent or null: the job's --max-tokens
        params["max_tokens"] = default_max_tokens
    if "response_format" in item:  # OpenAI's shape, as the chat API takes it
        if "structured_output" in item:
            raise ValueError("give at most one of 'structured_output' and 'response_format'")
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


def checked_messages(messages) -> list[dict]:
    """A line's OpenAI chat messages, checked as the chat API checks them, in the chat format's
    shape (text parts joined); ValueError naming the field."""
    from dsv4ray.entrypoints.openai.protocol import chat_messages

    try:
        return chat_messages(messages)
    except ValueError as exc:
        raise ValueError(f"'messages': {exc}") from None


def last_results(path: str) -> dict[str, bool]:
    """id -> whether the id's last line in the output finished (not aborted, no error)."""
    results: dict[str, bool] = {}
    if os.path.isfile(path):
        with open(path, errors="replace") as f:  # a line edited into bad UTF-8: not a result
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
    from dsv4ray.sources import is_remote

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
    try:
        exists = input_exists(input_path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        return f"cannot open the input {input_path!r}: {str(exc).splitlines()[0]}"
    if not exists:
        return f"no input file {input_path!r}"
    folder = os.path.dirname(os.path.abspath(output_path))
    if (is_uri(output_path) or not output_path or output_path.endswith(os.sep)
            or os.path.isdir(output_path) or not os.path.isdir(folder)):  # fmt: skip
        return (
            f"cannot write the output {output_path!r} (a folder, its folder is missing, or not "
            "a local path: the output is appended to as requests finish)"
        )
    problem = _unwritable(output_path)
    if problem:
        return f"cannot write the output {output_path!r}: {problem}"
    local_input = local_path(input_path)
    if local_input is not None and _same_file(local_input, output_path):
        return f"--output {output_path!r} is the input file (results would be appended to it)"
    return None


def _unwritable(path: str) -> str | None:
    """Why the output cannot be opened for appending, or None (a file this check creates is
    removed again; permission bits alone do not say, e.g. for root or an immutable file)."""
    existed = os.path.exists(path)
    try:
        open(path, "a").close()
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        os.remove(path)
    return None


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)

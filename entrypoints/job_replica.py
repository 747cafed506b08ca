"""One replica of a batch job: an actor of the job's Ray Data pool that owns one engine.

``JobReplica`` is the ``map_batches`` class: Ray Data hands it chunks of input rows (``line``,
``id``, ``kind``, ``request``, ``problem``: entrypoints/job_input.py ``job_rows`` and
``JobLines``); it tokenizes each prompt of a line to run, runs them all at once through its
``AsyncEngine`` (continuous batching across the chunks in flight) and returns one row per input
row: the output line (``result``, JSON) or why the request could not run (``problem``; a bad
line's passes through), and the replica's name (``replica``) for the job's per-replica counts. A
chat line with tools gets its answer's ``content`` and ``tool_calls`` (finish_reason
"tool_calls" when it made calls).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import ray

from dsv4ray.engine.checks import without_request_id
from dsv4ray.entrypoints.async_engine import AsyncEngine
from dsv4ray.entrypoints.job_input import TOOL_KEYS, sampling_params
from dsv4ray.entrypoints.tool_calls import ChatTools, constrained

log = logging.getLogger("dsv4ray.job")


class JobReplica:
    def __init__(self, model: str, options: dict) -> None:
        self.engine = AsyncEngine(model, **options)
        context = ray.get_runtime_context()
        self.name = f"{ray.util.get_node_ip_address()}/{context.get_actor_id()[:8]}"
        log.info("job replica %s: engine up (%s)", self.name, self.engine.describe())

    async def __call__(self, batch: dict) -> dict:
        rows = [row for chunk in batch["rows"] for row in json.loads(chunk)]
        done = await asyncio.gather(
            *(self._row(r["line"], r["id"], r["kind"], r["request"], r["problem"]) for r in rows)
        )
        return {
            "line": [r["line"] for r in rows],
            "id": [r["id"] for r in rows],
            "kind": [r["kind"] for r in rows],
            "result": [result for result, _ in done],
            "problem": [problem for _, problem in done],
            "replica": [self.name] * len(done),
            "pid": [os.getpid()] * len(done),  # the driver waits for it to exit at the end
        }

    async def _row(self, line_no: int, req_id: str, kind: str, request: str, problem: str):
        """A line that runs ("new", "retry") is run; a bad or finished one passes through, so
        the driver counts it in input order."""
        if kind in ("new", "retry"):
            return await self._one(line_no, req_id, request)
        return "", problem

    async def _one(self, line_no: int, req_id: str, request: str) -> tuple[str, str]:
        """(the output line, "") or ("", why the request did not run)."""
        item = json.loads(request)
        try:
            tools = ChatTools.from_request(*(item.get(k) for k in TOOL_KEYS))
            ids = self._tokenize(item, tools)
            params = constrained(sampling_params(item["params"]), tools, False, None)
            final = None
            async for update in self.engine.generate(ids, params, request_id=f"line-{line_no}"):
                final = update.output
        except ValueError as exc:  # the engine names its own request id, not the line's
            reason = without_request_id(str(exc), f"line-{line_no}")
            return "", f"request {req_id!r}: {reason}"
        return json.dumps(output_row(req_id, final, tools)), ""

    def _tokenize(self, item: dict, tools: ChatTools | None) -> list[int]:
        tokenizer = self.engine.tokenizer
        functions = tools.prompt_functions() if tools is not None else None
        try:
            if "prompt" in item:
                return tokenizer.encode(item["prompt"])
            return tokenizer.encode_chat(item["messages"], None, functions)
        except Exception as exc:  # a template that cannot render the messages: this request's
            raise ValueError(f"could not be tokenized: {exc}") from None

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()


def output_row(req_id: str, result, tools: ChatTools | None = None) -> dict:
    """An output line: ``{"id", "text", "token_ids", "finish_reason", "metrics"}`` (+ error;
    + ``logprobs`` ([[token, logprob], ...] per token, the sampled one first) and
    ``prompt_logprobs`` when the line asked; + ``content`` and ``tool_calls`` for a line with
    tools)."""
    row = {
        "id": req_id,
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "metrics": result.metrics.to_dict(),
    }
    asked = result.to_dict()
    for name in ("logprobs", "prompt_logprobs"):  # a line that asked for them
        if asked[name] is not None:
            row[name] = asked[name]
    if tools is not None:
        row["content"], row["tool_calls"], row["finish_reason"] = tools.answer(
            result.text, result.finish_reason
        )
    if result.error:
        row["error"] = result.error
    return row

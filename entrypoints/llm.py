"""``LLM``: the offline engine API over EngineCore (see engine/core.py for one engine step).

With pp_size 1 the stage runs in this process; with pp_size > 1 (or use_ray=True) the stages are
Ray actors in one placement group, and a local Ray starts when no cluster is reachable
(RAY_ADDRESS joins one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from dsv4ray.engine.checks import RequestError, without_request_id
from dsv4ray.engine.interrupts import safe_points
from dsv4ray.engine.outputs import RequestOutput
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.engines import build_engine_core, engine_config
from dsv4ray.entrypoints.openai.protocol import chat_messages
from dsv4ray.entrypoints.openai.reasoning import ReasoningSplitter
from dsv4ray.entrypoints.tool_calls import ChatTools, constrained
from dsv4ray.text.chat_encoding import prefix_state, thinking_asked


class LLM:
    """``LLM(model=path, pp_size=1, kv_cache_dtype="fp8", max_total_tokens=None, ...)``.

    Unknown or inconsistent options raise ValueError naming the option; see EngineConfig.
    """

    def __init__(self, model: str, **options) -> None:
        self.core = build_engine_core(engine_config(model, **options))
        self.config = self.core.config
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def scheduler(self):
        return self.core.scheduler

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts (strings or token-id lists) to completion; outputs in prompt order."""
        if not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a string, a list of token ids or a list of "
                             f"those, got {type(prompts).__name__}")  # fmt: skip
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        ids = self._prompt_ids(prompts)  # validate everything before queueing
        req_ids = self._run(ids, params, score=False)
        return [self.core.pop_output(r) for r in req_ids]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Chat conversations rendered with the checkpoint's chat format, then ``generate``d.
        messages: one conversation (a list of {"role", "content", ...}) or a list of them.
        tools, tool_choice, parallel_tool_calls: OpenAI's (entrypoints/tool_calls.py); with
        tools, each output's ``content`` and ``tool_calls`` hold the answer and its calls."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        conversations = [chat_messages(list(c)) for c in conversations]  # checked as the API
        chat_tools = ChatTools.from_request(tools, tool_choice, parallel_tool_calls)
        functions = chat_tools.prompt_functions() if chat_tools is not None else None
        tokenizer = self.core.tokenizer
        prompts = [tokenizer.encode_chat(list(c), chat_template_kwargs, functions)
                   for c in conversations]  # fmt: skip
        params = _per_prompt(sampling_params, len(prompts))
        thinking = thinking_asked(chat_template_kwargs)
        starts = [prefix_state(list(c), thinking) for c in conversations]
        think_end = tokenizer.think_end_id
        params = [constrained(p, chat_tools, thinking and start != "content", think_end)
                  for p, start in zip(params, starts)]  # fmt: skip
        outputs = self.generate(prompts, params)
        if chat_tools is not None:
            for output, start in zip(outputs, starts):
                text = ReasoningSplitter(start).split(output.text)[1] if thinking else output.text
                output.content, output.tool_calls, _ = chat_tools.answer(text, output.finish_reason)
        return outputs

    def score(self, prompts: Sequence[Sequence[int]]) -> list:
        """Teacher-forced log-probabilities [len(prompt), V] (fp32) of every prompt position,
        computed through the paged pipeline (chunked prefill, the configured page format).
        RuntimeError naming the prompt when a step computing it failed (never a partial result;
        every request of the call is dropped first)."""
        if isinstance(prompts, (str, bytes)) or any(
            isinstance(p, (str, bytes)) or not isinstance(p, Sequence) for p in prompts
        ):
            raise ValueError("score takes a list of prompts, each a list of token ids (one "
                             "prompt is [ids])")  # fmt: skip
        ids = self._prompt_ids([list(p) for p in prompts])
        req_ids = self._run(ids, [SamplingParams(max_tokens=1)] * len(ids), score=True)
        chunks = [self.core.pop_logits(r) for r in req_ids]  # never raises: all are popped
        outputs = [self.core.pop_output(r) for r in req_ids]
        for number, (prompt, output, rows) in enumerate(zip(ids, outputs, chunks, strict=True)):
            scored = sum(len(r) for r in rows)
            if output.finish_reason == "abort" or scored != len(prompt):
                why = output.error or f"{scored} of its {len(prompt)} positions were scored"
                raise RuntimeError(_named(f"not scored: {why}", number, len(ids)))
        return [torch.log_softmax(torch.cat(rows), dim=-1) for rows in chunks]

    def _prompt_ids(self, prompts: Sequence) -> list[list[int]]:
        """Each prompt's token ids; a refused one is named by its place in the call."""
        ids = []
        for number, prompt in enumerate(prompts):
            try:
                ids.append(self.core.prompt_ids(prompt))
            except ValueError as exc:
                raise _for_prompt(exc, "", number, len(prompts)) from None
        return ids

    def _run(self, ids: list[list[int]], params: list[SamplingParams], score: bool) -> list[str]:
        """Queues the call's requests and steps until they finish (their ids, in order). If
        anything interrupts it (a request refused, an error, Ctrl-C, while queueing or running),
        every request of the call is aborted and dropped, so no request or page outlives it."""
        req_ids: list[str] = []
        with safe_points():  # Ctrl-C waits for the end of the bookkeeping it lands in
            try:
                for number, (prompt_ids, sp) in enumerate(zip(ids, params)):
                    req_ids.append(f"{'score' if score else 'llm'}-{next(self._ids)}")
                    try:
                        self.core.add_request(req_ids[-1], prompt_ids, sp, score=score)
                    except ValueError as exc:
                        raise _for_prompt(exc, req_ids[-1], number, len(ids)) from None
                self.core.run_until_done(set(req_ids))
            except BaseException:
                for req_id in req_ids:
                    self.core.drop(req_id, "the generate call was interrupted")
                raise
        return req_ids

    def shutdown(self) -> None:
        self.core.shutdown()


def _for_prompt(exc: ValueError, req_id: str, number: int, num_prompts: int) -> ValueError:
    """A refusal of the call's prompt ``number`` (0-based) that names it by its place in the
    call, never by the engine's request id, which the caller never saw."""
    message = str(exc)
    bare = without_request_id(message, req_id)
    named = f"prompt {number}: {bare}" if bare != message or num_prompts > 1 else message
    return RequestError(named, getattr(exc, "field", None))


def _named(message: str, number: int, num_prompts: int) -> str:
    """message about the call's prompt ``number`` (0-based), named when the call had several."""
    return f"prompt {number}: {message}" if num_prompts > 1 else message


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: give one SamplingParams or a list of {n}")
    return params

"""dsv4ray as a stage of a Ray Data pipeline, built the ``ray.data.llm`` way.

    from dsv4ray.data import ProcessorConfig, build_processor

    config = ProcessorConfig(model="/ckpt", concurrency=2, sampling_params={"max_tokens": 64})
    processor = build_processor(
        config,
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["question"]}]},
        postprocess=lambda row: {"question": row["question"], "answer": row["generated_text"]},
    )
    processor(ray.data.read_json("s3://bucket/in.jsonl")).write_json("s3://bucket/out")

Rows stream through Ray Data from the datasource to the sink; none passes through the driver.
A row (after ``preprocess``) carries ``prompt`` (text or token ids) or ``messages`` (chat), and
may carry ``sampling_params`` (a dict, over the config's). The processor adds
``generated_text``, ``generated_tokens``, ``num_input_tokens``, ``num_generated_tokens``,
``finish_reason`` and ``error`` (None, or why the row could not run: the row stays, the pipeline
goes on) and keeps the row's other columns. ``concurrency`` actors each own one engine
(``engine_kwargs`` are ``LLM`` options: ``pp_size`` > 1 gives each its own stage actors) and
run the rows of their batches together (continuous batching across the batches in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from dsv4ray.engine.config import EngineConfig
from dsv4ray.entrypoints.job_input import checked_messages, sampling_params

__all__ = ["Processor", "ProcessorConfig", "build_processor"]

OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens",
                  "num_generated_tokens", "finish_reason", "error")  # fmt: skip


@dataclass(frozen=True)
class ProcessorConfig:
    model: str  # a checkpoint folder or URI (sources.py)
    concurrency: int = 1  # engine actors
    batch_size: int = 16  # rows per call of an actor; each keeps 2 calls in flight
    sampling_params: dict = field(default_factory=dict)  # each row's, unless it says otherwise
    engine_kwargs: dict = field(default_factory=dict)  # LLM options of each engine
    num_cpus: float = 0.5  # each actor's; its engine's stages (pp_size > 1) take their own

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        EngineConfig.build(self.model, check_model=False, **self.engine_kwargs)  # names a bad one
        sampling_params(self.sampling_params)  # a bad default fails here, not in every row


@dataclass(frozen=True)
class Processor:
    config: ProcessorConfig
    preprocess: Callable[[dict], dict] | None = None
    postprocess: Callable[[dict], dict] | None = None

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess)
        c = self.config
        dataset = dataset.map_batches(
            EngineStage,
            fn_constructor_kwargs={"config": c},
            batch_size=c.batch_size,
            batch_format="pandas",
            compute=ray.data.ActorPoolStrategy(size=c.concurrency, max_tasks_in_flight_per_actor=2),
            num_cpus=c.num_cpus,
        )
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess)
        return dataset


def build_processor(
    config: ProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
) -> Processor:
    """A processor to apply to a ``ray.data.Dataset`` (``processor(dataset)``)."""
    return Processor(config, preprocess, postprocess)


class EngineStage:
    """One actor of the processor's pool: an engine, and the rows of each batch run at once."""

    def __init__(self, config: ProcessorConfig) -> None:
        from dsv4ray.entrypoints.async_engine import AsyncEngine

        self.config = config
        self.engine = AsyncEngine(config.model, **config.engine_kwargs)

    async def __call__(self, batch):
        rows = batch.to_dict("records")
        outs = await asyncio.gather(*(self._one(row) for row in rows))
        out = batch.copy()
        for i, name in enumerate(OUTPUT_COLUMNS):
            out[name] = [o[i] for o in outs]
        return out

    async def _one(self, row: dict) -> tuple:
        try:
            ids = self._tokenize(row)
            params = self._params(row.get("sampling_params"))
            final = None
            async for update in self.engine.generate(ids, params):
                final = update.output
        except ValueError as exc:  # this row's input: the others go on
            return "", [], 0, 0, "error", str(exc)
        tokens = list(final.token_ids)
        return final.text, tokens, len(ids), len(tokens), final.finish_reason, final.error

    def _params(self, own):
        if own is None or _is_missing(own):
            own = {}
        if not isinstance(own, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(own).__name__}")
        merged = {**self.config.sampling_params, **{k: v for k, v in own.items() if v is not None}}
        return sampling_params(merged)

    def _tokenize(self, row: dict) -> list[int]:
        tokenizer = self.engine.tokenizer
        prompt, messages = row.get("prompt"), row.get("messages")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if prompt is not None and not _is_missing(prompt):
            ids = [int(t) for t in prompt]
            return self.engine.core.prompt_ids(ids)  # checked against the vocabulary
        if messages is not None and not _is_missing(messages):
            messages = checked_messages(_plain(messages))
            try:
                return tokenizer.encode_chat(messages)
            except Exception as exc:  # messages the chat template cannot render: this row's
                raise ValueError(f"messages could not be tokenized: {exc}") from None
        raise ValueError("a row needs 'prompt' (text or token ids) or 'messages'")

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()


def _plain(value):
    """A column value as JSON would hold it: Arrow's arrays as lists, and without the keys of
    a struct that this row leaves empty (Arrow gives every row each key any row has)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else value
        return [_plain(v) for v in items] if isinstance(items, list) else items
    return value


def _is_missing(value) -> bool:
    """A pandas NA / NaN where a column has no value for this row."""
    try:
        return bool(value != value)
    except (TypeError, ValueError):  # arrays compare element-wise: a value is there
        return False

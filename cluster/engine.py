"""``LLM``: the offline engine. A scheduler (pure Python) drives a pipeline of stage workers.

One engine step: the scheduler emits a StepPlan, every stage applies it and runs its layers, the
last stage samples, the scheduler commits the tokens. With pp_size 1 and no actor feature the
stage runs in this process; stages reached through Ray come with the pipeline module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dsv4ray.cache.configurator import pipeline_capacity, size_stage
from dsv4ray.cache.layer_mapping import split_layers
from dsv4ray.cache.layout import layout_for
from dsv4ray.cache.pools import PoolSizes
from dsv4ray.cluster.engine_config import EngineConfig
from dsv4ray.cluster.outputs import RequestMetrics, RequestOutput
from dsv4ray.cluster.plan import StepPlan
from dsv4ray.cluster.sampling import SamplingParams
from dsv4ray.cluster.scheduler import Scheduler, SchedulerConfig
from dsv4ray.cluster.worker import StageResult, StageWorker
from dsv4ray.config import ModelConfig
from dsv4ray.model.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("dsv4ray.engine")


class LocalPipeline:
    """Stages called in order in this process (a stage is an object with ``execute``)."""

    def __init__(self, workers: list[StageWorker]) -> None:
        self.workers = workers

    def execute(self, plan: StepPlan) -> StageResult:
        result = None
        for worker in self.workers:
            result = worker.execute(plan, result)
        return result

    def shutdown(self) -> None:
        self.workers = []


def size_pipeline(cfg: ModelConfig, ec: EngineConfig, available: list[float | None]):
    """Pools of every stage from its own layer slice; the pipeline takes the minimum."""
    entry_bytes = {
        k: layout_for(k, ec.kv_cache_dtype).bytes_per_entry
        for k in ("window", "c4", "c128", "indexer")
    }
    skip = [spec.skip_topk for spec in cfg.layers]
    caps = [
        size_stage(
            i,
            start,
            end,
            cfg.layer_ratios,
            skip,
            entry_bytes,
            available_bytes=available[i],
            max_total_tokens=ec.resolved_max_total_tokens,
            max_running_requests=ec.max_running_requests,
            max_num_batched_tokens=ec.max_num_batched_tokens,
        )
        for i, (start, end) in enumerate(split_layers(cfg.num_hidden_layers, ec.pp_size))
    ]
    return pipeline_capacity(caps)


class LLM:
    """``LLM(model=path, pp_size=1, kv_cache_dtype="fp8", max_total_tokens=None, ...)``.

    Unknown or inconsistent options raise ValueError naming the option; see EngineConfig.
    """

    def __init__(self, model: str, **options) -> None:
        self.config = EngineConfig.build(model, **options)
        self.model_config = _check_paged_shapes(ModelConfig.from_hf(model))
        self.tokenizer = Tokenizer(model)
        self.pipeline = self._start_pipeline()
        self._next_id = 0

    def _start_pipeline(self):
        ec, cfg = self.config, self.model_config
        ranges = split_layers(cfg.num_hidden_layers, ec.pp_size)
        workers = [
            StageWorker(ec.model, s, e, ec.kv_cache_dtype, ec.dtype, ec.device, cfg)
            for s, e in ranges
        ]
        cap = size_pipeline(cfg, ec, [w.available_bytes(ec.memory_fraction) for w in workers])
        sizes = PoolSizes(
            cap.num_pages, cap.num_window_pages, cap.num_state_slots, cap.num_cached_state_slots
        )
        for w in workers:
            w.allocate(sizes)
        max_model_len = min(ec.max_model_len or cfg.max_position_embeddings, cap.num_full_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=cap.num_pages,
                num_window_pages=cap.num_window_pages,
                num_state_slots=cap.num_state_slots,
                num_cached_state_slots=cap.num_cached_state_slots,
                max_model_len=max_model_len,
                eos_token_id=self.tokenizer.eos_token_id,
                max_num_batched_tokens=ec.max_num_batched_tokens,
                enable_prefix_caching=ec.enable_prefix_caching,
            )
        )
        self.capacity = cap
        log.info(
            "engine: %s, pp=%d, capacity %d tokens, max_model_len %d",
            ec.model,
            ec.pp_size,
            cap.num_full_tokens,
            max_model_len,
        )
        return LocalPipeline(workers)

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt)}")

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs prompts (strings or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        ids = [self._prompt_ids(p) for p in prompts]  # validate everything before queueing
        tracker = _Tracker(self.tokenizer)
        req_ids = []
        for prompt_ids, sp in zip(ids, params):
            req_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.scheduler.add_request(req_id, prompt_ids, sp)
            tracker.add(req_id, prompt_ids, sp)
            req_ids.append(req_id)
        self._run(tracker, set(req_ids))
        return [tracker.outputs[r] for r in req_ids]

    def score(self, prompts: Sequence[Sequence[int]]) -> list:
        """Teacher-forced log-probabilities [len(prompt), V] (fp32) of every prompt position,
        computed through the paged pipeline (chunked prefill, the configured page format)."""
        ids = [self._prompt_ids(list(p)) for p in prompts]
        tracker = _Tracker(self.tokenizer)
        req_ids = []
        for prompt_ids in ids:
            req_id = f"score-{self._next_id}"
            self._next_id += 1
            self.scheduler.add_request(
                req_id, prompt_ids, SamplingParams(max_tokens=1), use_prefix_cache=False
            )
            tracker.add(req_id, prompt_ids, SamplingParams(max_tokens=1))
            req_ids.append(req_id)
        self._run(tracker, set(req_ids), scoring=set(req_ids))
        return [torch.log_softmax(torch.cat(tracker.logits[r]), dim=-1) for r in req_ids]

    def _run(self, tracker: _Tracker, wanted: set[str], scoring: set[str] = frozenset()) -> None:
        while any(not tracker.outputs[r].finished for r in wanted):
            plan = self.scheduler.schedule()
            if plan is None:
                raise RuntimeError("the scheduler has unfinished requests but nothing to run")
            plan.full_logits = [e.req_id for e in plan.batch if e.req_id in scoring]
            result = self.pipeline.execute(plan)
            for req_id, logits in result.full_logits.items():
                tracker.logits.setdefault(req_id, []).append(logits)
            finished = self.scheduler.commit(plan, result.sampled)
            for req_id, token in result.sampled.items():
                stop = tracker.on_token(req_id, token, result.logprobs.get(req_id))
                if stop and not any(f.req_id == req_id for f in finished):
                    done = self.scheduler.finish(req_id, "stop")
                    finished += [done] if done is not None else []
            for f in finished:
                tracker.on_finish(f)

    def shutdown(self) -> None:
        self.pipeline.shutdown()


def _check_paged_shapes(cfg: ModelConfig) -> ModelConfig:
    """The page layouts and kernels assume the release's head shapes."""
    for name, want in (("head_dim", 512), ("qk_rope_head_dim", 64), ("index_head_dim", 128)):
        if getattr(cfg, name) != want:
            raise ValueError(f"the paged engine needs {name} = {want} (its page layouts and "
                             f"kernels), the checkpoint has {getattr(cfg, name)}")
    return cfg


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: give one SamplingParams or a list of {n}")
    return params


class _Tracker:
    """Text, logprobs, stop strings and timings of the requests of one ``generate`` call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: dict[str, RequestOutput] = {}
        self.params: dict[str, SamplingParams] = {}
        self.decoders: dict[str, StreamDecoder] = {}
        self.start: dict[str, float] = {}
        self.stopped_by_string: set[str] = set()
        self.logits: dict[str, list] = {}

    def add(self, req_id: str, prompt_ids: list[int], sp: SamplingParams) -> None:
        self.outputs[req_id] = RequestOutput(
            req_id,
            prompt_ids,
            logprobs=[] if sp.logprobs is not None else None,
            metrics=RequestMetrics(num_prompt_tokens=len(prompt_ids)),
        )
        self.params[req_id] = sp
        self.decoders[req_id] = StreamDecoder(self.tokenizer)
        self.start[req_id] = time.perf_counter()

    def on_token(self, req_id: str, token: int, logprobs) -> bool:
        """Records a sampled token; True when a stop string appeared."""
        out, sp = self.outputs[req_id], self.params[req_id]
        if out.metrics.ttft_s is None:
            out.metrics.ttft_s = time.perf_counter() - self.start[req_id]
        out.token_ids.append(token)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append({token: logprobs[0], **{t: lp for t, lp in logprobs[1]}})
        out.text += self.decoders[req_id].push([token])
        for stop in sp.stop or ():
            cut = out.text.find(stop)
            if cut >= 0:
                out.text = out.text[:cut]
                self.stopped_by_string.add(req_id)
                return True
        return False

    def on_finish(self, finished) -> None:
        out = self.outputs[finished.req_id]
        out.finish_reason = finished.finish_reason
        out.metrics.num_cached_tokens = finished.num_cached_tokens
        out.metrics.e2e_s = time.perf_counter() - self.start[finished.req_id]
        if finished.req_id not in self.stopped_by_string:
            out.text = self.tokenizer.decode(out.token_ids)

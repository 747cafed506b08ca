"""The engine's configs, validated once with the option named in each error.

EngineConfig holds every LLM option; SchedulerConfig the pool sizes a built pipeline reports and
the batching limits. Page sizes and KV formats are defined by the page layouts (cache/layout.py),
write policies by the host tier's index (cache/hicache.py), the CPU token cap by the sizing rules
(cache/configurator.py); nothing here restates them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from dsv4ray.cache.configurator import DEFAULT_CPU_MAX_TOTAL_TOKENS
from dsv4ray.cache.formats import DTYPES as KV_DTYPES
from dsv4ray.cache.formats import PAGE_SIZE, WINDOW_PAGE_SIZE
from dsv4ray.cache.hicache import WRITE_POLICIES
from dsv4ray.config import COMPUTE_DTYPES
from dsv4ray.config_error import is_int
from dsv4ray.engine.handoff import PD_PROTOCOLS
from dsv4ray.engine.spec import SpecConfig

WEIGHT_FORMATS = ("auto", "dequantized", "native")
INTERNAL_OPTIONS = ("draft_rings", "model_source")  # set by the engine for itself


# vLLM engine options a user coming from it reaches for, and what this engine has instead
VLLM_OPTIONS = {
    "pipeline_parallel_size": "pp_size",
    "tensor_parallel_size": "none; stages split the layers (pp_size)",
    "max_num_seqs": "max_running_requests",
    "gpu_memory_utilization": "memory_fraction, a share of the memory free after the weights",
    "enforce_eager": "cuda_graphs=False",
    "num_speculative_tokens": "speculative_num_steps",
    "speculative_config": "speculative_num_steps (the checkpoint's MTP layer drafts)",
    "quantization": "weight_format",
    "enable_chunked_prefill": "none; prefills are always chunked (max_num_batched_tokens)",
    "swap_space": "enable_hicache with host_cache_tokens",
}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a checkpoint folder, or a URI / Hugging Face id (sources.py)
    pp_size: int = 1  # pipeline-parallel stages (Ray actors when > 1)
    kv_cache_dtype: str = "fp8"  # format of the KV pages
    max_total_tokens: int | None = None  # cap on logical full-token capacity of the device pools
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_running_requests: int = 64  # requests decoded together at most
    max_model_len: int | None = None  # context cap; None = the model's, within the pools
    enable_prefix_caching: bool = True  # reuse KV pages of shared prompt prefixes
    enable_hicache: bool = False  # keep evicted prefixes in a host-memory tier
    host_cache_tokens: int | None = None  # None: twice the device pool capacity
    hicache_write_policy: str = "write_through"  # when pages are copied to the host tier
    dtype: str | None = None  # model compute dtype; None = the checkpoint's
    device: str | None = None  # None until resolved: cuda when available, else cpu
    memory_fraction: float = 0.85  # share of free device memory the pools may take
    use_ray: str | bool = "auto"  # stages as Ray actors: auto, true or false
    execution_timeout_s: float = 600.0  # a step that takes longer means a stage is stuck
    # stage actors are placed, start, load weights, allocate and capture graphs within it
    startup_timeout_s: float = 1800.0
    cuda_graphs: bool = True  # decode steps replay CUDA graphs on every stage (CUDA; CPU: ignored)
    speculative_num_steps: int = 0  # MTP draft tokens per request and step (engine/spec.py)
    speculative_eagle_topk: int = 1  # candidates per draft step: 1 = chain drafting
    # compressor rings sized for drafts on an engine that runs none: the prefill engine of a
    # decode side that drafts (a handoff copies a request's rings whole)
    draft_rings: bool = False
    # schedule a decode's next token before its last one is read back ("auto": on CUDA)
    overlap_scheduling: str | bool = "auto"
    enable_hisparse: bool = False  # C4 history in host memory, a few hot rows on the device
    hisparse_hot_rows: int | None = None  # per request and C4 layer; None: 2 x index_topk
    hisparse_host_tokens: int | None = None  # C4 history the host holds; None: device capacity
    num_gpus_per_stage: float = 1.0  # below 1, pipelines share GPUs (split memory_fraction too)
    # micro-batches in flight on stage actors without overlap scheduling (each plan takes its
    # share of the running decodes); None: one per stage; more makes the last stage lag
    pp_micro_batches: int | None = None
    # prefill/decode disaggregation (engine/pd/core.py): > 0 runs a prefill pipeline of this many
    # stages beside this one, which decodes
    prefill_pp_size: int = 0
    pd_protocol: str = "tcp"  # Mooncake transport: "tcp", or "rdma" where NICs have it
    pd_timeout_s: float = 120.0  # a prefill not answered by then is done here instead
    pd_test_corrupt_transfers: int = 0  # test hook: the next N handoffs flip a byte on the wire
    # quantized checkpoints: "native" keeps FP8 / FP4 weights (kernels compute with them),
    # "dequantized" converts them to the compute dtype at load; "auto": native on CUDA
    weight_format: str = "auto"
    # native FP8 linears quantise the activations of prefill-sized calls (more than 64 rows) per
    # 1 x 128 block and multiply FP8 x FP8 (kernels/fp8_act.py): faster prefills, at the accuracy
    # of FP8 activations (below the bf16-page gates on a random tiny model; docs/benchmarks.md)
    fp8_prefill: bool = False
    # the URI ``model`` was fetched from (model is then the local copy): stage actors on
    # other machines fetch it there
    model_source: str | None = None

    @classmethod
    def build(cls, model: str, check_model: bool = True, **options) -> EngineConfig:
        """check_model=False checks the options alone: a Serve app or job is built where the
        checkpoint may be missing (a head node), and its replicas check it where they run."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            known = sorted(names - set(INTERNAL_OPTIONS) - {"model"})
            hint = VLLM_OPTIONS.get(unknown[0])
            hint = f" (vLLM's option; here: {hint})" if hint else ""
            raise ValueError(f"unknown LLM option {unknown[0]!r}{hint}; known options: {known}")
        config = cls(model=model, **options)
        if check_model:
            config.check_model()
        return config

    def check_model(self) -> None:
        from dsv4ray.sources import is_remote

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint's path or URI (a string), got "
                             f"{self.model!r}")  # fmt: skip
        if is_remote(str(self.model)):
            return  # fetched (and checked) where an engine is built
        if not os.path.isfile(os.path.join(str(self.model), "config.json")):
            raise ValueError(f"model: no config.json in {self.model!r}")

    def __post_init__(self) -> None:
        _int_at_least(self, "pp_size", 1)
        _int_at_least(self, "max_num_batched_tokens", PAGE_SIZE)
        _int_at_least(self, "max_running_requests", 1)
        for name in ("max_total_tokens", "max_model_len", "host_cache_tokens"):
            if getattr(self, name) is not None:
                _int_at_least(self, name, 1 if name == "max_model_len" else PAGE_SIZE)
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        for name in ("execution_timeout_s", "startup_timeout_s"):
            _positive(self, name)
        _positive(self, "memory_fraction")
        if not self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        for name in ("use_ray", "overlap_scheduling"):  # 0 and 1 are not False and True here
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
        if self.dtype is not None and self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES} (the dtypes the attention "
                             f"kernels compute in), got {self.dtype!r}")  # fmt: skip
        for name in ("cuda_graphs", "enable_hisparse", "fp8_prefill", "enable_prefix_caching",
                     "enable_hicache", "draft_rings"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}"
            )
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.model_source is not None and not isinstance(self.model_source, str):
            raise ValueError(f"model_source must be a URI string, got {self.model_source!r}")
        SpecConfig(self.speculative_num_steps, self.speculative_eagle_topk)  # names a bad one
        self._check_pd()
        self._check_combinations()
        self._check_hisparse()
        self._check_micro_batches()

    def _check_pd(self) -> None:
        _int_at_least(self, "prefill_pp_size", 0)
        _int_at_least(self, "pd_test_corrupt_transfers", 0)
        if self.pd_protocol not in PD_PROTOCOLS:
            raise ValueError(f"pd_protocol must be one of {PD_PROTOCOLS}, got {self.pd_protocol!r}")
        for name in ("pd_timeout_s", "num_gpus_per_stage"):
            _positive(self, name)
        if self.num_gpus_per_stage > 1:
            raise ValueError(f"num_gpus_per_stage must be <= 1, got {self.num_gpus_per_stage}")
        if not self.prefill_pp_size:
            return
        if self.use_ray is False:
            raise ValueError("prefill_pp_size runs both pipelines as Ray actors; use_ray=False")

    def _check_combinations(self) -> None:
        if self.host_cache_tokens is not None and not self.enable_hicache:
            raise ValueError("host_cache_tokens is set but enable_hicache is False")
        if self.hicache_write_policy != "write_through" and not self.enable_hicache:
            raise ValueError(
                f"hicache_write_policy={self.hicache_write_policy!r} is set but enable_hicache "
                "is False"
            )
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {WRITE_POLICIES}, got "
                f"{self.hicache_write_policy!r}"
            )
        if self.enable_hicache and not self.enable_prefix_caching:
            raise ValueError(
                "enable_hicache needs enable_prefix_caching (the host tier extends "
                "the prefix cache)"
            )
        if self.enable_hicache and self.use_ray is False:
            raise ValueError("enable_hicache runs a host tier actor; use_ray=False is not allowed")
        if self.overlap_scheduling is True and not self._overlap_possible:
            raise ValueError(
                "overlap_scheduling does not combine with speculative_num_steps or "
                "prefill_pp_size yet"
            )

    @property
    def ring_scale(self) -> int:
        """2 where drafts write ahead of the commit point (this engine's, or the drafts of the
        decode side a prefill engine hands over to), else 1."""
        return 2 if self.speculative_num_steps or self.draft_rings else 1

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(self.speculative_num_steps, self.speculative_eagle_topk)

    @property
    def _overlap_possible(self) -> bool:
        return not self.speculative_num_steps and not self.prefill_pp_size

    @property
    def uses_overlap(self) -> bool:
        """Whether the engine schedules a decode's next token while its last one is computed
        (any pp, in process or on stage actors), without drafts or a prefill pipeline; on CUDA
        unless asked for elsewhere."""
        if self.overlap_scheduling == "auto":
            on = self.device == "cuda" and not self._stages_on_separate_gpus
        else:
            on = bool(self.overlap_scheduling)
        return on and self._overlap_possible

    @property
    def _stages_on_separate_gpus(self) -> bool:
        return self.uses_ray and self.pp_size > 1 and self.num_gpus_per_stage >= 1

    @property
    def micro_batches(self) -> int:
        """Plans of distinct requests in flight at once: pp_micro_batches (default one per
        stage) on a pipeline of stage actors without lookahead (its stages compute different
        micro-batches at once; with a lookahead the next plan needs the last stage's tokens on
        the first, so stages take turns), else 1. On separate GPUs this is the default:
        between two GPUs a lookahead token costs a full round trip through every stage per
        step."""
        if self._runs_micro_batches:
            return self.pp_micro_batches or self.pp_size
        return 1

    @property
    def _runs_micro_batches(self) -> bool:
        return (
            self.uses_ray
            and self.pp_size > 1
            and not self.uses_overlap
            and not self.speculative_num_steps
        )

    @property
    def lags_last_stage(self) -> bool:
        """Whether a pipeline's last stage launches a step and returns the previous one's
        result, so that its device computes while the host reads back and commits: with
        overlap scheduling, and with more micro-batches than stages (the spare plan keeps
        every stage busy while a result waits for the next step to carry it)."""
        return self.uses_overlap or self.micro_batches > self.pp_size

    def _check_micro_batches(self) -> None:
        if self.pp_micro_batches is None:
            return
        _int_at_least(self, "pp_micro_batches", 1)
        if self.device is not None and not self._runs_micro_batches:
            raise ValueError(
                "pp_micro_batches applies to pipelines of stage actors (pp_size > 1) without "
                "overlap scheduling or drafts; this configuration runs one plan of decodes"
            )

    def _check_hisparse(self) -> None:
        for name, low in (("hisparse_hot_rows", 2), ("hisparse_host_tokens", PAGE_SIZE)):
            if getattr(self, name) is None:
                continue
            if not self.enable_hisparse:
                raise ValueError(f"{name} is set but enable_hisparse is False")
            _int_at_least(self, name, low)

    @property
    def uses_ray(self) -> bool:
        """In-process when pp_size == 1 and no actor feature (host tier, draft worker, a prefill
        pipeline) is on, Ray actors otherwise (use_ray=False runs a draft worker in process too)."""
        if self.use_ray == "auto":
            actors = self.enable_hicache or self.speculative_num_steps > 0 or self.prefill_pp_size
            return self.pp_size > 1 or bool(actors)
        return bool(self.use_ray)

    @property
    def resolved_max_total_tokens(self) -> int | None:
        """None on GPUs means no cap; on CPU machines pools are sized from tokens, never RAM."""
        if self.device is None:
            raise ValueError("the engine's device is not resolved yet")
        if self.max_total_tokens is not None or self.device != "cpu":
            return self.max_total_tokens
        return DEFAULT_CPU_MAX_TOTAL_TOKENS


_POSITIVE_FIELDS = ("num_pages", "num_window_pages", "num_state_slots", "max_model_len")
_POSITIVE_FIELDS += ("page_size", "window_page_size", "max_num_batched_tokens")


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool sizes (from the configurator) and batching limits. num_state_slots is the maximum
    number of running requests."""

    num_pages: int
    num_window_pages: int
    num_state_slots: int
    num_cached_state_slots: int
    max_model_len: int
    eos_token_id: int | None = None
    page_size: int = PAGE_SIZE
    window_page_size: int = WINDOW_PAGE_SIZE
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True  # reuse KV pages of shared prompt prefixes
    num_host_pages: int = 0  # host tier (HiCache): 0 = off
    num_host_snapshots: int = 0
    hicache_write_policy: str = "write_through"  # when pages are copied to the host tier
    lookahead: bool = False  # a decode in flight may be scheduled for its next token
    num_speculative_steps: int = 0  # drafts the draft worker proposes (0: no draft worker)
    # plans in flight on a pipeline of stage actors: each takes its share of the running
    # decodes, so that every stage computes a different micro-batch at once
    micro_batches: int = 1

    def __post_init__(self) -> None:
        _int_at_least(self, "micro_batches", 1)
        for name in _POSITIVE_FIELDS:
            _int_at_least(self, name, 1)
        _int_at_least(self, "num_cached_state_slots", 0)
        if self.eos_token_id is not None:
            _int_at_least(self, "eos_token_id", 0)
        if self.page_size % self.window_page_size:
            raise ValueError(
                f"page_size ({self.page_size}) must be a multiple of window_page_size "
                f"({self.window_page_size})"
            )
        if self.max_num_batched_tokens < self.page_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= page_size "
                f"({self.page_size}) so that a page-aligned prefill chunk always fits"
            )
        if self.max_model_len > self.num_pages * self.page_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds num_pages ({self.num_pages}) * "
                f"page_size ({self.page_size}): a lone request could never finish"
            )
        if self.num_window_pages < self.min_window_pages:
            raise ValueError(
                f"num_window_pages ({self.num_window_pages}) must be >= {self.min_window_pages}: "
                f"a full-budget chunk, the 127 tokens before it and a snapshot's pinned page"
            )

    @property
    def min_window_pages(self) -> int:
        return -(-self.max_num_batched_tokens // self.window_page_size) + 3


def _positive(cfg, name: str) -> None:
    value = getattr(cfg, name)
    valid = not isinstance(value, bool) and isinstance(value, (int, float))
    if not valid or not 0 < value < math.inf:  # NaN compares False both ways
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


MAX_COUNT = 2**40  # token and request counts past this overflow the size arithmetic of pools


def _int_at_least(cfg, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if not is_int(value) or not low <= value <= MAX_COUNT:
        raise ValueError(f"{name} must be an int in [{low}, 2**40], got {value!r}")

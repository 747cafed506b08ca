"""Pool sizing per pipeline stage. Pure Python, no torch.

Every stage sizes its pools from ITS OWN layer slice ratios[start:end]. Using the whole model's
ratios on each stage over-counts bytes per token by about the PP size, so the
functions here take slices, and ``size_stage`` slices the model's list itself.

Bytes per logical full token of a stage, b(kind) = padded bytes per entry of a pool kind:

    r_swa * b(window) * L_all  +  b(c4) * L_c4 / (4 * S)  +  b(c128) * L_c128 / 128
        +  b(indexer) * L_indexer / 4

with S the HiSparse host:device ratio (1 when off) and L_indexer the C4 layers that own an indexer.
With HiSparse hot rows (cache/hisparse_sizing.py) the C4 term is replaced by hot rows reserved per
running request, and the host store's tokens cap the capacity.
The stage that also hosts the MTP draft worker multiplies this by (L_all + 1) / L_all (one more
layer, priced as an average layer of that stage, as SGLang does after slicing).

Fixed costs reserved up front: compressor-state rings per running request, C4 rings per cached-state
slot (prefix snapshots), and a window-page floor so that a full batch never starves on window pages.
Full tokens are floored to 256-token pages. The pipeline's capacity is the minimum over its stages
(all stages use the same page ids).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsv4ray.cache.formats import PAGE_SIZE, WINDOW_PAGE_SIZE
from dsv4ray.cache.hisparse_sizing import hot_bytes_per_request
from dsv4ray.cache.layer_mapping import count_kinds

logger = logging.getLogger("dsv4ray.cache")

DEFAULT_CPU_MAX_TOTAL_TOKENS = 65536
ENTRY_KINDS = ("window", "c4", "c128", "indexer")

# Compressor state (fp32): C4 main ring rows are [kv_overlap | kv | score_overlap | score] of 512
# dims, the C4 indexer's the same of 128 dims, C128 rows are [kv | score] of 512 dims.
_FP32 = 4
C4_STATE_ROW_BYTES = 4 * 512 * _FP32
C4_INDEXER_STATE_ROW_BYTES = 4 * 128 * _FP32
C128_STATE_ROW_BYTES = 2 * 512 * _FP32
C4_RING_ROWS = 8
C128_RING_ROWS = 128


def _check_entry_bytes(entry_bytes: Mapping[str, float]) -> None:
    missing = [kind for kind in ENTRY_KINDS if kind not in entry_bytes]
    if missing:
        raise ValueError(f"entry_bytes lacks pool kinds {missing} (needs {list(ENTRY_KINDS)})")
    bad = [kind for kind in ENTRY_KINDS if not entry_bytes[kind] > 0]
    if bad:
        raise ValueError(f"entry_bytes must be > 0 for every kind, not for {bad}")


def bytes_per_full_token(
    ratios_slice: Sequence[int],
    skip_slice: Sequence[bool],
    entry_bytes: Mapping[str, float],
    r_swa: float = 0.1,
    hisparse_ratio: float = 1,
    mtp: bool = False,
) -> float:
    """Device bytes one logical full token costs on the stage owning these layers (see module doc).

    mtp=True only for the stage whose device also holds the MTP draft worker.
    """
    _check_entry_bytes(entry_bytes)
    if not 0 <= r_swa <= 1:
        raise ValueError(f"r_swa must be in [0, 1], got {r_swa}")
    if hisparse_ratio < 1:
        raise ValueError(f"hisparse_ratio must be >= 1, got {hisparse_ratio}")
    counts = count_kinds(ratios_slice, skip_slice)
    if counts["all"] == 0:
        raise ValueError("a stage owns at least one layer; got an empty ratios slice")
    total = (
        r_swa * entry_bytes["window"] * counts["all"]
        + entry_bytes["c4"] * counts["c4"] / (4 * hisparse_ratio)
        + entry_bytes["c128"] * counts["c128"] / 128
        + entry_bytes["indexer"] * counts["indexer"] / 4
    )
    if mtp:
        total *= (counts["all"] + 1) / counts["all"]
    return total


def _ring_rows(spec: bool) -> tuple[int, int]:
    # Drafts write ahead of the commit point, so speculative decoding doubles both rings.
    factor = 2 if spec else 1
    return C4_RING_ROWS * factor, C128_RING_ROWS * factor


def state_bytes_per_request(
    ratios_slice: Sequence[int], skip_slice: Sequence[bool], spec: bool = False
) -> int:
    """Compressor-state ring bytes of one running request on this stage."""
    counts = count_kinds(ratios_slice, skip_slice)
    c4_rows, c128_rows = _ring_rows(spec)
    return (
        c4_rows * C4_STATE_ROW_BYTES * counts["c4"]
        + c4_rows * C4_INDEXER_STATE_ROW_BYTES * counts["indexer"]
        + c128_rows * C128_STATE_ROW_BYTES * counts["c128"]
    )


def snapshot_bytes(
    ratios_slice: Sequence[int], skip_slice: Sequence[bool], spec: bool = False
) -> int:
    """Bytes of one cached-state slot: the C4 main and indexer rings (a snapshot sits on a
    256-token boundary, where the C128 ring is empty and need not be kept)."""
    counts = count_kinds(ratios_slice, skip_slice)
    c4_rows, _ = _ring_rows(spec)
    return c4_rows * (
        C4_STATE_ROW_BYTES * counts["c4"] + C4_INDEXER_STATE_ROW_BYTES * counts["indexer"]
    )


def min_window_pages(max_running_requests: int, max_num_batched_tokens: int) -> int:
    """Window pages a full batch may hold at once: per running request up to 3 (the two pages
    straddled by its last 128 tokens plus the page pinned by its prefix snapshot), plus the pages
    a full prefill chunk writes, plus one for a chunk that starts mid-page."""
    return max_running_requests * 3 + math.ceil(max_num_batched_tokens / WINDOW_PAGE_SIZE) + 1


@dataclass(frozen=True)
class StageCapacity:
    """What one stage's pools hold. num_full_tokens = num_pages * 256."""

    stage_idx: int
    start: int
    end: int
    num_full_tokens: int
    num_pages: int
    num_window_pages: int
    num_state_slots: int
    num_cached_state_slots: int
    bytes_per_full_token: float

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"start/end must satisfy 0 <= start < end, got {self.start}, {self.end}"
            )
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.num_full_tokens != self.num_pages * PAGE_SIZE:
            raise ValueError(
                f"num_full_tokens ({self.num_full_tokens}) must equal num_pages * {PAGE_SIZE}"
            )
        for name in ("num_window_pages", "num_state_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cached_state_slots < 0:
            raise ValueError(
                f"num_cached_state_slots must be >= 0, got {self.num_cached_state_slots}"
            )


@dataclass(frozen=True)
class PipelineCapacity:
    """The pipeline's pools: the minimum over its stages (they share page and slot ids)."""

    num_full_tokens: int
    num_pages: int
    num_window_pages: int
    num_state_slots: int
    num_cached_state_slots: int
    stages: tuple[StageCapacity, ...]
    hisparse_hot_rows: int = 0  # per request per C4 layer; 0: HiSparse off


def _solve_full_tokens(
    budget: float,
    per_token: float,
    window_token_bytes: float,
    floor_window_bytes: float,
    r_swa: float,
) -> float:
    """Full tokens N with fixed + N * per_token + window excess <= budget, where the window pool is
    max(r_swa * N tokens, the floor): when the floor dominates, its bytes are reserved up front
    and the r_swa window share is taken out of the per-token price."""
    if budget < floor_window_bytes:
        return 0.0
    if per_token == 0:
        return math.inf  # window-only stage with r_swa = 0: full pages cost it nothing
    tokens = budget / per_token
    if r_swa * tokens * window_token_bytes >= floor_window_bytes:
        return tokens
    # Here per_token > r_swa * window_token_bytes, else the branch above would have returned.
    return (budget - floor_window_bytes) / (per_token - r_swa * window_token_bytes)


@dataclass(frozen=True)
class _Reservations:
    """What a stage reserves before pricing full tokens."""

    max_running_requests: int
    num_cached_state_slots: int
    floor_window_pages: int
    speculative: bool
    hosts_draft: bool
    hot_bytes_per_request: float = 0.0  # HiSparse hot rows of a running request


def _memory_full_tokens(
    available_bytes: float,
    ratios_slice: Sequence[int],
    skip_slice: Sequence[bool],
    entry_bytes: Mapping[str, float],
    per_token: float,
    r_swa: float,
    res: _Reservations,
) -> float:
    """Full tokens that fit in available_bytes after the per-request and snapshot reservations."""
    per_request = state_bytes_per_request(ratios_slice, skip_slice, res.speculative)
    fixed = res.max_running_requests * (per_request + res.hot_bytes_per_request)
    fixed += res.num_cached_state_slots * snapshot_bytes(ratios_slice, skip_slice, res.speculative)
    window_token_bytes = entry_bytes["window"] * len(ratios_slice)
    if res.hosts_draft:
        window_token_bytes *= (len(ratios_slice) + 1) / len(ratios_slice)
    # the window pool is whole pages: rounding r_swa * N up adds less than one page
    fixed += WINDOW_PAGE_SIZE * window_token_bytes
    return _solve_full_tokens(
        available_bytes - fixed,
        per_token,
        window_token_bytes,
        res.floor_window_pages * WINDOW_PAGE_SIZE * window_token_bytes,
        r_swa,
    )


def _whole_pages(
    full_tokens: float, stage_idx: int, start: int, end: int, available_bytes: float | None
) -> int:
    if math.isinf(full_tokens):
        raise ValueError(
            f"stage {stage_idx} (layers [{start}, {end})) has no per-token cost; "
            "pass max_total_tokens"
        )
    num_pages = int(full_tokens) // PAGE_SIZE
    if num_pages < 1:
        raise ValueError(
            f"stage {stage_idx} (layers [{start}, {end})): available_bytes={available_bytes} "
            f"leaves room for no {PAGE_SIZE}-token page after fixed reservations"
        )
    return num_pages


def _check_stage_args(
    stage_idx: int,
    start: int,
    end: int,
    num_model_layers: int,
    max_total_tokens: int | None,
    max_running_requests: int,
    max_num_batched_tokens: int,
) -> None:
    if not 0 <= start < end <= num_model_layers:
        raise ValueError(f"stage {stage_idx}: layers [{start}, {end}) not inside the model")
    for name, value in (
        ("max_running_requests", max_running_requests),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_total_tokens is not None and max_total_tokens < PAGE_SIZE:
        raise ValueError(f"max_total_tokens must be >= {PAGE_SIZE}, got {max_total_tokens}")


def size_stage(
    stage_idx: int,
    start: int,
    end: int,
    ratios: Sequence[int],
    skip: Sequence[bool],
    entry_bytes: Mapping[str, float],
    *,
    available_bytes: float | None = None,
    max_total_tokens: int | None = None,
    max_running_requests: int,
    max_num_batched_tokens: int = 2048,
    num_cached_state_slots: int | None = None,
    r_swa: float = 0.1,
    hisparse_ratio: float = 1,
    speculative: bool = False,
    hosts_draft: bool = False,
    hisparse_hot_rows: int = 0,
    hisparse_host_tokens: int | None = None,
) -> StageCapacity:
    """Size the pools of the stage owning layers [start, end) of a model.

    ratios / skip cover the whole model; only ratios[start:end] is priced. available_bytes None
    (CPU): capacity = max_total_tokens (default 65,536), never free RAM. Otherwise (GPU: free
    memory after weights times the memory fraction) capacity is what fits after the fixed
    reservations, capped by max_total_tokens when given. speculative doubles the state rings (all
    stages); hosts_draft adds the MTP layer's (L+1)/L (the stage sharing its device with the draft
    worker). num_cached_state_slots defaults to 4 * max_running_requests (a running request holds
    up to two snapshots while a step is in flight; the rest keep finished prefixes reusable).
    hisparse_hot_rows > 0: C4 entries live in host memory (no per-token C4 term) and each running
    request reserves its hot rows; hisparse_host_tokens caps the capacity (the host store).
    """
    _check_stage_args(stage_idx, start, end, len(ratios), max_total_tokens,
                      max_running_requests, max_num_batched_tokens)  # fmt: skip
    ratios_slice, skip_slice = list(ratios[start:end]), list(skip[start:end])
    if num_cached_state_slots is None:
        num_cached_state_slots = 4 * max_running_requests
    if hisparse_hot_rows:
        hisparse_ratio = math.inf  # no C4 entry per token on the device
    per_token = bytes_per_full_token(
        ratios_slice, skip_slice, entry_bytes, r_swa, hisparse_ratio, mtp=hosts_draft
    )
    res = _Reservations(
        max_running_requests,
        num_cached_state_slots,
        min_window_pages(max_running_requests, max_num_batched_tokens),
        speculative,
        hosts_draft,
        hot_bytes_per_request(ratios_slice, skip_slice, entry_bytes, hisparse_hot_rows),
    )
    host_cap = hisparse_host_tokens or math.inf  # the HiSparse host store holds the history
    if available_bytes is None:
        full_tokens = min(max_total_tokens or DEFAULT_CPU_MAX_TOTAL_TOKENS, host_cap)
    else:
        memory = _memory_full_tokens(
            available_bytes, ratios_slice, skip_slice, entry_bytes, per_token, r_swa, res
        )
        full_tokens = min(max_total_tokens or math.inf, host_cap, memory)
    num_pages = _whole_pages(full_tokens, stage_idx, start, end, available_bytes)
    cap = StageCapacity(
        stage_idx=stage_idx,
        start=start,
        end=end,
        num_full_tokens=num_pages * PAGE_SIZE,
        num_pages=num_pages,
        num_window_pages=max(
            math.ceil(r_swa * num_pages * PAGE_SIZE / WINDOW_PAGE_SIZE), res.floor_window_pages
        ),
        num_state_slots=max_running_requests,
        num_cached_state_slots=num_cached_state_slots,
        bytes_per_full_token=per_token,
    )
    _log_stage(cap, count_kinds(ratios_slice, skip_slice), len(ratios), hisparse_hot_rows)
    return cap


def _log_stage(cap: StageCapacity, counts: Mapping[str, int], num_model_layers: int,
               hot_rows: int) -> None:  # fmt: skip
    logger.info(
        "stage %d layers [%d, %d) (%d of %d model layers: %d C4, %d C128, %d indexers): "
        "%d full tokens (%d pages), %d window pages, %d state slots, %d cached-state slots, "
        "%.1f bytes/token, %d HiSparse hot rows per request and C4 layer",
        cap.stage_idx, cap.start, cap.end, counts["all"], num_model_layers, counts["c4"],
        counts["c128"], counts["indexer"], cap.num_full_tokens, cap.num_pages,
        cap.num_window_pages, cap.num_state_slots, cap.num_cached_state_slots,
        cap.bytes_per_full_token, hot_rows,
    )  # fmt: skip


def share_devices(
    available: Sequence[float | None], devices: Sequence[str | None], weights: Sequence[float]
) -> list[float | None]:
    """Each stage's pool budget when stages share a device: they all measured the same free
    memory, so each takes a share of it in proportion to its weight (its bytes per full
    token), and together they fit. devices[i] None (CPU) or alone on its device: unchanged."""
    out = list(available)
    groups: dict[str, list[int]] = {}
    for i, device in enumerate(devices):
        if device is not None and available[i] is not None:
            groups.setdefault(device, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        budget = min(available[i] for i in members)
        total = sum(weights[i] for i in members)
        for i in members:
            out[i] = budget * weights[i] / total
    return out


def pipeline_capacity(stage_caps: Sequence[StageCapacity]) -> PipelineCapacity:
    """Minimum over stages, which must cover contiguous layer ranges in stage order."""
    if not stage_caps:
        raise ValueError("pipeline_capacity needs at least one stage")
    for prev, cur in zip(stage_caps, stage_caps[1:], strict=False):
        if cur.start != prev.end:
            raise ValueError(
                f"stage {cur.stage_idx} starts at layer {cur.start}, "
                f"stage {prev.stage_idx} ends at {prev.end}: ranges must be contiguous"
            )
    limiting = min(stage_caps, key=lambda cap: cap.num_pages)
    result = PipelineCapacity(
        num_full_tokens=limiting.num_full_tokens,
        num_pages=limiting.num_pages,
        num_window_pages=min(cap.num_window_pages for cap in stage_caps),
        num_state_slots=min(cap.num_state_slots for cap in stage_caps),
        num_cached_state_slots=min(cap.num_cached_state_slots for cap in stage_caps),
        stages=tuple(stage_caps),
    )
    logger.info(
        "pipeline capacity %d full tokens (limited by stage %d, layers [%d, %d)), "
        "%d window pages, %d state slots",
        result.num_full_tokens,
        limiting.stage_idx,
        limiting.start,
        limiting.end,
        result.num_window_pages,
        result.num_state_slots,
    )
    return result

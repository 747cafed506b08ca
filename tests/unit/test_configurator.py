"""Pool sizing by each stage's own layer slice (SPEC_SERVING 2, seed 004)."""

import logging
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsv4ray.cache.configurator import (
    ENTRY_KINDS,
    StageCapacity,
    bytes_per_full_token,
    min_window_pages,
    pipeline_capacity,
    share_devices,
    size_stage,
    snapshot_bytes,
    state_bytes_per_request,
)
from dsv4ray.cache.layer_mapping import split_layers

FP8 = {"window": 585, "c4": 585, "c128": 864, "indexer": 132}
BF16 = {"window": 1024, "c4": 1024, "c128": 1024, "indexer": 256}
# Two identical halves, so that each of two stages holds exactly half of every layer kind.
HALF = [0, 4, 128, 4, 128, 4, 128, 4]
RATIOS = HALF + HALF
SKIP = [False] * len(RATIOS)
GIB = 1 << 30


def test_bytes_per_full_token_of_a_slice():
    # 0.1 * 585 * 4 (window) + 585 * 2 / 4 (C4) + 864 / 128 (C128) + 132 * 2 / 4 (indexer)
    assert bytes_per_full_token([4, 128, 4, 0], [False] * 4, FP8) == pytest.approx(599.25)
    # a sharing C4 layer owns no indexer: 132 / 4 less
    assert bytes_per_full_token([4, 128, 4, 0], [False, False, True, False], FP8) == pytest.approx(
        566.25
    )
    # HiSparse with S = 2 halves the device C4 term
    assert bytes_per_full_token([4], [False], FP8, hisparse_ratio=2) == pytest.approx(
        58.5 + 585 / 8 + 33
    )
    # the stage hosting the draft worker pays (L + 1) / L
    assert bytes_per_full_token([4, 0], [False, False], BF16, mtp=True) == pytest.approx(
        (0.1 * 1024 * 2 + 256 + 64) * 1.5
    )


def test_bytes_per_full_token_rejects_bad_inputs():
    with pytest.raises(ValueError, match="indexer"):
        bytes_per_full_token([4], [False], {"window": 1, "c4": 1, "c128": 1})
    with pytest.raises(ValueError, match="r_swa"):
        bytes_per_full_token([4], [False], FP8, r_swa=1.5)
    with pytest.raises(ValueError, match="skip slice"):
        bytes_per_full_token([4, 0], [False], FP8)


def test_state_and_snapshot_bytes():
    c4_ring = 8 * (4 * 512 + 4 * 128) * 4
    c128_ring = 128 * 2 * 512 * 4
    assert state_bytes_per_request([4, 128, 0], [False] * 3) == c4_ring + c128_ring
    # a sharing C4 layer keeps only its main ring
    assert state_bytes_per_request([4], [True]) == 8 * 4 * 512 * 4
    assert state_bytes_per_request([4, 128], [False] * 2, spec=True) == 2 * (c4_ring + c128_ring)
    # snapshots sit on 256-token boundaries, where the C128 ring is empty
    assert snapshot_bytes([4, 128], [False, False]) == c4_ring


def test_two_stages_hold_twice_the_tokens_of_one_stage_with_the_same_budget():
    budget = 8 * GIB
    whole = size_stage(0, 0, 16, RATIOS, SKIP, FP8, available_bytes=budget, max_running_requests=16)
    halves = [
        size_stage(
            i, start, end, RATIOS, SKIP, FP8, available_bytes=budget, max_running_requests=16
        )
        for i, (start, end) in enumerate(split_layers(16, 2))
    ]
    for cap in halves:
        assert cap.num_full_tokens / whole.num_full_tokens == pytest.approx(2.0, rel=0.01)
    assert pipeline_capacity(halves).num_full_tokens == min(c.num_full_tokens for c in halves)


def test_a_stage_prices_its_own_slice_never_the_whole_model():
    cap = size_stage(1, 8, 16, RATIOS, SKIP, FP8, available_bytes=GIB, max_running_requests=4)
    assert cap.bytes_per_full_token == pytest.approx(bytes_per_full_token(HALF, SKIP[:8], FP8))
    assert cap.bytes_per_full_token == pytest.approx(bytes_per_full_token(RATIOS, SKIP, FP8) / 2)


def test_max_total_tokens_caps_and_floors_to_pages():
    cap = size_stage(
        0,
        0,
        8,
        RATIOS,
        SKIP,
        FP8,
        available_bytes=64 * GIB,
        max_total_tokens=10_000,
        max_running_requests=4,
    )
    assert (cap.num_full_tokens, cap.num_pages) == (9984, 39)


def test_cpu_sizing_ignores_memory_and_defaults_to_65536_tokens():
    cap = size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_running_requests=8)
    assert (cap.num_full_tokens, cap.num_pages) == (65536, 256)
    cap = size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_total_tokens=4096, max_running_requests=8)
    assert cap.num_pages == 16


def test_window_pool_never_starves_a_full_batch():
    floor = min_window_pages(64, 2048)
    assert floor == 64 * 3 + 16 + 1
    small = size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_total_tokens=4096, max_running_requests=64)
    assert small.num_window_pages == floor  # 0.1 * 4096 / 128 would give 4
    big = size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_total_tokens=1 << 22, max_running_requests=4)
    assert big.num_window_pages == math.ceil(0.1 * (1 << 22) / 128)


def _stage_bytes(ratios_slice, entry_bytes, max_running, num_cached, tokens):
    """Bytes a stage's pools take with `tokens` full tokens: the window pool is whole pages
    of max(10% of the tokens, the floor)."""
    skip = [False] * len(ratios_slice)
    window_token = entry_bytes["window"] * len(ratios_slice)
    no_window = bytes_per_full_token(ratios_slice, skip, entry_bytes, r_swa=0.0)
    floor_tokens = min_window_pages(max_running, 2048) * 128
    window_pages = math.ceil(max(0.1 * tokens, floor_tokens) / 128)
    return (
        max_running * state_bytes_per_request(ratios_slice, skip)
        + num_cached * snapshot_bytes(ratios_slice, skip)
        + tokens * no_window
        + window_pages * 128 * window_token
    )


@settings(max_examples=60, deadline=None)
@given(available=st.floats(0.2 * GIB, 64 * GIB), max_running=st.integers(1, 256))
@example(available=260791616.0, max_running=50)  # exactly one page and no rounding to spare
def test_gpu_sizing_fills_the_budget_up_to_one_page(available, max_running):
    # the sizing keeps back one window page for rounding the window pool up, needed or not
    window_page = 128 * FP8["window"] * len(HALF)
    try:
        cap = size_stage(
            0, 0, 8, RATIOS, SKIP, FP8, available_bytes=available, max_running_requests=max_running
        )
    except ValueError:
        assert _stage_bytes(HALF, FP8, max_running, 4 * max_running, 256) + window_page > available
        return
    used = _stage_bytes(HALF, FP8, max_running, 4 * max_running, cap.num_full_tokens)
    assert used <= available
    # tight up to one page, and the window page
    more = _stage_bytes(HALF, FP8, max_running, 4 * max_running, cap.num_full_tokens + 256)
    assert more + window_page > available


def test_too_little_memory_raises_naming_the_stage():
    with pytest.raises(ValueError, match="stage 1"):
        size_stage(1, 8, 16, RATIOS, SKIP, FP8, available_bytes=1e6, max_running_requests=64)


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="max_running_requests"):
        size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_running_requests=0)
    with pytest.raises(ValueError, match="not inside"):
        size_stage(0, 8, 17, RATIOS, SKIP, FP8, max_running_requests=1)
    with pytest.raises(ValueError, match="max_total_tokens"):
        size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_total_tokens=100, max_running_requests=1)
    with pytest.raises(ValueError, match="num_full_tokens"):
        StageCapacity(0, 0, 1, 300, 1, 10, 1, 0, 1.0)


def test_pipeline_capacity_is_the_minimum_and_stages_must_be_contiguous(caplog):
    caps = [
        size_stage(0, 0, 8, RATIOS, SKIP, FP8, max_total_tokens=8192, max_running_requests=4),
        size_stage(1, 8, 16, RATIOS, SKIP, FP8, max_total_tokens=4096, max_running_requests=2),
    ]
    with caplog.at_level(logging.INFO, logger="dsv4ray.cache"):
        pipe = pipeline_capacity(caps)
    assert (pipe.num_pages, pipe.num_state_slots) == (16, 2)
    assert "limited by stage 1" in caplog.text
    with pytest.raises(ValueError, match="contiguous"):
        pipeline_capacity([caps[1], caps[0]])


def test_each_stage_logs_its_slice_and_capacity(caplog):
    with caplog.at_level(logging.INFO, logger="dsv4ray.cache"):
        size_stage(1, 8, 16, RATIOS, SKIP, FP8, max_total_tokens=4096, max_running_requests=2)
    assert "stage 1 layers [8, 16) (8 of 16 model layers" in caplog.text
    assert "4096 full tokens" in caplog.text


def test_stages_sharing_a_device_split_its_memory_and_fit_it_together():
    # Stages of unequal cost on one GPU all measured the same free memory: sized from their
    # shares, the bytes their pools take at the pipeline's capacity add up to at most that.
    ratios, skip = [0, 4, 4, 4, 128, 0, 0, 128], [False] * 8
    ranges = [(0, 4), (4, 8)]
    free = 40 * GIB
    weights = [bytes_per_full_token(ratios[s:e], skip[s:e], FP8) for s, e in ranges]
    shares = share_devices([free, free], ["gpu-0", "gpu-0"], weights)
    assert shares[0] > shares[1] and math.isclose(sum(shares), free)
    caps = [
        size_stage(i, s, e, ratios, skip, FP8, available_bytes=shares[i], max_running_requests=8)
        for i, (s, e) in enumerate(ranges)
    ]
    tokens = pipeline_capacity(caps).num_full_tokens
    used = sum(tokens * w for w in weights)
    assert used <= free
    # each measured alone would have priced the whole free memory: twice too much together
    alone = [
        size_stage(i, s, e, ratios, skip, FP8, available_bytes=free, max_running_requests=8)
        for i, (s, e) in enumerate(ranges)
    ]
    assert sum(pipeline_capacity(alone).num_full_tokens * w for w in weights) > free


def test_stages_on_their_own_devices_or_cpus_keep_what_they_measured():
    assert share_devices([8.0, 6.0], ["a", "b"], [1.0, 3.0]) == [8.0, 6.0]
    assert share_devices([None, None], [None, None], [1.0, 1.0]) == [None, None]
    # three stages, two of them on one device: only those two split (the smaller measurement)
    assert share_devices([9.0, 8.0, 7.0], ["a", "b", "a"], [1.0, 5.0, 2.0]) == [7 / 3, 8.0, 14 / 3]


def _allocated_bytes(pools) -> int:
    """Every byte a StagePools holds: page buffers and compressor rings."""
    tensors = [*pools.window, *pools.c4, *pools.c128, *pools.indexer, *pools._c128_rings]
    tensors += [t for pair in pools.c4_state + pools.indexer_state for t in pair]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_each_stage_of_an_asymmetric_model_allocates_what_its_sizing_priced(dtype):
    """Seed 004's class on a model whose stages differ in ratios and IndexShare flags: stage 0
    holds three C4 layers, the last two sharing their top-k (no indexer); stage 1 two C4
    layers with indexers and a C128 layer, placed where stage 0's flags would drop an indexer.
    Sized for a memory budget, each stage's real pools fill it to within one page: a stage
    priced with another stage's ratios or flags over- or under-fills."""
    from dsv4ray.cache.page_layout import layout_for
    from dsv4ray.cache.pools import PoolSizes, StagePools
    from dsv4ray.config import ModelConfig
    from dsv4ray.model.tiny import PRESETS

    raw = {**PRESETS["tiny"], "num_hidden_layers": 8,
           "compress_ratios": [0, 4, 4, 4, 4, 128, 4, 0, 0],
           "index_topk_pattern": ["compute", "share", "share", "compute", "compute"]}  # fmt: skip
    cfg = ModelConfig.from_hf(raw)
    ratios, skip = list(cfg.layer_ratios), [s.skip_topk for s in cfg.layers]
    assert skip[:4] != skip[4:] and ratios[:4] != ratios[4:]
    entry_bytes = {k: layout_for(k, dtype).bytes_per_entry for k in ENTRY_KINDS}
    budget = 24 * (1 << 20)
    for stage, (start, end) in enumerate(split_layers(8, 2)):
        cap = size_stage(stage, start, end, ratios, skip, entry_bytes, available_bytes=budget,
                         max_running_requests=4)  # fmt: skip
        sizes = PoolSizes(cap.num_pages, cap.num_window_pages, cap.num_state_slots,
                          cap.num_cached_state_slots)  # fmt: skip
        pools = StagePools(cfg, start, end, sizes, dtype)
        used = _allocated_bytes(pools)
        # within a page of full tokens and the window page rounding may leave unused
        slack = 256 * cap.bytes_per_full_token + 128 * entry_bytes["window"] * (end - start)
        assert budget - slack < used <= budget, (stage, used, budget, slack)


def test_a_pipeline_on_one_device_splits_it_by_each_stages_own_slice(tiny_ckpt, tmp_path):
    # stage 0 holds three window-only layers, stage 1 the compressed ones (twice its cost per
    # token): priced by the whole model, the two shares came out equal and stage 1's half bound
    # the pipeline to 76% of the memory; by their own slices they fill it
    import json

    from dsv4ray.cache.formats import KINDS
    from dsv4ray.cache.page_layout import layout_for
    from dsv4ray.config import ModelConfig
    from dsv4ray.engine.config import EngineConfig
    from dsv4ray.worker.pool_sizing import size_pipeline

    raw = json.loads((Path(tiny_ckpt) / "config.json").read_text())
    raw.update(num_hidden_layers=8, compress_ratios=[0, 0, 0, 4, 4, 128, 4, 4, 0])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_hf(str(tmp_path))
    ec = EngineConfig(str(tmp_path), pp_size=2, kv_cache_dtype="fp8", device="cuda")
    entry_bytes = {k: layout_for(k, "fp8").bytes_per_entry for k in KINDS}
    skip = [spec.skip_topk for spec in cfg.layers]
    weights = [bytes_per_full_token(cfg.layer_ratios[s:e], skip[s:e], entry_bytes)
               for s, e in split_layers(8, 2)]  # fmt: skip
    assert weights[1] > 1.5 * weights[0]
    free = 40 * GIB
    tokens = size_pipeline(cfg, ec, [free, free], ["gpu-0", "gpu-0"]).num_full_tokens
    assert 0.95 * free <= tokens * sum(weights) <= free

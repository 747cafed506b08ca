"""Layer mapping of a stage: ids counted inside the stage, None outside (SPEC_SERVING 9)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4ray.cache.layer_mapping import (
    BufferInfo,
    buffer_infos,
    build_layer_mapping,
    split_layers,
    stage_layers,
    to_global,
    to_local,
)

# A 12-layer model; the stage [4, 8) holds the slice [4, 0, 128, 4]. Before the stage there are
# two C4 layers (1, 3) and one C128 layer (2): whole-model counting would give ids 2 and 1.
RATIOS = [0, 4, 128, 4, 4, 0, 128, 4, 128, 4, 0, 0]
NO_SKIP = [False] * len(RATIOS)


def test_slice_inside_a_bigger_model():
    mapping = build_layer_mapping(RATIOS, NO_SKIP, 4, 8)
    assert [info is None for info in mapping] == [True] * 4 + [False] * 4 + [True] * 4
    layer4, layer5, layer6, layer7 = mapping[4:8]
    assert (layer4.local_id, layer4.compress_ratio, layer4.compress_layer_id) == (0, 4, 0)
    assert (layer5.local_id, layer5.compress_ratio, layer5.compress_layer_id) == (1, 0, None)
    assert (layer6.local_id, layer6.compress_ratio, layer6.compress_layer_id) == (2, 128, 0)
    assert (layer7.local_id, layer7.compress_ratio, layer7.compress_layer_id) == (3, 4, 1)
    assert (layer4.indexer_layer_id, layer7.indexer_layer_id) == (0, 1)
    assert layer5.indexer_layer_id is None and layer6.indexer_layer_id is None


def test_sharing_layers_own_no_indexer_buffer():
    skip = list(NO_SKIP)
    skip[4] = True  # layer 4 reuses layer 3's top-k (from the previous stage)
    mapping = build_layer_mapping(RATIOS, skip, 4, 10)
    assert mapping[4].indexer_layer_id is None and not mapping[4].computes_topk
    assert mapping[4].compress_layer_id == 0  # it still owns its C4 KV buffer
    assert [mapping[i].indexer_layer_id for i in (7, 9)] == [0, 1]


def test_buffer_info_order_is_c4_then_indexer_then_c128():
    skip = list(NO_SKIP)
    skip[7] = True
    mapping = build_layer_mapping(RATIOS, skip, 2, 10)
    assert buffer_infos(mapping) == [
        BufferInfo("c4", 0, 3),
        BufferInfo("c4", 1, 4),
        BufferInfo("c4", 2, 7),
        BufferInfo("c4", 3, 9),
        BufferInfo("indexer", 0, 3),
        BufferInfo("indexer", 1, 4),
        BufferInfo("indexer", 2, 9),
        BufferInfo("c128", 0, 2),
        BufferInfo("c128", 1, 6),
        BufferInfo("c128", 2, 8),
    ]


def test_local_global_round_trip_and_out_of_stage_ids():
    start, end = 4, 8
    for layer_id in range(start, end):
        assert to_global(to_local(layer_id, start, end), start, end) == layer_id
    assert to_local(4, start, end) == 0
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match="outside this stage"):
            to_local(bad, start, end)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="outside this stage"):
            to_global(bad, start, end)


def test_per_stage_lists_are_indexed_through_to_local():
    """A per-local-layer buffer list read with a global id must go through to_local (seed 001)."""
    start, end = 4, 8
    mapping = build_layer_mapping(RATIOS, NO_SKIP, start, end)
    buffers = [f"window buffer of layer {i}" for i in range(start, end)]
    for info in stage_layers(mapping, start, end):
        local_id = to_local(info.layer_id, start, end)
        assert buffers[local_id] == f"window buffer of layer {info.layer_id}"
        assert info.local_id == to_local(info.layer_id, start, end)


def test_stage_layers_yields_only_the_stage_and_rejects_a_foreign_mapping():
    mapping = build_layer_mapping(RATIOS, NO_SKIP, 4, 8)
    assert [info.layer_id for info in stage_layers(mapping, 4, 8)] == [4, 5, 6, 7]
    with pytest.raises(RuntimeError, match="no LayerInfo"):
        list(stage_layers(mapping, 0, 6))


def test_split_layers_gives_the_remainder_to_earlier_stages():
    assert split_layers(43, 2) == [(0, 22), (22, 43)]
    assert split_layers(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="pp_size"):
        split_layers(4, 0)
    with pytest.raises(ValueError, match="num_layers"):
        split_layers(2, 3)


@pytest.mark.parametrize(
    ("ratios", "skip", "match"),
    [
        ([0, 4, 3], [False] * 3, "ratio 3"),
        ([0, 4, 4], [False, True, False], "first C4 layer"),
        ([0, 128, 4], [False, True, False], "not a C4 layer"),
        ([0, 4], [False], "skip_topk has 1"),
    ],
)
def test_invalid_patterns_raise(ratios, skip, match):
    with pytest.raises(ValueError, match=match):
        build_layer_mapping(ratios, skip, 0, len(ratios))


def test_stage_range_outside_the_model_raises():
    with pytest.raises(ValueError, match="not inside"):
        build_layer_mapping(RATIOS, NO_SKIP, 8, 13)
    with pytest.raises(ValueError, match="not inside"):
        build_layer_mapping(RATIOS, NO_SKIP, 5, 5)


@settings(max_examples=80, deadline=None)
@given(
    ratios=st.lists(st.sampled_from([0, 4, 128]), min_size=1, max_size=16),
    pp_size=st.integers(1, 4),
)
def test_stages_partition_the_model(ratios, pp_size):
    if len(ratios) < pp_size:
        return
    seen = []
    for start, end in split_layers(len(ratios), pp_size):
        mapping = build_layer_mapping(ratios, [False] * len(ratios), start, end)
        infos = list(stage_layers(mapping, start, end))
        assert sum(info is not None for info in mapping) == end - start
        seen += [info.layer_id for info in infos]
        for ratio in (4, 128):
            ids = [info.compress_layer_id for info in infos if info.compress_ratio == ratio]
            assert ids == list(range(sum(1 for r in ratios[start:end] if r == ratio)))
    assert seen == list(range(len(ratios)))

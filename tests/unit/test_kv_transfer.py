"""Stage pools handing a request's KV over with the real Mooncake engine (TCP on loopback, no
Ray): exactly the destination rows change, byte for byte, and the checksums of both sides agree
unless a byte was flipped on the wire."""

import zlib

import pytest
import torch

from dsv4ray.cache.pool_sizes import PoolSizes
from dsv4ray.cache.pools import StagePools
from dsv4ray.config import ModelConfig
from dsv4ray.engine.handoff import DeviceIds, KVCheck, KVDestination, KVSend
from dsv4ray.engine.pd.handoff_plan import compare_checksums, layer_rows, trailing_windows
from dsv4ray.worker.pd.kv_export import KVPort, checksum
from dsv4ray.worker.pd.transfer import MooncakeTransport
from dsv4ray.worker.req_table import ReqTable

SIZES = PoolSizes(num_pages=6, num_window_pages=6, num_state_slots=3, num_cached_state_slots=1)
SPLITS = [([(0, 3), (3, 6)], [(0, 6)]), ([(0, 6)], [(0, 2), (2, 6)]), ([(0, 6)], [(0, 6)])]


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    return ModelConfig.from_hf(tiny_ckpt)


@pytest.fixture(scope="module")
def share_cfg(tiny_ckpt):
    """The tiny model with IndexShare: its C4 layers 1, 3, 4 have compress ids 0, 1, 2 and
    indexers 0, none, 1 (an indexer id is not a compress id)."""
    import json
    import os

    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf({**raw, "index_topk_pattern": ["compute", "share", "compute"]})
    ids = [(i.compress_layer_id, i.indexer_layer_id) for i in _infos(cfg) if i.compress_ratio == 4]
    assert ids == [(0, 0), (1, None), (2, 1)]
    return cfg


def _infos(cfg):
    from dsv4ray.cache.layer_mapping import build_layer_mapping

    skip = [spec.skip_topk for spec in cfg.layers]
    mapping = build_layer_mapping(cfg.layer_ratios, skip, 0, cfg.num_hidden_layers)
    return [info for info in mapping if info is not None]


@pytest.fixture(scope="module")
def ports(cfg):
    """ports(ranges, dtype, seed=None, model=None) -> a KVPort per stage range of the tiny
    model (or ``model``), reused across tests (a transfer engine takes about a second to stop):
    random bytes with a seed, else fresh pools (zeros, ring scores -inf)."""
    made = {}

    def get(ranges, dtype, seed=None, model=None):
        model = model or cfg
        key = (tuple(ranges), dtype, seed is None, id(model))
        if key not in made:
            made[key] = [
                KVPort(StagePools(model, s, e, SIZES, dtype), MooncakeTransport("127.0.0.1"))
                for s, e in ranges
            ]
        for port in made[key]:
            for (kind, _), view in port.views.items():
                if seed is not None:
                    gen = torch.Generator().manual_seed(seed + port.pools.start)
                    view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8))
                elif kind.endswith("score"):
                    view.view(torch.float32).fill_(float("-inf"))
                else:
                    view.zero_()
        return made[key]

    return get


def table_of(ids: DeviceIds) -> ReqTable:
    windows = [-1] * (max(idx for idx, _ in ids.window_pages) + 1)
    for idx, page in ids.window_pages:
        windows[idx] = page
    return ReqTable(ids.state_slot, list(ids.page_ids), windows)


def handoff(prefill, decode, num_tokens, corrupt=False):
    src = DeviceIds(
        (4, 2), tuple((i, 5 - k) for k, i in enumerate(trailing_windows(num_tokens))), 2
    )
    dst = DeviceIds(
        (1, 2), tuple((i, 3 + k) for k, i in enumerate(trailing_windows(num_tokens))), 0
    )
    dest = KVDestination(tuple(p.endpoint for p in decode), dst)
    reports = [
        p.send(KVSend("r", num_tokens, dest, corrupt and i == 0), table_of(src))
        for i, p in enumerate(prefill)
    ]
    checks = [p.check(KVCheck("r", num_tokens, dst)) for p in decode]
    return src, dst, reports, checks


@pytest.mark.parametrize(("prefill_ranges", "decode_ranges"), SPLITS)
def test_destination_rows_equal_the_source_rows_and_nothing_else_changes(
    cfg, ports, prefill_ranges, decode_ranges
):
    assert_exact_handoff(cfg, ports(prefill_ranges, "fp8", seed=1), ports(decode_ranges, "fp8"))


def test_an_index_share_model_hands_each_indexer_to_its_own_buffer(share_cfg, ports):
    prefill = ports([(0, 3), (3, 6)], "fp8", seed=2, model=share_cfg)
    assert_exact_handoff(share_cfg, prefill, ports([(0, 6)], "fp8", model=share_cfg))


def test_each_layers_checksum_is_the_crc32_of_its_rows_in_order(cfg, ports):
    prefill = ports([(0, 3), (3, 6)], "fp8", seed=3)
    src, _, reports, _ = handoff(prefill, ports([(0, 6)], "fp8"), 300)
    for port, report in zip(prefill, reports, strict=True):
        expected: dict[int, tuple[int, int]] = {}  # layer -> (crc, bytes) over its rows in order
        for buf, rows in layer_rows(port.endpoint.buffers, 300, src):
            data = port.views[(buf.kind, buf.layer_id)][rows].numpy().tobytes()
            crc, size = expected.get(buf.layer_id, (0, 0))
            expected[buf.layer_id] = (zlib.crc32(data, crc), size + len(data))
        assert dict(report.checksums) == {
            layer: f"crc32:{crc:08x}:{size}" for layer, (crc, size) in expected.items()
        }
        assert report.checksum_s > 0


def assert_exact_handoff(cfg, prefill, decode) -> None:
    """A 300-token handoff: every destination row equals its source row, nothing else changes,
    and both sides' checksums agree."""
    before = [{key: view.clone() for key, view in port.views.items()} for port in decode]
    src, dst, reports, checks = handoff(prefill, decode, 300)
    assert all(r.error is None for r in reports) and sum(r.num_bytes for r in reports) > 0
    assert compare_checksums(reports, checks, cfg.num_hidden_layers) is None
    for port, old in zip(decode, before):
        for buf, rows in layer_rows(port.endpoint.buffers, 300, dst):
            source = next(p for p in prefill if p.pools.start <= buf.layer_id < p.pools.end)
            src_rows = dict(layer_rows(source.endpoint.buffers, 300, src))
            src_view = source.views[(buf.kind, buf.layer_id)]
            src_buf = next(b for b in src_rows if (b.kind, b.layer_id) == (buf.kind, buf.layer_id))
            key = (buf.kind, buf.layer_id)
            view = port.views[key]
            assert torch.equal(view[rows], src_view[src_rows[src_buf]]), key
            untouched = [i for i in range(view.shape[0]) if i not in rows]
            assert torch.equal(view[untouched], old[key][untouched]), key


@pytest.mark.parametrize("num_tokens", [128, 256, 257])
def test_c128_rings_move_only_off_a_128_boundary(ports, num_tokens):
    prefill, decode = ports([(0, 6)], "fp32", seed=2), ports([(0, 6)], "fp32")
    _, dst, reports, _ = handoff(prefill, decode, num_tokens)
    assert reports[0].error is None
    ring = decode[0].views[("c128_kv", 2)]
    assert bool(ring[dst.state_slot].any()) == (num_tokens % 128 != 0)
    assert decode[0].views[("c4_kv", 1)][dst.state_slot].any()


def test_a_byte_flipped_on_the_wire_fails_the_checksum(ports):
    prefill, decode = ports([(0, 3), (3, 6)], "fp8", seed=3), ports([(0, 6)], "fp8")
    _, _, reports, checks = handoff(prefill, decode, 200, corrupt=True)
    assert all(r.error is None for r in reports)
    assert compare_checksums(reports, checks, 6) == "checksum mismatch on layers [0]"


def test_a_format_mismatch_is_refused_before_any_write(ports):
    prefill, decode = ports([(0, 6)], "fp8", seed=4), ports([(0, 6)], "bf16")
    _, _, reports, _ = handoff(prefill, decode, 200)
    assert "bytes here" in reports[0].error
    written = [view for (kind, _), view in decode[0].views.items() if not kind.endswith("score")]
    assert not any(view.any() for view in written)  # scores start at -inf, the rest at 0


def test_checksum_covers_every_byte_and_the_length():
    data = torch.randint(
        0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    base = checksum([data[:1000], data[1000:]])
    assert base == checksum([data])  # only the bytes and their order count, not the split
    for pos in (0, 1, 2047, 4095):
        flipped = data.clone()
        flipped[pos] ^= 1
        assert checksum([flipped]) != base
    assert checksum([data[:-1]]) != base and checksum([data, data[:0]]) == base

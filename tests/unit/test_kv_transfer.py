"""Stage pools handing a request's KV over with the real Mooncake engine (TCP on loopback, no
Ray): exactly the destination rows change, byte for byte, and the checksums of both sides agree
unless a byte was flipped on the wire."""

import pytest
import torch

from dsv4ray.cache.pools import PoolSizes, StagePools
from dsv4ray.config import ModelConfig
from dsv4ray.engine.handoff import DeviceIds, KVCheck, KVDestination, KVSend
from dsv4ray.engine.handoff_plan import compare_checksums, layer_rows, trailing_windows
from dsv4ray.worker.batch import ReqTable
from dsv4ray.worker.kv_export import KVPort, checksum
from dsv4ray.worker.transfer import MooncakeTransport

SIZES = PoolSizes(num_pages=6, num_window_pages=6, num_state_slots=3, num_cached_state_slots=1)
SPLITS = [([(0, 3), (3, 6)], [(0, 6)]), ([(0, 6)], [(0, 2), (2, 6)]), ([(0, 6)], [(0, 6)])]


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    return ModelConfig.from_hf(tiny_ckpt)


@pytest.fixture(scope="module")
def ports(cfg):
    """ports(ranges, dtype, seed=None) -> a KVPort per stage range, reused across tests (a
    transfer engine takes about a second to stop): random bytes with a seed, else fresh pools
    (zeros, ring scores -inf)."""
    made = {}

    def get(ranges, dtype, seed=None):
        key = (tuple(ranges), dtype, seed is None)
        if key not in made:
            made[key] = [
                KVPort(StagePools(cfg, s, e, SIZES, dtype), MooncakeTransport("127.0.0.1"))
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
    prefill = ports(prefill_ranges, "fp8", seed=1)
    decode = ports(decode_ranges, "fp8")
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

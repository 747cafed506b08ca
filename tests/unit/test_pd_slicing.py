"""Destination slicing of prefill/decode handoffs: each prefill stage writes only its own layers,
into the buffers the owning decode stage holds for them (SPEC_SERVING 5, 8, 9)."""

import pytest

from dsv4ray.cache.layer_mapping import build_layer_mapping
from dsv4ray.engine.handoff import (
    BufferDesc,
    CheckReport,
    DeviceIds,
    KVDestination,
    PrefillResult,
    SendReport,
    StageEndpoint,
)
from dsv4ray.engine.pd.handoff_plan import (
    HandoffError,
    check_reports,
    coalesce,
    compare_checksums,
    layout_signature,
    plan_writes,
    rows_of,
    slice_endpoints,
    stage_buffers,
    trailing_windows,
)

# A 6-layer model split [0, 4, 128 | 4, 4, 128]: layer 3's C4 buffer is the first of the second
# stage but the second of a one-stage pipeline.
RATIOS = [0, 4, 128, 4, 4, 128]
NO_SKIP = [False] * len(RATIOS)
ROW_BYTES = {
    "window": 1152, "c4": 576, "indexer": 128, "c128": 64, "c4_kv": 320, "c4_score": 320,
    "indexer_kv": 96, "indexer_score": 96, "c128_kv": 640, "c128_score": 640,
}  # fmt: skip
NUM_ROWS = 64
BUFFER_SPAN = 1 << 20  # address space per buffer in these fake endpoints


def endpoint(session: str, start: int, end: int, base: int, dtype: str = "fp8") -> StageEndpoint:
    mapping = build_layer_mapping(RATIOS, NO_SKIP, start, end)
    bufs = tuple(
        BufferDesc(kind, layer, base + i * BUFFER_SPAN, ROW_BYTES[kind], NUM_ROWS)
        for i, (kind, layer, _) in enumerate(stage_buffers(mapping, start, end))
    )
    return StageEndpoint(session, start, end, dtype, bufs)


def ids(num_tokens: int, first_page: int, first_window: int, slot: int) -> DeviceIds:
    pages = tuple(range(first_page, first_page + -(-num_tokens // 256)))
    windows = tuple((idx, first_window + k) for k, idx in enumerate(trailing_windows(num_tokens)))
    return DeviceIds(pages, windows, slot)


def landing(address: int, endpoints) -> tuple[str, BufferDesc]:
    for ep in endpoints:
        for buf in ep.buffers:
            if buf.base <= address < buf.base + buf.row_bytes * buf.num_rows:
                return ep.session, buf
    raise AssertionError(f"address {address:#x} is in no decode buffer")


def written(src: StageEndpoint, decode: list[StageEndpoint], num_tokens: int):
    """[(src buffer, dst session, dst buffer, bytes)] of every write a prefill stage plans."""
    dest = KVDestination(tuple(decode), ids(num_tokens, 10, 20, 3))
    plan = plan_writes(src, dest, num_tokens, ids(num_tokens, 0, 5, 1))
    out = []
    for session, writes in plan.writes.items():
        for src_addr, dst_addr, size in writes:
            _, src_buf = landing(src_addr, [src])
            dst_session, dst_buf = landing(dst_addr + size - 1, decode)
            assert landing(dst_addr, decode) == (dst_session, dst_buf)  # inside one buffer
            assert dst_session == session
            out.append((src_buf, dst_session, dst_buf, size))
    return out


def test_stage_buffers_count_within_the_stage():
    second = build_layer_mapping(RATIOS, NO_SKIP, 3, 6)
    whole = build_layer_mapping(RATIOS, NO_SKIP, 0, 6)
    assert ("c4", 3, 0) in stage_buffers(second, 3, 6)
    assert ("c4", 3, 1) in stage_buffers(whole, 0, 6)
    assert ("c128", 5, 0) in stage_buffers(second, 3, 6)
    assert ("c128", 5, 1) in stage_buffers(whole, 0, 6)
    assert [b for b in stage_buffers(second, 3, 6) if b[0] == "window"] == [
        ("window", 3, 0),
        ("window", 4, 1),
        ("window", 5, 2),
    ]


@pytest.mark.parametrize("num_tokens", [1, 127, 128, 129, 255, 256, 257, 300])
def test_prefill_pp2_into_decode_pp1_writes_each_layer_once_into_its_own_buffer(num_tokens):
    decode = [endpoint("d0", 0, 6, 1 << 40)]
    prefill = [endpoint("p0", 0, 3, 1 << 36), endpoint("p1", 3, 6, 1 << 37)]
    seen = []
    for src in prefill:
        for src_buf, _, dst_buf, _ in written(src, decode, num_tokens):
            assert src.start <= src_buf.layer_id < src.end  # only its own layers
            assert (dst_buf.kind, dst_buf.layer_id) == (src_buf.kind, src_buf.layer_id)
            seen.append((dst_buf.kind, dst_buf.layer_id))
    expected = {
        (b.kind, b.layer_id)
        for b in decode[0].buffers
        if not (b.kind.startswith("c128_") and num_tokens % 128 == 0)
    }
    assert set(seen) == expected


def test_prefill_pp1_into_decode_pp2_sends_each_layer_to_its_owner():
    decode = [endpoint("d0", 0, 3, 1 << 40), endpoint("d1", 3, 6, 1 << 41)]
    moves = written(endpoint("p0", 0, 6, 1 << 36), decode, 300)
    for src_buf, session, dst_buf, _ in moves:
        assert session == ("d0" if src_buf.layer_id < 3 else "d1")
        assert (dst_buf.kind, dst_buf.layer_id) == (src_buf.kind, src_buf.layer_id)
    assert {b.layer_id for _, s, b, _ in moves if s == "d1"} == {3, 4, 5}


def test_slices_cut_endpoints_to_the_prefill_stage_layers():
    decode = [endpoint("d0", 0, 2, 1 << 40), endpoint("d1", 2, 6, 1 << 41)]
    cut = slice_endpoints(decode, 1, 4)
    assert [(ep.session, ep.start, ep.end) for ep in cut] == [("d0", 1, 2), ("d1", 2, 4)]
    assert {b.layer_id for ep in cut for b in ep.buffers} == {1, 2, 3}
    with pytest.raises(HandoffError, match="not each exactly once"):
        slice_endpoints([decode[1]], 0, 6)


def test_rows_around_page_edges():
    device = DeviceIds(tuple(range(100, 110)), tuple((i, 50 + i) for i in range(20)), 7)
    assert list(trailing_windows(128)) == [0] and list(trailing_windows(129)) == [0, 1]
    assert list(trailing_windows(256)) == [1] and list(trailing_windows(1)) == [0]
    assert rows_of("window", 257, device) == [51, 52]
    assert rows_of("c4", 256, device) == [100] and rows_of("c4", 257, device) == [100, 101]
    assert rows_of("c128_kv", 256, device) == [] and rows_of("c128_kv", 255, device) == [7]
    assert rows_of("indexer_score", 128, device) == [7]


def test_contiguous_rows_coalesce_into_one_write():
    assert coalesce([5, 6, 7], [10, 11, 13]) == [(5, 10, 2), (7, 13, 1)]
    assert coalesce([3, 4, 5, 6], [0, 1, 2, 3]) == [(3, 0, 4)]
    assert coalesce([], []) == []
    src, dest = endpoint("p", 0, 6, 1 << 36), endpoint("d", 0, 6, 1 << 40)
    plan = plan_writes(src, KVDestination((dest,), ids(1000, 10, 20, 3)), 1000, ids(1000, 0, 5, 1))
    assert len(plan.writes["d"]) == len(src.buffers)  # each buffer's rows are one run


def test_writes_that_would_corrupt_are_refused():
    src = endpoint("p", 0, 6, 1 << 36)
    other = StageEndpoint("d", 0, 6, "fp8", tuple(
        BufferDesc(b.kind, b.layer_id, b.base, b.row_bytes * 2, b.num_rows) for b in src.buffers
    ))  # fmt: skip
    with pytest.raises(HandoffError, match="bytes here"):
        plan_writes(src, KVDestination((other,), ids(300, 0, 0, 1)), 300, ids(300, 0, 0, 1))
    dest = KVDestination((endpoint("d", 0, 6, 1 << 40),), ids(300, 10, 20, 3))
    missing_window = DeviceIds(tuple(range(2)), ((0, 4),), 1)  # window 1 not resident
    with pytest.raises(HandoffError, match="not resident"):
        plan_writes(src, dest, 300, missing_window)
    beyond = KVDestination(dest.endpoints, ids(300, NUM_ROWS - 1, 20, 3))
    with pytest.raises(HandoffError, match="outside"):
        plan_writes(src, beyond, 300, ids(300, 0, 5, 1))


def report(start, end, dtype="fp8", error=None, decode=None):
    bufs = [b for ep in decode for b in ep.buffers]
    sums = tuple((layer, f"sum{layer}") for layer in range(start, end))
    return SendReport("r", start, end, layout_signature(dtype, start, end, bufs), sums, error=error)


def test_reports_are_checked_for_layers_signature_and_errors():
    decode = [endpoint("d0", 0, 3, 1 << 40), endpoint("d1", 3, 6, 1 << 41)]
    good = (report(0, 3, decode=decode), report(3, 6, decode=decode))
    assert check_reports(PrefillResult("k", 1, reports=good), decode, 6) is None
    twice = (report(0, 4, decode=decode), report(3, 6, decode=decode))
    assert "sent layers" in check_reports(PrefillResult("k", 1, reports=twice), decode, 6)
    bf16 = (report(0, 3, "bf16", decode=decode), good[1])
    assert "layout" in check_reports(PrefillResult("k", 1, reports=bf16), decode, 6)
    failed = (good[0], report(3, 6, error="refused", decode=decode))
    assert check_reports(PrefillResult("k", 1, reports=failed), decode, 6) == "refused"
    checks = [CheckReport("r", 0, 6, tuple((layer, f"sum{layer}") for layer in range(6)))]
    assert compare_checksums(good, checks, 6) is None
    bad = [CheckReport("r", 0, 6, tuple((layer, f"sum{layer % 5}") for layer in range(6)))]
    assert compare_checksums(good, bad, 6) == "checksum mismatch on layers [5]"

"""Which rows a prefill/decode handoff moves, the writes that move them, and how both sides check
them (pure Python on ints; addresses are the plain ints of ``BufferDesc``).

Rows of one request with n prompt tokens, per (kind, layer) buffer, listed in the same logical
order on both sides, so that a row list read with prefill ids and one read with decode ids pair:

    window                   trailing_windows(n): the window pages the next token's window reads
    c4, indexer, c128        full pages [0, cdiv(n, 256)) (one page id names a page in each pool)
    c4_kv, c4_score,         the request's state-slot row (a row is the request's whole ring)
    indexer_kv, indexer_score
    c128_kv, c128_score      the state-slot row when n % 128; none at a 128 boundary (the next
                             token starts a block and reads no ring row)

A prefill stage writes its own layers only, each to the decode stage whose range holds it
(``slice_endpoints``); runs of consecutive rows on both sides become one (src, dst, len) write.
Each side checksums a layer's rows in this order: prefill over what it sends, decode over what
it received; with the layout signature (format, page sizes, layer range, row sizes) they decide
whether the decode engine may run the request on the received bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dsv4ray.cache.formats import PAGE_SIZE, WINDOW_PAGE_SIZE
from dsv4ray.cache.layer_mapping import LayerInfo, stage_layers
from dsv4ray.engine.handoff import (
    BufferDesc,
    CheckReport,
    DeviceIds,
    KVDestination,
    PrefillResult,
    SendReport,
    StageEndpoint,
)

PAGE_KINDS = ("window", "c4", "indexer", "c128")
STATE_KINDS = ("c4_kv", "c4_score", "indexer_kv", "indexer_score", "c128_kv", "c128_score")
BUFFER_KINDS = PAGE_KINDS + STATE_KINDS  # a layer's buffers are listed in this order
C128_RATIO = 128


class HandoffError(ValueError):
    """A destination this stage cannot write without corrupting something: nothing is sent."""


def trailing_windows(num_tokens: int, window: int = WINDOW_PAGE_SIZE) -> range:
    """Window page indices holding positions [n - 127, n): what position n's window reads."""
    return range(max(0, num_tokens - window + 1) // window, (num_tokens - 1) // window + 1)


def _layer_buffers(info: LayerInfo) -> list[tuple[str, int]]:
    """(kind, index into the stage pools' list of that kind) of one layer's buffers."""
    out = [("window", info.local_id)]
    if info.compress_ratio == 4:
        out += [(kind, info.compress_layer_id) for kind in ("c4", "c4_kv", "c4_score")]
    if info.indexer_layer_id is not None:
        idx = info.indexer_layer_id
        out += [(kind, idx) for kind in ("indexer", "indexer_kv", "indexer_score")]
    if info.compress_ratio == C128_RATIO:
        out += [(kind, info.compress_layer_id) for kind in ("c128", "c128_kv", "c128_score")]
    return sorted(out, key=lambda item: BUFFER_KINDS.index(item[0]))


def stage_buffers(
    mapping: Sequence[LayerInfo | None], start: int, end: int
) -> list[tuple[str, int, int]]:
    """(kind, global layer id, index into the pools' per-kind list) of every buffer a stage of
    layers [start, end) holds: layer-major, kinds in BUFFER_KINDS order."""
    return [
        (kind, info.layer_id, idx)
        for info in stage_layers(mapping, start, end)
        for kind, idx in _layer_buffers(info)
    ]


def rows_of(kind: str, num_tokens: int, ids: DeviceIds) -> list[int]:
    """The rows of one (kind, layer) buffer that a handoff of num_tokens tokens moves, in the
    side's own ids (-1 where a window page is not resident: an error for the caller)."""
    if kind == "window":
        windows = dict(ids.window_pages)
        return [windows.get(idx, -1) for idx in trailing_windows(num_tokens)]
    if kind in PAGE_KINDS:
        return list(ids.page_ids[: -(-num_tokens // PAGE_SIZE)])
    if kind.startswith("c128") and num_tokens % C128_RATIO == 0:
        return []
    return [ids.state_slot]


def layer_rows(
    buffers: Iterable[BufferDesc], num_tokens: int, ids: DeviceIds
) -> list[tuple[BufferDesc, list[int]]]:
    """Each buffer with its rows, in buffer order (what both sides checksum, layer by layer)."""
    return [(buf, rows_of(buf.kind, num_tokens, ids)) for buf in buffers]


def coalesce(src_rows: Sequence[int], dst_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src row, dst row, count) runs over which both row lists go up by one."""
    if len(src_rows) != len(dst_rows):
        raise HandoffError(f"{len(src_rows)} source rows against {len(dst_rows)} destination rows")
    runs: list[list[int]] = []
    for src, dst in zip(src_rows, dst_rows, strict=True):
        last = runs[-1] if runs else None
        if last is not None and src == last[0] + last[2] and dst == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([src, dst, 1])
    return [(src, dst, count) for src, dst, count in runs]


def slice_endpoints(
    endpoints: Sequence[StageEndpoint], start: int, end: int
) -> list[StageEndpoint]:
    """The decode endpoints a prefill stage of layers [start, end) writes to, each cut down to
    the buffers of those layers; every layer of the range must belong to exactly one."""
    out = []
    for ep in endpoints:
        lo, hi = max(start, ep.start), min(end, ep.end)
        if lo < hi:
            bufs = tuple(b for b in ep.buffers if lo <= b.layer_id < hi)
            out.append(StageEndpoint(ep.session, lo, hi, ep.dtype, bufs))
    covered = sorted(layer for ep in out for layer in range(ep.start, ep.end))
    if covered != list(range(start, end)):
        raise HandoffError(
            f"decode stages hold layers {covered} of [{start}, {end}), not each exactly once"
        )
    return out


@dataclass
class WritePlan:
    """One prefill stage's writes for one request: (src address, dst address, bytes) per decode
    session, and the rows it checksums."""

    writes: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    rows: list[tuple[BufferDesc, list[int]]] = field(default_factory=list)
    num_bytes: int = 0


def plan_writes(
    src: StageEndpoint, dest: KVDestination, num_tokens: int, src_ids: DeviceIds
) -> WritePlan:
    """The writes of src's layers into the decode stages that own them. HandoffError when a
    buffer is missing there, row sizes differ, or a row id is outside a buffer."""
    targets = {
        (buf.kind, buf.layer_id): (ep.session, buf)
        for ep in slice_endpoints(dest.endpoints, src.start, src.end)
        for buf in ep.buffers
    }
    plan = WritePlan(rows=layer_rows(src.buffers, num_tokens, src_ids))
    for buf, src_rows in plan.rows:
        if (buf.kind, buf.layer_id) not in targets:
            raise HandoffError(f"no decode buffer for {buf.kind} of layer {buf.layer_id}")
        session, dst = targets[(buf.kind, buf.layer_id)]
        if dst.row_bytes != buf.row_bytes:
            raise HandoffError(
                f"{buf.kind} rows of layer {buf.layer_id}: {buf.row_bytes} bytes here, "
                f"{dst.row_bytes} at the decode stage"
            )
        dst_rows = rows_of(buf.kind, num_tokens, dest.device)
        _check_rows(src_rows, buf, "source")
        _check_rows(dst_rows, dst, "destination")
        size = buf.row_bytes
        for s, d, count in coalesce(src_rows, dst_rows):
            plan.writes.setdefault(session, []).append(
                (buf.base + s * size, dst.base + d * size, count * size)
            )
            plan.num_bytes += count * size
    return plan


def _check_rows(rows: Sequence[int], buf: BufferDesc, side: str) -> None:
    bad = [row for row in rows if not 0 <= row < buf.num_rows]
    if bad:
        raise HandoffError(
            f"{side} {buf.kind} rows {bad[:4]} of layer {buf.layer_id} are outside its "
            f"{buf.num_rows} rows (-1: a window page that is not resident)"
        )


def layout_signature(dtype: str, start: int, end: int, buffers: Iterable[BufferDesc]) -> str:
    """Format, page sizes, layer range and each layer's buffer kinds with their row bytes
    (entry sizes times entries per page, ring rows times width), e.g.
    'fp8/page256/window128/layers0-2/0:window=74880;1:window=74880,c4=37440,...'."""
    layers: dict[int, list[str]] = {}
    for buf in buffers:
        if start <= buf.layer_id < end:
            layers.setdefault(buf.layer_id, []).append(f"{buf.kind}={buf.row_bytes}")
    body = ";".join(f"{layer}:{','.join(parts)}" for layer, parts in sorted(layers.items()))
    return f"{dtype}/page{PAGE_SIZE}/window{WINDOW_PAGE_SIZE}/layers{start}-{end}/{body}"


def check_reports(
    result: PrefillResult, endpoints: Sequence[StageEndpoint], num_layers: int
) -> str | None:
    """Why a prefill's reports cannot be used, or None: no error, every layer sent by exactly
    one stage with a checksum, and each stage's signature equal to the decode stages' own for
    the same layers."""
    if result.error is not None:
        return result.error
    failed = [r.error for r in result.reports if r.error is not None]
    if failed:
        return failed[0]
    layers = sorted(layer for r in result.reports for layer in range(r.start, r.end))
    summed = sorted(layer for r in result.reports for layer, _ in r.checksums)
    if layers != list(range(num_layers)) or summed != layers:
        return f"the prefill stages sent layers {layers} with checksums for {summed}"
    mine = [buf for ep in endpoints for buf in ep.buffers]
    for report in result.reports:
        expected = layout_signature(endpoints[0].dtype, report.start, report.end, mine)
        if report.signature != expected:
            return (
                f"layout of layers [{report.start}, {report.end}) differs: prefill sent "
                f"{report.signature!r}, decode holds {expected!r}"
            )
    return None


def compare_checksums(
    reports: Sequence[SendReport], checks: Sequence[CheckReport], num_layers: int
) -> str | None:
    """None when every layer's received checksum equals the one sent, else which differ."""
    sent = dict(pair for report in reports for pair in report.checksums)
    got = dict(pair for check in checks for pair in check.checksums)
    if sorted(got) != list(range(num_layers)):
        return f"the decode stages checked layers {sorted(got)} of {num_layers}"
    bad = [layer for layer in range(num_layers) if sent.get(layer) != got[layer]]
    return f"checksum mismatch on layers {bad}" if bad else None

"""A stage's side of prefill/decode handoffs (engine/pd/handoff_plan.py plans them).

``KVPort`` registers every pool buffer of the stage with a transport once and reports the
stage's endpoint. On a prefill stage it runs a plan's KVSends after the step computed (the
request's pages and rings are final for this stage's layers): checksum per layer of exactly the
rows it sends, then the coalesced writes, one batch per decode session. On a decode stage it runs
a plan's KVChecks: the same checksums over the rows it received. Buffers are seen as rows:

    page kinds    pages [num_pages, page_bytes] uint8 (a row = one page)
    state kinds   a ring [num_rows, ring, width] fp32 seen as [num_rows, ring * width * 4] uint8
                  (a row = one request's whole ring)
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterable

import torch

from dsv4ray.cache.pools import StagePools
from dsv4ray.engine.handoff import (
    BufferDesc,
    CheckReport,
    DeviceIds,
    HandoffReports,
    KVCheck,
    KVSend,
    SendReport,
    StageEndpoint,
)
from dsv4ray.engine.pd.handoff_plan import (
    HandoffError,
    WritePlan,
    layer_rows,
    layout_signature,
    plan_writes,
    stage_buffers,
)
from dsv4ray.engine.plan import StageResult, StepPlan
from dsv4ray.worker.req_table import ReqTable

log = logging.getLogger("dsv4ray.worker")


def pool_buffers(pools: StagePools) -> list[tuple[str, int, torch.Tensor]]:
    """(kind, global layer id, uint8 [num_rows, row_bytes] view) of every buffer of the stage,
    in ``stage_buffers`` order."""
    lists = {"window": pools.window, "c4": pools.c4, "indexer": pools.indexer, "c128": pools.c128}
    rings = {"c4": pools.c4_state, "indexer": pools.indexer_state, "c128": pools.c128_state}
    for name, pairs in rings.items():
        lists[f"{name}_kv"] = [kv for kv, _ in pairs]
        lists[f"{name}_score"] = [score for _, score in pairs]
    return [
        (kind, layer_id, _as_rows(lists[kind][idx]))
        for kind, layer_id, idx in stage_buffers(pools.mapping, pools.start, pools.end)
    ]


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(tensor.shape[0], -1).view(torch.uint8)


def checksum(parts: Iterable[torch.Tensor]) -> str:
    """CRC-32 over the bytes of parts in order, with their total length: 'crc32:<hex>:<bytes>'.
    CRC-32 catches every error of one byte (and every burst up to 32 bits)."""
    crc, num_bytes = 0, 0
    for part in parts:
        data = part.contiguous().cpu().numpy()  # no copy on CPU
        crc = zlib.crc32(data, crc)
        num_bytes += data.nbytes
    return f"crc32:{crc:08x}:{num_bytes}"


class KVPort:
    """A stage's pools as handoffs see them: buffers by (kind, layer), registered once."""

    def __init__(self, pools: StagePools, transport) -> None:
        self.pools, self.transport = pools, transport
        self.views = {(kind, layer): view for kind, layer, view in pool_buffers(pools)}
        for view in self.views.values():
            transport.register(view)
        self.scratch = torch.zeros(64, dtype=torch.uint8, device=pools.window[0].device)
        transport.register(self.scratch)  # the source of the test hook's flipped byte
        descs = tuple(
            BufferDesc(kind, layer, view.data_ptr(), view.shape[1], view.shape[0])
            for (kind, layer), view in self.views.items()
        )
        self.endpoint = StageEndpoint(transport.session, pools.start, pools.end, pools.dtype, descs)
        self.signature = layout_signature(pools.dtype, pools.start, pools.end, descs)

    def send(self, send: KVSend, table: ReqTable | None) -> SendReport:
        """Writes this stage's layers of the request; the report's error says why not."""
        report = SendReport(send.req_id, self.pools.start, self.pools.end, self.signature)
        if table is None:
            return _failed(report, f"request {send.req_id!r} is unknown to this stage")
        src_ids = DeviceIds(tuple(table.page_ids.tolist()), table.resident_windows(),
                            table.state_slot)  # fmt: skip
        try:
            plan = plan_writes(self.endpoint, send.dest, send.num_tokens, src_ids)
        except HandoffError as exc:
            return _failed(report, f"stage {self._range}: {exc}")
        self._sync()  # the step's kernels wrote these pages; the engine reads memory directly
        start = time.perf_counter()
        sums = self._checksums(plan.rows)
        summed = time.perf_counter()
        try:
            for session, writes in plan.writes.items():
                self.transport.write(session, writes)
            if send.corrupt:
                self._flip_one_byte(plan)
        except Exception as exc:  # a dead peer or a refused region: the decode recomputes
            log.error("handoff of %s from stage %s failed: %s", send.req_id, self._range, exc)
            return _failed(report, f"stage {self._range}: {type(exc).__name__}: {exc}"[:300])
        return SendReport(
            send.req_id,
            self.pools.start,
            self.pools.end,
            self.signature,
            sums,
            plan.num_bytes,
            time.perf_counter() - summed,
            summed - start,
        )

    def check(self, check: KVCheck) -> CheckReport:
        """Checksums of the rows of this stage's layers that the request received."""
        rows = layer_rows(self.endpoint.buffers, check.num_tokens, check.device)
        return CheckReport(check.req_id, self.pools.start, self.pools.end, self._checksums(rows))

    def _checksums(self, rows: list[tuple[BufferDesc, list[int]]]) -> tuple[tuple[int, str], ...]:
        """CRC-32 per layer of the rows in order: every row id goes to the device at once, and
        each layer's rows are gathered into one buffer read back at once (a read-back a buffer
        would wait on the device tens of times a handoff)."""
        if not rows:
            return ()
        device = self.scratch.device
        ids = torch.tensor([i for _, row_ids in rows for i in row_ids], dtype=torch.long)
        ids = ids.to(device).split([len(row_ids) for _, row_ids in rows])
        by_layer: dict[int, list[torch.Tensor]] = {}
        for (buf, _), idx in zip(rows, ids, strict=True):
            view = self.views[(buf.kind, buf.layer_id)]
            by_layer.setdefault(buf.layer_id, []).append(view.index_select(0, idx).view(-1))
        return tuple((layer, checksum([torch.cat(parts)])) for layer, parts in by_layer.items())

    def _flip_one_byte(self, plan: WritePlan) -> None:
        """Test hook: the first byte written arrives flipped (after the checksum was taken)."""
        session, writes = next(iter(plan.writes.items()))
        src, dst, _ = writes[0]
        for view in self.views.values():
            offset = src - view.data_ptr()
            if 0 <= offset < view.numel():
                self.scratch[0] = view.view(-1)[offset] ^ 0xFF
                break
        self._sync()
        self.transport.write(session, [(self.scratch.data_ptr(), dst, 1)])
        log.warning("test hook: flipped one byte on the wire to %s", session)

    def _sync(self) -> None:
        if self.scratch.device.type == "cuda":
            torch.cuda.synchronize(self.scratch.device)

    @property
    def _range(self) -> str:
        return f"[{self.pools.start}, {self.pools.end})"


def _failed(report: SendReport, error: str) -> SendReport:
    return SendReport(report.req_id, report.start, report.end, report.signature, error=error)


def run_handoffs(
    port: KVPort | None, plan: StepPlan, tables: dict, inputs, result: StageResult
) -> None:
    """Appends this stage's SendReports and CheckReports to those of the stages before it.
    Nothing is sent from a step that failed (the prefill engine answers with that error)."""
    earlier = inputs.kv if inputs is not None and inputs.kv is not None else HandoffReports()
    reports = result.kv = HandoffReports(list(earlier.sends), list(earlier.checks))
    if result.failed is not None:
        return
    for send in plan.kv.sends:
        if port is None:
            reports.sends.append(SendReport(send.req_id, 0, 0, error="no transfer engine"))
            continue
        reports.sends.append(port.send(send, tables.get(send.req_id)))
    for check in plan.kv.checks:
        if port is not None:
            reports.checks.append(port.check(check))

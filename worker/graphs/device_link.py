"""DeviceLink: the rows one stage hands the next when both run on one GPU, through device memory.

Two stage actors on one GPU cannot form an NCCL pair, and a compiled graph's shared-memory
channel copies a device tensor to the host in the sender's process: the sender waits for its own
step, and the receiver starts only once the rows came back to the device. A link keeps the rows
on the device. The receiver allocates a ring of ``depth`` slots that the sender maps over CUDA
IPC, and each side keeps one interprocess event per slot (SlotFences). Per step with a batch
(seq: the link's count of such steps):

    sender    stream-waits for the slot's ``consumed`` event (the rows of step seq - depth were
              read), copies the step's rows into slot seq % depth, records ``written``, and sends
              only a LinkTicket (a few ints) over the graph's channel;
    receiver  stream-waits for the slot's ``written`` event, reads the slot (a replay copies the
              rows into its static inputs), records ``consumed``.

A stream wait binds to an event's latest record when it is issued, so each wait must come after
its record on the host: ``written`` is recorded before the ticket is sent, and the receiver
waits once it has it; ``consumed`` of step s is recorded in the receiver's call for step s,
which returns before the driver reads step s's output, and the driver keeps fewer than depth
steps unread (the ring is deeper than the pipeline), so the sender's call for step s + depth
comes later. Neither host waits for the device. A step larger than a slot, or one that failed,
goes over the channel as before (the ticket is then None).

Slot shapes: residual [depth, rows, hc * hidden] in the model's dtype, top-k [depth, rows, k]
int64 where a C4 layer precedes the receiver, token ids [depth, rows] int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4ray.engine.plan import StageResult
from dsv4ray.worker.graphs.ipc import export_tensor, open_tensor


@dataclass(frozen=True)
class LinkTicket:
    """Which slot holds a step's rows (seq: the link's count of steps sent) and what it holds."""

    seq: int
    num_rows: int
    has_topk: bool
    num_tokens: int  # token ids in the slot (0: none; a verification's: fewer than its rows)


class SlotFences:
    """One fence per ring slot, recorded by the process that created them and waited on by its
    peer. CUDA: interprocess events. CPU (pipelines in one process, tests of the protocol): the
    seq each slot was last recorded with, and a wait for any other seq is a protocol error (the
    device would read or overwrite the wrong rows)."""

    def __init__(self, events: list | None, seqs: torch.Tensor | None, device=None) -> None:
        self.events, self.seqs, self.device = events, seqs, device

    @classmethod
    def create(cls, depth: int, device) -> SlotFences:
        if torch.device(device).type != "cuda":
            return cls(None, torch.full((depth,), -1, dtype=torch.int64))
        events = [torch.cuda.Event(interprocess=True) for _ in range(depth)]
        for event in events:  # an interprocess event exists on the device once recorded
            event.record()
        return cls(events, None, device)

    def export(self):
        """What the peer waits on the fences with (``open``)."""
        if self.events is None:
            return self.seqs  # the peer is in this process
        return [event.ipc_handle() for event in self.events]

    @classmethod
    def open(cls, exported, device) -> SlotFences:
        if isinstance(exported, torch.Tensor):
            return cls(None, exported)
        device = torch.device(device)
        return cls([torch.cuda.Event.from_ipc_handle(device, h) for h in exported], None, device)

    def record(self, slot: int, seq: int) -> None:
        """After this stream's work on the slot for step seq."""
        if self.events is None:
            self.seqs[slot] = seq
        else:
            self.events[slot].record()

    def wait(self, slot: int, seq: int) -> None:
        """Holds this stream until the peer's work on the slot for step seq finished."""
        if self.events is None:
            if int(self.seqs[slot]) != seq:
                raise RuntimeError(f"slot {slot} waits for step {seq} but holds step "
                                   f"{int(self.seqs[slot])}")  # fmt: skip
            return
        torch.cuda.current_stream(self.device).wait_event(self.events[slot])


class DeviceLink:
    def __init__(self, residual: torch.Tensor, topk: torch.Tensor | None,
                 tokens: torch.Tensor, fences: SlotFences) -> None:  # fmt: skip
        """fences: this side's (the receiver's ``consumed``, the sender's ``written``); the
        peer's come with ``peer_fences``."""
        self.residual, self.topk, self.tokens = residual, topk, tokens
        self.fences, self.peer = fences, None
        self.depth, self.rows = residual.shape[0], residual.shape[1]
        self.sent = 0  # the sender's last seq

    @classmethod
    def allocate(cls, depth: int, rows: int, width: int, dtype: torch.dtype, topk: int | None,
                 device) -> DeviceLink:  # fmt: skip
        """The receiver's ring: depth slots of rows tokens (width = hc * hidden; topk: the
        indexer's k when top-k travels, else None)."""
        residual = torch.zeros(depth, rows, width, dtype=dtype, device=device)
        top = None if topk is None else torch.full((depth, rows, topk), -1, dtype=torch.int64,
                                                   device=device)  # fmt: skip
        tokens = torch.zeros(depth, rows, dtype=torch.int64, device=device)
        return cls(residual, top, tokens, SlotFences.create(depth, device))

    @classmethod
    def for_model(cls, cfg, after: int, depth: int, rows: int, dtype: torch.dtype,
                  device) -> DeviceLink:  # fmt: skip
        """The ring of a receiver of the residual stack after layers [0, after) of cfg's model
        (top-k travels when a C4 layer is among them)."""
        has_topk = any(spec.compress_ratio == 4 for spec in cfg.layers[:after])
        return cls.allocate(depth, rows, cfg.hc_mult * cfg.hidden_size, dtype,
                            cfg.index_topk if has_topk else None, device)  # fmt: skip

    def export(self) -> dict:
        """What the sender maps the ring with (``open``)."""
        return {
            "residual": export_tensor(self.residual),
            "topk": None if self.topk is None else export_tensor(self.topk),
            "tokens": export_tensor(self.tokens),
            "consumed": self.fences.export(),
        }

    @classmethod
    def open(cls, exported: dict) -> DeviceLink:
        """The sender's mapping of a ring; its own fences go to the receiver (``fences.export``)."""
        topk = exported["topk"]
        residual = open_tensor(exported["residual"])
        link = cls(residual, None if topk is None else open_tensor(topk),
                   open_tensor(exported["tokens"]),
                   SlotFences.create(residual.shape[0], residual.device))  # fmt: skip
        link.peer_fences(exported["consumed"])
        return link

    def peer_fences(self, exported) -> None:
        self.peer = SlotFences.open(exported, self.residual.device)

    def nbytes(self) -> int:
        tensors = [self.residual, self.tokens] + ([self.topk] if self.topk is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def send(self, result: StageResult) -> None:
        """The sender, after its step was launched: the result's rows into the next slot, the
        result left with a ticket instead (unchanged when its rows do not fit a slot)."""
        x = result.residual
        if x is None or result.failed is not None or x.shape[0] > self.rows:
            return
        if result.topk is not None and self.topk is None:
            return
        seq, num = self.sent + 1, x.shape[0]
        slot = seq % self.depth
        if seq > self.depth:  # the slot's last rows (step seq - depth) were read
            self.peer.wait(slot, seq - self.depth)
        self.residual[slot, :num].copy_(x)
        if result.topk is not None:
            self.topk[slot, :num].copy_(result.topk)
        tokens = result.token_ids[:num] if result.token_ids is not None else None
        if tokens is not None:
            self.tokens[slot, : tokens.shape[0]].copy_(tokens)
        self.fences.record(slot, seq)
        self.sent = seq
        num_tokens = 0 if tokens is None else tokens.shape[0]
        result.link = LinkTicket(seq, num, result.topk is not None, num_tokens)
        result.residual = result.topk = result.token_ids = None

    def receive(self, result: StageResult) -> LinkTicket | None:
        """The receiver, before its step: a ticketed result's rows as views of their slot (this
        stream holds until the sender wrote them) -> the ticket, for ``release``."""
        ticket = result.link
        if ticket is None:
            return None
        slot, num = ticket.seq % self.depth, ticket.num_rows
        self.peer.wait(slot, ticket.seq)
        result.residual = self.residual[slot, :num]
        result.topk = self.topk[slot, :num] if ticket.has_topk else None
        result.token_ids = self.tokens[slot, : ticket.num_tokens] if ticket.num_tokens else None
        result.link = None
        return ticket

    def release(self, ticket: LinkTicket | None) -> None:
        """The receiver, once every read of the slot was enqueued: the sender may reuse it."""
        if ticket is not None:
            self.fences.record(ticket.seq % self.depth, ticket.seq)

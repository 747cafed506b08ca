"""Messages of a prefill/decode handoff (pure Python dataclasses; every field msgpack-native).

A decode engine reserves ids for a request of n prompt tokens in its own index spaces and asks a
prefill engine to prefill it into them. The prefill engine's stages write the pages with
one-sided transfers, report what they wrote, and the decode stages check what they received
(engine/pd/handoff_plan.py says which rows move and how they are checked):

    decode engine --PrefillRequest (KVDestination)--> prefill engine
    prefill stage i --KVSend in its step plan--> writes its layers --SendReport--> prefill engine
    prefill engine --PrefillResult (first token, SendReports)--> decode engine
    decode engine --KVCheck in a step plan--> decode stage j --CheckReport--> decode engine

Id spaces stay apart by type: ``DeviceIds`` name decode device pages, window pages and a state
slot; ``HostIds`` (HiSparse: C4 entries in the decode stage's host store, where slot 0 is valid)
travel in their own field and are never read as device ids. No page bytes travel in a message.
Every message encodes as ``dataclasses.asdict`` (what StepPlan's msgpack encoding does to its
fields; tuples come back as lists) and decodes with its ``from_dict``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PD_PROTOCOLS = ("tcp", "rdma")  # Mooncake transports (worker/pd/transfer.py)
STATE_TRANSFERRED = -2  # NewRequest.state_copy_from: a handoff wrote the rings; keep them


def to_dict(message) -> dict[str, Any]:
    """The msgpack-native form of any message here (``from_dict`` of its class inverts it)."""
    return dataclasses.asdict(message)


@dataclass(frozen=True)
class BufferDesc:
    """One registered buffer of a stage: num_rows rows of row_bytes bytes from address base.
    kind: a page kind (row = page) or a state kind (row = one request's whole ring)."""

    kind: str
    layer_id: int
    base: int
    row_bytes: int
    num_rows: int


@dataclass(frozen=True)
class StageEndpoint:
    """What a stage reports once its pools exist: its transfer session ("ip:rpc_port"), layers
    [start, end), page format and buffers (layer-major, kinds in BUFFER_KINDS order)."""

    session: str
    start: int
    end: int
    dtype: str
    buffers: tuple[BufferDesc, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageEndpoint:
        buffers = tuple(BufferDesc(**item) for item in data["buffers"])
        return cls(data["session"], data["start"], data["end"], data["dtype"], buffers)


@dataclass(frozen=True)
class DeviceIds:
    """Device ids of one request: page_ids[i] = full page of positions [256 i, 256 i + 256) in
    every compressed pool; window_pages = (window idx, window page id) pairs; state_slot = the row
    of every compressor ring."""

    page_ids: tuple[int, ...]
    window_pages: tuple[tuple[int, int], ...]
    state_slot: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceIds:
        pairs = tuple((int(idx), int(page)) for idx, page in data["window_pages"])
        return cls(tuple(data["page_ids"]), pairs, data["state_slot"])


@dataclass(frozen=True)
class HostIds:
    """Slots of decode's HiSparse host store (its own index space; slot 0 is a valid slot)."""

    c4_slots: tuple[int, ...]


@dataclass(frozen=True)
class KVDestination:
    """Where a request's KV goes: every decode stage's endpoint, and the request's ids there."""

    endpoints: tuple[StageEndpoint, ...]
    device: DeviceIds
    host: HostIds | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVDestination:
        host = data.get("host")
        return cls(
            tuple(StageEndpoint.from_dict(e) for e in data["endpoints"]),
            DeviceIds.from_dict(data["device"]),
            None if host is None else HostIds(tuple(host["c4_slots"])),
        )


@dataclass(frozen=True)
class KVSend:
    """In a prefill plan: after this step, write request req_id's first num_tokens positions.
    corrupt: a test hook; one byte is flipped on the wire after the checksum was taken."""

    req_id: str
    num_tokens: int
    dest: KVDestination
    corrupt: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSend:
        dest = KVDestination.from_dict(data["dest"])
        return cls(data["req_id"], data["num_tokens"], dest, data["corrupt"])


@dataclass(frozen=True)
class KVCheck:
    """In a decode plan: checksum what request req_id received (its first num_tokens positions)."""

    req_id: str
    num_tokens: int
    device: DeviceIds

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCheck:
        return cls(data["req_id"], data["num_tokens"], DeviceIds.from_dict(data["device"]))


@dataclass(frozen=True)
class SendReport:
    """What one prefill stage wrote for one request: its layer range, the layout signature of
    the bytes, a checksum per layer (of exactly the bytes sent), bytes, the seconds the writes
    and the checksums took, or the error that stopped it (then nothing counts as sent)."""

    req_id: str
    start: int
    end: int
    signature: str = ""
    checksums: tuple[tuple[int, str], ...] = ()
    num_bytes: int = 0
    write_s: float = 0.0
    checksum_s: float = 0.0
    error: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SendReport:
        fields = dict(data)
        fields["checksums"] = tuple((int(layer), str(cs)) for layer, cs in data["checksums"])
        return cls(**fields)


@dataclass(frozen=True)
class CheckReport:
    """What one decode stage received for one request: a checksum per layer it owns."""

    req_id: str
    start: int
    end: int
    checksums: tuple[tuple[int, str], ...]


@dataclass
class Handoffs:
    """A step plan's handoffs, run after the step: writes (a prefill plan), then checks (a decode
    plan)."""

    sends: list[KVSend] = field(default_factory=list)
    checks: list[KVCheck] = field(default_factory=list)


@dataclass
class HandoffReports:
    """A stage result's reports of its plan's Handoffs, from this and the earlier stages."""

    sends: list[SendReport] = field(default_factory=list)
    checks: list[CheckReport] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillRequest:
    """A decode engine's request to a prefill engine. key: unique per handoff; prompt_ids: the
    decode request's prompt (a request with generated tokens is never handed over: it resumes
    where its output is tracked); sampling: ``SamplingParams.to_dict`` (the prefill samples one
    token, with seed)."""

    key: str
    prompt_ids: tuple[int, ...]
    sampling: dict[str, Any]
    seed: int
    dest: KVDestination
    corrupt: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillRequest:
        fields = dict(data)
        fields["prompt_ids"] = tuple(data["prompt_ids"])
        fields["dest"] = KVDestination.from_dict(data["dest"])
        return cls(**fields)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill engine's answer: the first token (None when none was sampled) with its logprobs
    ([logprob, [[id, logprob], ...]] when asked), every stage's SendReport, or why it failed.
    lost: the prefill engine is gone (no later write can come from it). num_cached_tokens /
    num_host_cached_tokens: the prompt tokens the prefill engine's prefix cache (and its host
    tier) gave, which the request's metrics report. prefill_s: seconds from the prefill engine
    taking the request to its answer."""

    key: str
    token: int | None = None
    logprobs: list | None = None
    reports: tuple[SendReport, ...] = field(default_factory=tuple)
    error: str | None = None
    lost: bool = False
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    prefill_s: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillResult:
        fields = dict(data)
        fields["reports"] = tuple(SendReport.from_dict(r) for r in data["reports"])
        return cls(**fields)

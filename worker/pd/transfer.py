"""The Mooncake transfer engine behind a small interface: one engine per stage actor, started
with the P2P handshake (no metadata server), every pool buffer registered once, one-sided
batched writes into another engine's registered buffers.

Protocols: "tcp" works without RDMA (CPU machines with the `mooncake-transfer-engine-non-cuda`
wheel; GPUs with the `mooncake-transfer-engine-cuda13` wheel, whose TCP path reads and writes
device memory); "rdma" where the machines have RDMA NICs. A session id is "ip:rpc_port".

The engine binds its listeners to every interface whatever host it is given. In a stage actor
started with worker/pd/bind_only.py's library preloaded, they are bound to host instead; any
listener still on a wildcard address gets a socket filter that admits only packets addressed to
host (worker/pd/listen_filter.py). Either way a peer reaches the engine only through the address
the session names.
"""

from __future__ import annotations

import ipaddress
import logging

import torch

from dsv4ray.engine.handoff import PD_PROTOCOLS
from dsv4ray.worker.pd.bind_only import narrowed
from dsv4ray.worker.pd.listen_filter import WILDCARDS, admit_only, listening_sockets

log = logging.getLogger("dsv4ray.transfer")


class TransferError(RuntimeError):
    """A write the engine refused or could not finish (the destination may be partly written)."""


def _admit_only(host: str, inodes: set[str]) -> int:
    """The engine's new listeners admit only host (an IPv4 address); how many were filtered."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        log.warning("transfer engine listeners left open on every interface: %r is not an "
                    "IPv4 address", host)  # fmt: skip
        return 0
    return admit_only(host, inodes)


class MooncakeTransport:
    """One TransferEngine: ``register`` buffers, ``write`` (src, dst, length) triples."""

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        if protocol not in PD_PROTOCOLS:
            raise ValueError(f"pd_protocol must be one of {PD_PROTOCOLS}, got {protocol!r}")
        import mooncake.engine

        self._module = mooncake.engine
        self.engine = mooncake.engine.TransferEngine()
        before = set(listening_sockets())
        with narrowed(host):
            status = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if status != 0:
            raise TransferError(f"Mooncake initialize({host!r}, {protocol!r}) returned {status}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        opened = {i: s for i, s in listening_sockets().items() if i not in before}
        wide = {i for i, (address, _) in opened.items() if address in WILDCARDS}
        self.filtered = _admit_only(host, wide) if wide else 0
        self.protocol = protocol
        self._registered: list[int] = []
        log.info("transfer engine %s (%s): listeners %s, %d of them on every interface behind a "
                 "filter admitting only %s", self.session, protocol,
                 sorted(f"{a}:{p}" for a, p in opened.values()), self.filtered, host)  # fmt: skip

    def register(self, tensor: torch.Tensor) -> None:
        """Registers the tensor's memory (contiguous); it must outlive this transport."""
        if tensor.device.type == "cuda" and not getattr(self._module, "SUPPORT_CUDA", True):
            raise TransferError(
                "pools on CUDA need a Mooncake build with CUDA support (extra pd-cuda13: "
                "mooncake-transfer-engine-cuda13); this one has none"
            )
        if not tensor.is_contiguous():
            raise ValueError("a registered buffer must be contiguous")
        ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        status = self.engine.register_memory(ptr, size)
        if status != 0:
            raise TransferError(f"register_memory of {size} bytes returned {status}")
        self._registered.append(ptr)

    def write(self, session: str, writes: list[tuple[int, int, int]]) -> None:
        """Writes each (local address, remote address, bytes) into session's buffers and returns
        when all are done; TransferError when any failed."""
        if not writes:
            return
        srcs, dsts, lengths = (list(column) for column in zip(*writes, strict=True))
        status = self.engine.batch_transfer_sync_write(session, srcs, dsts, lengths)
        if status != 0:
            raise TransferError(
                f"batch write of {len(writes)} regions ({sum(lengths)} bytes) to {session} "
                f"returned {status}"
            )

    def close(self) -> None:
        for ptr in self._registered:
            self.engine.unregister_memory(ptr)
        self._registered = []

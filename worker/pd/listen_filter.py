"""Listening sockets that answer only on one address: a classic BPF socket filter per socket.

The Mooncake transfer engine binds its handshake and data listeners to every interface, whatever
address it is initialised with, unless its process preloads worker/pd/bind_only.c; where it
could not (no C compiler), ``admit_only(host, inodes)`` attaches to each of this process's
listening sockets in ``inodes`` a filter (SO_ATTACH_FILTER: no privilege needed) that drops every
packet whose IPv4 destination is not ``host``, and every IPv6 packet: a connection to the engine
through any other address of the machine (loopback, another interface, IPv6) gets no answer.
Sockets accepted from a filtered listener inherit its filter. The sockets still show as bound
to all interfaces (``ss -ltn``); what they accept is what changed.

The filter runs where TCP has already parsed the IP header, so it reads the header at the
kernel's network-header offset (SKF_NET_OFF): the version nibble at byte 0, the destination
address at byte 16.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct

WILDCARDS = frozenset({"0.0.0.0", "::"})  # every interface
SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
SKF_NET_OFF = -0x100000  # loads relative to the network header
# opcodes (<linux/filter.h>)
LD_B_ABS, LD_W_ABS = 0x30, 0x20
AND_K, JEQ_K, RET_K = 0x54, 0x15, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]  # fmt: skip


def program(host: str) -> list[tuple[int, int, int, int]]:
    """The filter's instructions (code, jt, jf, k): accept IPv4 packets addressed to host."""
    address = int(ipaddress.IPv4Address(host))
    net = SKF_NET_OFF & 0xFFFFFFFF  # k is unsigned; the kernel reads it as a signed offset
    return [
        (LD_B_ABS, 0, 0, net + 0),  # A = first byte of the IP header
        (AND_K, 0, 0, 0xF0),  # its version
        (JEQ_K, 0, 3, 0x40),  # IPv4, else drop
        (LD_W_ABS, 0, 0, net + 16),  # A = destination address
        (JEQ_K, 0, 1, address),
        (RET_K, 0, 0, ACCEPT),
        (RET_K, 0, 0, DROP),
    ]


def listening_sockets(pid: int | str = "self") -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of the TCP sockets (IPv4 and IPv6) a process has listening."""
    owned = set(_socket_fds(pid).values())
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:  # a kernel without IPv6
            continue
        for line in lines:
            fields = line.split()  # sl local remote state ... inode
            if fields[3] == "0A" and fields[9] in owned:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # each 32-bit word in host order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def admit_only(host: str, inodes: set[str]) -> int:
    """Attaches the filter of ``program(host)`` to this process's sockets with these inodes;
    returns how many. ValueError for a host that is not an IPv4 address."""
    insns = program(host)
    array = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    fprog = struct.pack("@HP", len(insns), ctypes.addressof(array))  # struct sock_fprog
    attached = 0
    for fd, inode in _socket_fds("self").items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            attached += 1
        finally:
            sock.close()  # the duplicate only: the filter stays on the shared socket
    return attached


def _socket_fds(pid: int | str) -> dict[int, str]:
    """fd -> socket inode of a process's sockets."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(fd)] = link[len("socket:[") : -1]
    return out

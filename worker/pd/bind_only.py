"""Listeners bound to one address: bind_only.c, preloaded into a prefill/decode stage actor.

The Mooncake transfer engine binds its handshake and data listeners to every interface whatever
address it is initialised with. A stage actor of a prefill/decode pipeline starts with
``bind_only.c`` preloaded (``preload_env``: Ray sets the worker's environment before it starts),
and ``narrowed(host)`` asks that library to move every wildcard TCP bind of the process to host
while the engine starts, so its listeners are bound to the node's address and nothing answers on
any other. The library is compiled once per machine and source (``library``), into the user's
cache directory; without a C compiler the engine keeps its wildcard listeners and the stage
falls back to socket filters (worker/pd/listen_filter.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("dsv4ray.transfer")

SOURCE = Path(__file__).with_name("bind_only.c")
SYMBOL = "dsv4ray_bind_only"  # int (const char *host); NULL stops


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4ray"


def library() -> str | None:
    """Path of the compiled library for this source (compiled here when missing), or None when
    this machine cannot build it (the reason is logged)."""
    source = SOURCE.read_bytes()
    target = cache_dir() / f"bind-only-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.exists():
        return str(target)
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): transfer engine listeners stay bound to "
                    "every interface, behind socket filters")  # fmt: skip
        return None
    try:
        return _build(compiler, target)
    except (OSError, subprocess.SubprocessError) as exc:  # a read-only cache, a hung compiler
        log.warning("building %s into %s failed (%s): transfer engine listeners stay bound to "
                    "every interface, behind socket filters", SOURCE.name, target.parent,
                    exc)  # fmt: skip
        return None


def _build(compiler: str, target: Path) -> str | None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    command = [compiler, "-shared", "-fPIC", "-O2", "-o", partial, str(SOURCE), "-ldl"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log.warning("compiling %s failed (%s): transfer engine listeners stay bound to every "
                        "interface, behind socket filters", SOURCE.name,
                        done.stderr.strip()[-500:])  # fmt: skip
            return None
        os.replace(partial, target)  # atomic: stages of one node may build it at once
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    return str(target)


def preload_env(path: str) -> dict[str, str]:
    """A Ray runtime_env's env_vars that preload the library at path into an actor's worker
    (before any preload the node's environment already has)."""
    return {"LD_PRELOAD": f"{path} ${{LD_PRELOAD}}"}


def _loaded():
    """The preloaded library's switch, or None when this process did not start with it."""
    try:
        switch = getattr(ctypes.CDLL(None), SYMBOL)
    except AttributeError:
        return None
    switch.argtypes, switch.restype = [ctypes.c_char_p], ctypes.c_int
    return switch


@contextlib.contextmanager
def narrowed(host: str) -> Iterator[bool]:
    """Inside, wildcard TCP binds of this process go to host; yields whether they do (False:
    the library is not preloaded here, or host is not an IPv4 address)."""
    switch = _loaded()
    if switch is None or switch(host.encode()) != 0:
        yield False
        return
    try:
        yield True
    finally:
        switch(None)

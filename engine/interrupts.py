"""Ctrl-C at safe points: bookkeeping that must not stop half-way (scheduling, a commit, adding a
request) runs in ``deferred()`` blocks, and a Ctrl-C that lands in one raises KeyboardInterrupt at
the block's end.

A caller that steps the engine on the main thread (``LLM``) holds ``safe_points()`` for the whole
call: its SIGINT handler raises at once outside the blocks (waiting for the device stays
interruptible) and notes the signal inside them. The blocks themselves only count, so a step pays
no system call for them. Elsewhere (an AsyncEngine's engine thread, where no signal lands, or a
program with a SIGINT handler of its own) the blocks run as they are.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_MAIN = threading.main_thread().ident


class _Gate:
    def __init__(self) -> None:
        self.installed = False
        self.depth = 0  # deferred() blocks open on the main thread
        self.pending = False  # a SIGINT came inside one

    def on_sigint(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt


_GATE = _Gate()


@contextlib.contextmanager
def safe_points():
    """While held on the main thread with Python's default SIGINT handler in place, Ctrl-C waits
    for the end of any ``deferred()`` block; the handler is back afterwards."""
    if (
        threading.get_ident() != _MAIN
        or _GATE.installed
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    previous = signal.signal(signal.SIGINT, _GATE.on_sigint)
    _GATE.installed, _GATE.pending = True, False
    try:
        yield
    finally:
        _GATE.installed, _GATE.pending = False, False
        signal.signal(signal.SIGINT, previous)


class deferred:  # noqa: N801 (a context manager, named like one made by a function)
    """A block a Ctrl-C does not cut: under ``safe_points`` it raises at the block's end."""

    __slots__ = ("counted",)

    def __enter__(self) -> None:
        self.counted = threading.get_ident() == _MAIN
        if self.counted:
            _GATE.depth += 1

    def __exit__(self, *exc_info) -> None:
        if not self.counted:
            return
        _GATE.depth -= 1
        if _GATE.depth == 0 and _GATE.pending:
            _GATE.pending = False
            raise KeyboardInterrupt

"""Ctrl-C at safe points: bookkeeping that must not stop half-way (scheduling, a commit, adding a
request) runs with SIGINT noted, and the KeyboardInterrupt comes at the end of the block.

Waiting for the device stays interruptible; the engine's bookkeeping is consistent between
blocks, so a caller that aborts its requests after the interrupt leaves nothing held. Signal
handlers exist only on the main thread; elsewhere (an AsyncEngine's engine thread) no signal
lands, and the block runs as is.
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred():
    """SIGINT inside the block is delivered (to the handler in place before it) at its end."""
    on_main = threading.current_thread() is threading.main_thread()
    if not on_main or signal.getsignal(signal.SIGINT) is None:  # None: a handler set outside
        yield  # Python, which could not be put back
        return
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            signal.raise_signal(signal.SIGINT)

"""SIGINT and SIGTERM for the commands: both stop a command the way Ctrl-C does, and neither
cuts its shutdown short. Signal handlers exist only on the main thread; elsewhere these do
nothing."""

from __future__ import annotations

import contextlib
import signal
import threading


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt from now on; returns the handler it replaced (None off
    the main thread). Called again after ``ray.init``, which installs a handler of its own."""
    if not _on_main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def stop_asked(exc: BaseException) -> bool:
    """Whether exc is a requested stop: Ctrl-C or SIGTERM (KeyboardInterrupt), or SIGTERM while
    ray.init's handler was in place (SystemExit with the signal's number)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, SystemExit) and exc.code == signal.SIGTERM


@contextlib.contextmanager
def signals_ignored():
    """SIGINT and SIGTERM do nothing while a command shuts down: a second Ctrl-C would cut the
    shutdown short and leave Serve, Ray or their files behind."""
    if not _on_main_thread():
        yield
        return
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

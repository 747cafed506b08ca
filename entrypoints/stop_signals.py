"""SIGINT and SIGTERM for the commands: both stop a command the way Ctrl-C does, and neither
cuts its shutdown short. Signal handlers exist only on the main thread; elsewhere these do
nothing."""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the command stops as on SIGINT. A KeyboardInterrupt because Ray turns one
    that lands inside its blocking calls back into a KeyboardInterrupt (any other exception
    raised there comes out as a logged SystemError); ``TERMINATED`` tells the two apart."""


TERMINATED = threading.Event()  # set by SIGTERM (a command clears it when it starts)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _on_sigterm(signum, frame) -> None:
    TERMINATED.set()
    raise Terminated


def sigterm_interrupts():
    """SIGTERM raises Terminated from now on; returns the handler it replaced (None off the
    main thread). Called again after ``ray.init``, which installs a handler of its own."""
    if not _on_main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def stop_asked(exc: BaseException) -> bool:
    """Whether exc is a requested stop: Ctrl-C or SIGTERM (KeyboardInterrupt), or SIGTERM while
    ray.init's handler was in place (SystemExit with the signal's number)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, SystemExit) and exc.code == signal.SIGTERM


def by_sigterm(exc: BaseException) -> bool:
    """Whether a requested stop (``stop_asked``) came from SIGTERM rather than Ctrl-C."""
    return isinstance(exc, SystemExit) or TERMINATED.is_set()


@contextlib.contextmanager
def signals_held():
    """While a command shuts down, SIGINT and SIGTERM are only noted (the list yielded): a
    second Ctrl-C would cut the shutdown short and leave Serve, Ray or their files behind. The
    handlers are back afterwards."""
    noted: list[int] = []
    if not _on_main_thread():
        yield noted
        return
    handlers = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        yield noted
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

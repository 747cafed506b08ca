"""Whether a process of this node exists: the one test the actors' process sweeps and the model
cache's sweep of orphaned partial copies share (standard library only, below every layer)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this node (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

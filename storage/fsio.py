"""File-system steps the file-backed L2 adapters share (storage/disk, storage/slab): taking a file
or directory for one adapter, and making a new name survive a crash.

State: none; every function works on the descriptor or path it is given. Blocking: called only from
an adapter's I/O executor (or at its start, before the loop serves).

Primitives:
  lock_exclusive(fd, what)          flock the descriptor, not waiting; ConfigError naming `what`
                                    when another adapter (another process included) holds it
  sync_directory(directory, sync)   fsync a directory: the names created or renamed in it stay
                                    after a crash
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

from app.errors import ConfigError

__all__ = ["lock_exclusive", "sync_directory"]


def lock_exclusive(fd: int, what: str) -> None:
    """Take `fd`'s exclusive flock (released when the descriptor is closed); the caller closes
    `fd` when this raises."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"{what} is in use by another adapter") from None


def sync_directory(directory: str, sync_fd: Callable[[int], None] = os.fsync) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sync_fd(dir_fd)
    finally:
        os.close(dir_fd)

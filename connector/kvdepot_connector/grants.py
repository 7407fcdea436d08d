"""Segment grants: mapping read-write the arena segments the sidecar grants this engine instance
(write domains).

Role: the sidecar sends a segment's read-write descriptor over the session's lifeline before the
STORE reply that first places a reservation in it, and grants a writer's next segment ahead of its
first write. Before copying into a slot, `writable` makes sure every segment the slot spans is
mapped read-write: one granted ahead is settled (its mapping, started in the arena mapping's
thread, is waited for), one not yet seen is read from the lifeline (`take(wait_for=index)`, mapped
here and now). After each commit `take(soon=True)` takes the grants already waiting and maps them
in the arena mapping's thread, off the next store's path.

State: none of its own; the lifeline's `granted` descriptors and the mapping's writable segments.
Touched by one client, under its lock (blocking) or on its event loop (asyncio), as the session.

Primitives in call order:
  take(line, arena[, wait_for, soon])    map the grants that came (reading frames already waiting)
  writable(line, arena, offset, size)    every segment of the extent mapped read-write, or refused
"""

from __future__ import annotations

import os

from kvdepot_connector.errors import SidecarError, SidecarUnavailable
from kvdepot_connector.lifeline import LifelineClient, LifelineError
from kvdepot_connector.shm import ArenaMapping

PREFIX = "write:"


def take(
    line: LifelineClient | None, arena: ArenaMapping | None, wait_for: int | None = None, *,
    soon: bool = False,
) -> None:  # fmt: skip
    """Map the segments granted so far read-write (frames already waiting are read; with
    `wait_for`, frames are read until that segment's grant came, and it is mapped here and
    now; `soon`: the others are mapped in the arena mapping's thread)."""
    if line is None or arena is None or not arena.segment:
        return
    try:
        line.poll()
        if wait_for is not None and f"{PREFIX}{wait_for}" not in line.granted:
            fd = line.wait_granted(f"{PREFIX}{wait_for}")
            if fd is not None:
                line.granted[f"{PREFIX}{wait_for}"] = fd
    except LifelineError as exc:
        raise SidecarUnavailable(f"lifeline: {exc}") from None
    for name in [n for n in line.granted if n.startswith(PREFIX)]:
        fd = line.granted.pop(name)
        index = int(name.split(":")[1])
        if soon and index != wait_for:
            arena.grant_soon(index, fd)
            continue
        try:
            arena.grant(index, fd)
        except (OSError, ValueError) as exc:
            raise SidecarUnavailable(f"cannot map a granted segment: {exc}") from None
        finally:
            os.close(fd)


def writable(line: LifelineClient | None, arena: ArenaMapping, offset: int, size: int) -> None:
    """Return once this process may write `[offset, offset+size)` of `arena` (the grant read);
    SidecarError "refused" when no grant for it came."""
    if arena.writable(offset, size):
        return
    last = arena.segment_of(offset + max(size, 1) - 1)
    for index in range(arena.segment_of(offset), last + 1):  # a chunk may span segments
        if arena.writable(index * arena.segment, 1):
            continue
        try:
            if arena.settle(index):  # granted ahead: being mapped in the mapping's thread
                continue
        except (OSError, ValueError) as exc:
            raise SidecarUnavailable(f"cannot map a granted segment: {exc}") from None
        take(line, arena, index)
    if not arena.writable(offset, size):
        raise SidecarError("refused", f"no write grant for the extent at {offset}", False)

"""Release fences: one generation word per arena segment, in shared memory clients map read-only,
so that a reader can tell on its own, after its copy, that the bytes it copied did not change.

Role: a RELEASE answers `valid` when every object the copy came from is still alive and the
reader's session was not fenced meanwhile (engine/facade.py `release`). Each event that can turn
that answer to False first bumps a word here: an object leaving L1 (`bump_extent`, before its
memory goes back to the allocator: no one can be handed the memory before the bump), and a
session going suspect, whose read locks go (`bump_all`). A RETRIEVE reply carries the words of the
segments its extents span (`snapshot`); the client copies, reads the words again, and when none
moved, the RELEASE would have said valid: it sends the RELEASE without waiting for its answer
(one round trip per retrieve). When a word moved (any object of those segments left, not
necessarily one it read), it asks the sidecar, whose RELEASE checks each object: a moved word
costs a round trip, never a wrong answer.

Memory order: the sidecar stores the new word before anything that lets another process write
the freed memory (the allocator hands it out later, a writer writes after a reply); the client
loads the words after its copy's loads. x86-64 keeps loads in order and stores in one global
order, so a copy that read a later writer's bytes reads the bumped word too; the client uses the
words on x86-64 only (kvdepot_connector.fences), elsewhere its RELEASE waits for the answer.

State: a sealed memfd (size sealed, mode 0400) of one 64-bit word per segment, mapped read-write
here; `readonly_fd` is offered to every client over its lifeline ("fences"). Touched by the
event loop only (the words are written by one thread).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterable

import numpy as np

from engine.l1.arena import F_ADD_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK

WORD = 8


class ReleaseFences:
    """Generation words, one per segment of `segment_bytes` in an arena of `arena_bytes`."""

    def __init__(self, arena_bytes: int, segment_bytes: int, name: str = "kvdepot-fences") -> None:
        if arena_bytes <= 0 or segment_bytes <= 0:
            raise ValueError("the arena and its segments must have a size")
        self.segment_bytes = segment_bytes
        self.count = -(-arena_bytes // segment_bytes)
        size = -(-self.count * WORD // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
            os.fchmod(fd, 0o400)
            self._readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self._words = np.frombuffer(self._mm, dtype=np.uint64, count=self.count)
        self.bumps = 0

    @property
    def readonly_fd(self) -> int:
        """The table opened read-only, to offer to every client (the receiver gets a dup)."""
        return self._readonly

    def segments(self, offset: int, size: int) -> range:
        """The segments `[offset, offset+size)` spans."""
        seg = self.segment_bytes
        return range(offset // seg, (offset + max(size, 1) - 1) // seg + 1)

    def snapshot(self, extents: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """(segment, word) for each segment the `(offset, size)` extents span, each once."""
        words = self._words
        seen: dict[int, int] = {}
        for offset, size in extents:
            for i in self.segments(offset, size):
                if i not in seen:
                    seen[i] = int(words[i])
        return list(seen.items())

    def bump_extent(self, offset: int, size: int) -> None:
        """The object at `[offset, offset+size)` leaves: its segments' words move."""
        span = self.segments(offset, size)
        self._words[span.start : span.stop] += np.uint64(1)
        self.bumps += 1

    def bump_all(self) -> None:
        """Every word moves (a session's read locks went: its late copies ask the sidecar)."""
        self._words += np.uint64(1)
        self.bumps += 1

    def close(self) -> None:
        del self._words
        self._mm.close()
        os.close(self._readonly)

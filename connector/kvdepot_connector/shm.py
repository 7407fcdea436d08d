"""Client-side mapping of the sidecar's shared-memory L1 arena.

The sidecar creates the region and owns its lifetime; a client only maps it, read-write, with
MAP_POPULATE so the first copies do not pay a page fault per 4 KiB. `ArenaMapping.from_fd(fd,
size)` maps the arena's sealed memfd, received over the lifeline: its size is sealed, so no client
can truncate it (and SIGBUS the sidecar or another client), and nothing is opened by name.
A client's mapping stays valid until the client unmaps it, even after the sidecar exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os

import torch

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
SIZE_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)


class ArenaMapping:
    def __init__(self, mm: mmap.mmap, name: str, size: int) -> None:
        self._mm = mm
        self.name = name
        self.size = size
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)

    @classmethod
    def from_fd(cls, fd: int, size: int) -> ArenaMapping:
        """Map the arena's memfd (the caller keeps and closes `fd`); refused unless its size is
        sealed and at least `size`."""
        if fcntl.fcntl(fd, F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
            raise ValueError("the arena descriptor is not sealed against resizing")
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"arena is {actual} bytes, expected {size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        name = os.readlink(f"/proc/self/fd/{fd}").removeprefix("/memfd:").removesuffix(" (deleted)")
        return cls(mm, name, size)

    def region(self, offset: int, size: int) -> torch.Tensor:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"extent {offset}+{size} outside the arena of {self.size} bytes")
        return self.tensor[offset : offset + size]

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()

"""Client-side mapping of the sidecar's shared-memory L1 arena.

The sidecar creates the region and owns its lifetime; a client only maps it, read-write, with
MAP_POPULATE so the first copies do not pay a page fault per 4 KiB. `ArenaMapping.from_fd(fd,
size)` maps the arena's sealed memfd, received over the lifeline: its size is sealed, so no client
can truncate it (and SIGBUS the sidecar or another client), and nothing is opened by name.
A client's mapping stays valid until the client unmaps it, even after the sidecar exits.

Copies between the caller's CPU memory and the arena (`write`, `read`) are one bounds-checked
`memmove` each, on the calling thread and without the GIL: no torch kernel, whose thread pool
contends with the caller's own threads and the sidecar on a busy machine, and no view tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
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
        self._check(offset, size)
        return self.tensor[offset : offset + size]

    def write(self, offset: int, src: int, size: int) -> None:
        """Copy `size` bytes from address `src` (memory the caller owns and keeps alive) into
        the arena at `offset`."""
        self._check(offset, size)
        if size:
            ctypes.memmove(self.tensor.data_ptr() + offset, src, size)

    def read(self, offset: int, dst: int, size: int) -> None:
        """Copy `size` bytes of the arena at `offset` to address `dst` (memory the caller owns)."""
        self._check(offset, size)
        if size:
            ctypes.memmove(dst, self.tensor.data_ptr() + offset, size)

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"extent {offset}+{size} outside the arena of {self.size} bytes")

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()

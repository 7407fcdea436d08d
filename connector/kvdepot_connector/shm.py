"""Client-side mapping of the sidecar's shared-memory L1 arena.

The sidecar creates the region (`/dev/shm/<name>`) and owns its lifetime; a client only maps it,
read-write, with MAP_POPULATE so the first copies do not pay a page fault per 4 KiB. When the
sidecar exits it unlinks the name; a client's mapping stays valid until the client unmaps it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


class ArenaMapping:
    def __init__(self, name: str, size: int, shm_dir: Path = SHM_DIR) -> None:
        if "/" in name or not name:
            raise ValueError(f"bad arena name {name!r}")
        fd = os.open(shm_dir / name, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"arena {name} is {actual} bytes, expected {size}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def region(self, offset: int, size: int) -> torch.Tensor:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"extent {offset}+{size} outside the arena of {self.size} bytes")
        return self.tensor[offset : offset + size]

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()

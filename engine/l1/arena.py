"""The L1 arena: one sealed memfd, created at start, handed to engine-side clients as a descriptor.

State: the memfd (no name in /dev/shm or anywhere else: it exists while a process holds its
descriptor or a mapping), its mapping and a uint8 tensor over the whole of it. Objects are views
(`tensor(offset, size)`, `view(offset, size)`) at offsets the allocator hands out; there is no
torch allocation per chunk. Its size is sealed (F_SEAL_SHRINK | GROW | SEAL): no client that maps
it can truncate it (and SIGBUS the sidecar or another client) or grow it.

Clients receive the descriptor over their lifeline (api/lifeline.py offers `fd`) and map it; they
never open anything by name. A sidecar killed with SIGKILL leaves nothing behind: the kernel frees
the memory when its last holder is gone. The name (`kvdepot-<instance>-<pid>`, the instance
derived from the data directory) only labels it in /proc and in `/status`.

Primitives in call order: `SealedArena.create_sealed(...)`, `fd` (to offer), views, `close()`
(unmaps and closes; clients that still map it keep their mapping until they unmap).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

import blake3
import structlog
import torch

from app.errors import ConfigError

log = structlog.get_logger("kvdepot.l1.arena")

PREFIX = "kvdepot-"
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)


def instance_id(data_dir: Path) -> str:
    return blake3.blake3(str(data_dir.resolve()).encode()).hexdigest(length=6)


class SharedArena:
    """The arena's views; `SealedArena` makes one."""

    def __init__(self, name: str, size: int, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._fd = fd
        self._mm = mm
        self._buf = memoryview(mm)
        self._tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.closed = False

    @property
    def tensor_all(self) -> torch.Tensor:
        return self._tensor

    def tensor(self, offset: int, size: int) -> torch.Tensor:
        """A uint8 tensor view of `[offset, offset+size)`; shares memory with the arena."""
        return self._tensor[offset : offset + size]

    def view(self, offset: int, size: int) -> memoryview:
        """A writable memoryview of `[offset, offset+size)`."""
        return self._buf[offset : offset + size]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self._tensor
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:
            # Views still referenced somewhere; the mapping goes with the process.
            log.warning("arena_views_outstanding", name=self.name)
        os.close(self._fd)


class SealedArena(SharedArena):
    """The arena as a sealed memfd: no name in /dev/shm; clients get the descriptor over their
    lifeline (`fd`) and can neither truncate nor grow it (F_SEAL_SHRINK | GROW | SEAL)."""

    @classmethod
    def create_sealed(cls, size: int, instance: str, *, populate: bool = True) -> SealedArena:
        name = f"{PREFIX}{instance}-{os.getpid()}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            if populate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise ConfigError(
                            f"l1.size_gb: {size / (1 << 30):.2f} GiB of memory are not free"
                        ) from None
                    raise
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        log.info("arena_created", name=name, size=size, populated=populate, sealed=True)
        return cls(name, size, fd, mm)

    @property
    def fd(self) -> int:
        """The memfd, to offer over the lifeline (the receiver gets its own duplicate)."""
        return self._fd

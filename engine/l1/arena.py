"""The L1 arena: one sealed memfd, created at start, handed to engine-side clients as a descriptor.

State: the memfd (no name in /dev/shm or anywhere else: it exists while a process holds its
descriptor or a mapping), its mapping and a memoryview over the whole of it. Objects are views
(`view(offset, size)`, a writable memoryview) at offsets the allocator hands out; there is no
allocation per chunk. Byte copies need nothing more (the L2 paths copy with memoryviews and numpy),
so the arena imports no torch: `tensor(offset, size)` and `tensor_all`, for the callers that copy
with torch (the sidecar's own KV copies, CUDA pinning), import it on first use. Its size is sealed
(F_SEAL_SHRINK | GROW | SEAL): no client that maps it can truncate it (and SIGBUS the sidecar or
another client) or grow it.

Clients receive the descriptor over their lifeline (api/lifeline.py offers `fd`) and map it; they
never open anything by name. A sidecar killed with SIGKILL leaves nothing behind: the kernel frees
the memory when its last holder is gone. The name (`kvdepot-<instance>-<pid>`, the instance
derived from the data directory) only labels it in /proc and in `/status`.

Primitives in call order: `SealedArena.create_sealed(...)`, `fd` (to offer), views, `close()`
(unmaps and closes; clients that still map it keep their mapping until they unmap).

A populated arena larger than the memory available (MemAvailable, and the cgroup's memory.max
less its usage when one is set) is refused before anything is reserved: a memfd is not bounded by
/dev/shm's size, so reserving more than there is would not fail but wake the OOM killer, which
takes other processes (an engine) first.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import structlog

from app.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("kvdepot.l1.arena")

PREFIX = "kvdepot-"
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, less when its cgroup (v2) has a
    memory.max with less room left; None when neither can be read."""
    found: list[int] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
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
        self._tensor: torch.Tensor | None = None
        self.closed = False

    @property
    def tensor_all(self) -> torch.Tensor:
        """The whole arena as a uint8 tensor (shares memory with it); imports torch on first use."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._tensor

    def tensor(self, offset: int, size: int) -> torch.Tensor:
        """A uint8 tensor view of `[offset, offset+size)`; shares memory with the arena."""
        return self.tensor_all[offset : offset + size]

    def view(self, offset: int, size: int) -> memoryview:
        """A writable memoryview of `[offset, offset+size)`."""
        return self._buf[offset : offset + size]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._tensor = None
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
        if populate:
            free = available_memory()
            if free is not None and size > free:
                raise ConfigError(
                    f"l1.size_gb: {size / (1 << 30):.2f} GiB asked, {free / (1 << 30):.2f} GiB of memory"
                    " available"
                )
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

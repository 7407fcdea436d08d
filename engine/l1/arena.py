"""The L1 arena: one shared-memory region, created at start, mapped by engine-side clients by name.

State: the region's file under /dev/shm (POSIX shared memory), its mapping and a uint8 tensor over
the whole of it. Objects are views (`tensor(offset, size)`, `view(offset, size)`) at offsets the
allocator hands out; there is no torch allocation per chunk.

Names are `kvdepot-<instance>-<pid>` (`arena_name`): the instance is derived from the data
directory, so a sidecar restarted on the same data dir finds, and unlinks, the regions its dead
predecessors left behind (`cleanup_stale`), whatever PID their names carry. Ownership is an flock
on the region, held by the sidecar for its lifetime, never a PID: a region a live process holds is
never touched.

Primitives in call order: `cleanup_stale()`, `SharedArena.create(...)`, views, `close()` (unmaps
and unlinks; clients that still map it keep their mapping until they unmap).
"""

from __future__ import annotations

import contextlib
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

SHM_DIR = Path("/dev/shm")
PREFIX = "kvdepot-"
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)


def instance_id(data_dir: Path) -> str:
    return blake3.blake3(str(data_dir.resolve()).encode()).hexdigest(length=6)


def arena_name(instance: str, pid: int) -> str:
    """The name of the arena of the sidecar with process id `pid` on the data dir of `instance`."""
    return f"{PREFIX}{instance}-{pid}"


def _held(path: Path) -> bool:
    """Whether a live process holds the region at `path` (a sidecar holds an flock on its arena
    for as long as it lives; the kernel drops it with the process, however it dies)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge (another user's file): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def cleanup_stale(instance: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the regions of this instance that no live sidecar holds, whatever PID their name
    carries (a PID repeats: PID 1 in a container; a dead sidecar's PID is reused by another
    program). Returns their names. Call it holding the data dir's lock (app/datadir.py): then no
    sidecar in this PID namespace can own them. A region still held belongs to a sidecar on the
    same data dir path in another PID namespace that shares /dev/shm; it is left alone, and
    `SharedArena.create` refuses to take its name.
    """
    removed: list[str] = []
    for entry in shm_dir.glob(f"{PREFIX}{instance}-*"):
        if not entry.name[len(PREFIX) + len(instance) + 1 :].isdigit() or _held(entry):
            continue
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
            removed.append(entry.name)
    if removed:
        log.info("stale_arenas_removed", names=removed)
    return removed


class SharedArena:
    def __init__(self, name: str, size: int, fd: int, mm: mmap.mmap, path: Path) -> None:
        self.name = name
        self.size = size
        self.path = path
        self._fd = fd
        self._mm = mm
        self._buf = memoryview(mm)
        self._tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.closed = False

    @classmethod
    def create(
        cls, size: int, instance: str, *, populate: bool = True, shm_dir: Path = SHM_DIR
    ) -> SharedArena:
        name = arena_name(instance, os.getpid())
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o660)
        except FileExistsError:
            raise ConfigError(
                f"l1: shared memory {path} belongs to a live kvdepot on a data dir of the same path in "
                "another PID namespace sharing /dev/shm; give each sidecar a data_dir path of its own"
            ) from None
        except OSError as exc:
            raise ConfigError(f"l1: cannot create shared memory {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives
            os.ftruncate(fd, size)
            if populate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        free = os.statvfs(shm_dir)
                        raise ConfigError(
                            f"l1.size_gb: {size / (1 << 30):.2f} GiB do not fit in {shm_dir} "
                            f"({free.f_bavail * free.f_frsize / (1 << 30):.2f} GiB free; "
                            "in a container raise --shm-size)"
                        ) from None
                    raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        log.info("arena_created", name=name, size=size, populated=populate)
        return cls(name, size, fd, mm, path)

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
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
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
        return cls(name, size, fd, mm, Path(f"/memfd:{name}"))

    @property
    def fd(self) -> int:
        """The memfd, to offer over the lifeline (the receiver gets its own duplicate)."""
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self._tensor
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:
            log.warning("arena_views_outstanding", name=self.name)
        os.close(self._fd)

"""The L1 arena: sealed memfd segments, created at start, handed to engine-side clients as descriptors.

State: one sealed memfd per segment (no name in /dev/shm or anywhere else: a segment exists while a
process holds its descriptor or a mapping), a read-only reopening of each, and ONE contiguous
mapping of them all: an address range reserved at once (anonymous, never touched) over which each
segment is mapped MAP_FIXED at its offset, so offsets, views and tensors span the whole arena as
one buffer. Objects are views (`view(offset, size)`, a writable memoryview) at offsets the
allocator hands out; there is no allocation per chunk. Byte copies need nothing more (the L2 paths
copy with memoryviews and numpy), so the arena imports no torch: `tensor(offset, size)` and
`tensor_all`, for the callers that copy with torch (the sidecar's own KV copies, CUDA pinning),
import it on first use. Each segment's size is sealed (F_SEAL_SHRINK | GROW | SEAL): no client that
maps it can truncate it (and SIGBUS the sidecar or another client) or grow it.

Write domains (engine/l1/domains.py): a client gets every segment's READ-ONLY descriptor
(`readonly_fd(i)`) and the read-write one (`segment_fd(i)`) only for the segments its engine
instance writes in. A shared mapping of a read-only descriptor cannot be made writable (mmap and
mprotect answer EACCES), and each segment's mode is 0400, so a client of the same uid cannot reopen
it read-write through /proc (root can: an engine running as root is outside this boundary). With
`segment_bytes` None the arena is one segment (`fd`), as tests and benches without clients use it.

Clients receive the descriptors over their lifeline (api/lifeline.py offers them) and map them;
they never open anything by name. A sidecar killed with SIGKILL leaves nothing behind: the kernel
frees the memory when its last holder is gone. The name (`kvdepot-<instance>-<pid>`, the instance
derived from the data directory) only labels it in /proc and in `/status`.

Primitives in call order: `SealedArena.create_sealed(...)`, `segment_fd(i)` / `readonly_fd(i)`
(to offer), views, `zero(offset, size)` (a segment handed to another domain), `close()` (unmaps
and closes; clients that still map it keep their mapping until they unmap).

A populated arena larger than the memory available (MemAvailable, and the cgroup's memory.max
less its usage when one is set) is refused before anything is reserved: a memfd is not bounded by
/dev/shm's size, so reserving more than there is would not fail but wake the OOM killer, which
takes other processes (an engine) first.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import structlog

from app.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("kvdepot.l1.arena")

PREFIX = "kvdepot-"
#: segments of one arena at most (one lifeline frame carries their descriptors and the release
#: fences': 64 at most)
MAX_SEGMENTS = 63
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

    def zero(self, offset: int, size: int) -> None:
        """Overwrite `[offset, offset+size)` with zeros (rewritten in place: pinned pages stay)."""
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self._mm, offset)), 0, size)

    def _close_fds(self) -> None:
        os.close(self._fd)

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
        self._close_fds()


def segment_layout(size: int, segment_bytes: int | None, alignment: int = 4096) -> int:
    """The segment size of an arena of `size` bytes asked to have `segment_bytes` segments (None:
    one segment): a multiple of `alignment` (and of the page), at most `size`, and large enough
    that there are at most MAX_SEGMENTS (the descriptors of one lifeline frame)."""
    if segment_bytes is None or segment_bytes >= size:
        return size
    unit = max(alignment, mmap.PAGESIZE)
    seg = max(segment_bytes, -(-size // MAX_SEGMENTS))
    seg = -(-seg // unit) * unit
    return min(seg, size)


class SealedArena(SharedArena):
    """The arena as sealed memfd segments mapped as one range: no name in /dev/shm; clients get
    the descriptors over their lifeline and can neither truncate nor grow them (F_SEAL_SHRINK |
    GROW | SEAL); the read-write ones only for the segments they may write (engine/l1/domains.py)."""

    def __init__(
        self, name: str, size: int, fds: list[int], readonly: list[int], *, segment: int, mm: mmap.mmap
    ) -> None:
        super().__init__(name, size, fds[0], mm)
        self._fds = fds
        self._readonly = readonly
        #: bytes per segment (the last one may be shorter)
        self.segment_bytes = segment

    @classmethod
    def create_sealed(
        cls, size: int, instance: str, *, populate: bool = True, segment_bytes: int | None = None
    ) -> SealedArena:
        """An arena of `size` bytes, cut into segments of about `segment_bytes` (None: one)."""
        # A restart in a container has the same pid and data directory: the nonce tells the arenas
        # apart (clients also compare the memfd itself, never the name alone).
        name = f"{PREFIX}{instance}-{os.getpid()}-{secrets.token_hex(4)}"
        if populate:
            free = available_memory()
            if free is not None and size > free:
                raise ConfigError(
                    f"l1.size_gb: {size / (1 << 30):.2f} GiB asked, {free / (1 << 30):.2f} GiB of memory"
                    " available"
                )
        seg = segment_layout(size, segment_bytes)
        fds: list[int] = []
        readonly: list[int] = []
        mm: mmap.mmap | None = None
        try:
            for start in range(0, size, seg):
                fd = _segment(name, min(seg, size - start), populate)
                fds.append(fd)
                readonly.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
            mm = _reserve(size)
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            for i, fd in enumerate(fds):
                map_fixed(base + i * seg, min(seg, size - i * seg), fd, writable=True)
        except BaseException:
            if mm is not None:
                mm.close()
            for fd in fds + readonly:
                os.close(fd)
            raise
        log.info(
            "arena_created", name=name, size=size, populated=populate, sealed=True, segments=len(fds),
            segment_bytes=seg,
        )  # fmt: skip
        return cls(name, size, fds, readonly, segment=seg, mm=mm)

    @property
    def fd(self) -> int:
        """The first segment's memfd (the whole arena when it has one segment)."""
        return self._fd

    @property
    def segments(self) -> int:
        return len(self._fds)

    def segment_fd(self, index: int) -> int:
        """Segment `index`'s read-write memfd, to offer to its writers (the receiver gets a dup)."""
        return self._fds[index]

    def readonly_fd(self, index: int) -> int:
        """Segment `index` opened read-only, to offer to every client."""
        return self._readonly[index]

    def _close_fds(self) -> None:
        for fd in self._fds + self._readonly:
            os.close(fd)


def _segment(name: str, size: int, populate: bool) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if populate:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ConfigError("l1.size_gb: the arena's memory is not free") from None
                raise
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
        os.fchmod(fd, 0o400)  # a read-only descriptor cannot be reopened read-write via /proc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve(size: int) -> mmap.mmap:
    """An address range of `size` bytes for the segments to be mapped over (nothing committed)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    return mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
MAP_FIXED = 0x10


def map_fixed(addr: int, size: int, fd: int, *, writable: bool) -> None:
    """Map `fd` shared at exactly `addr` (replacing what was there), populated."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0)
    got = _libc.mmap(addr, size, prot, flags, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a segment: {os.strerror(err)}")

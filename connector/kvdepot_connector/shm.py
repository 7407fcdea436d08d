"""Client-side mapping of the sidecar's shared-memory L1 arena.

The sidecar creates the arena and owns its lifetime; a client only maps it, with MAP_POPULATE so
the first copies do not pay a page fault per 4 KiB, from sealed memfds received over the lifeline:
their size is sealed, so no client can truncate them (and SIGBUS the sidecar or another client),
and nothing is opened by name. A client's mapping stays valid until the client unmaps it, even
after the sidecar exits.

Write domains: the arena comes as segments (`ArenaMapping.from_segments(fds, size)`: one
read-only descriptor per segment, in order). The client reserves the whole arena's address range
once and maps each segment there read-only, so offsets, `region` and the tensor span the arena as
before; `grant(index, fd)` maps a segment its engine instance may write read-write over its
read-only mapping, and `grant_soon(index, fd)` does so in a thread of the mapping's own (the
sidecar grants a segment ahead of its first write: its page tables, tens of ms for 64 MiB, are
filled while the caller still copies into another one); `settle(index)` waits for that mapping.
`close` waits for the mappings in flight before it unmaps the range they go into. `write` (and
`writable`) refuse an extent outside the granted segments, before any byte moves.
`ArenaMapping.from_fd(fd, size)`: a sidecar whose arena is one memfd, read-write.

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
from concurrent.futures import Future, ThreadPoolExecutor

import torch

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
SIZE_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
MAP_FIXED = 0x10


def _map_fixed(addr: int, size: int, fd: int, *, writable: bool) -> None:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0)
    if _libc.mmap(addr, size, prot, flags, fd, 0) != addr:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _check_sealed(fd: int) -> int:
    if fcntl.fcntl(fd, F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
        raise ValueError("an arena descriptor is not sealed against resizing")
    return os.fstat(fd).st_size


class ArenaMapping:
    def __init__(
        self, mm: mmap.mmap, name: str, size: int, segment: int = 0, identity: Identity = (0, 0)
    ) -> None:
        self._mm = mm
        self.name = name
        self.size = size
        #: the first descriptor's file (device, inode): which memfd this is, whatever its name
        self.identity = identity
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        #: bytes per segment (0: one read-write mapping of the whole arena)
        self.segment = segment
        self._writable: set[int] = set()
        #: grants being mapped in `_mapper`'s thread (segment -> its future)
        self._pending: dict[int, Future[None]] = {}
        self._mapper: ThreadPoolExecutor | None = None

    @classmethod
    def from_segments(cls, fds: list[int], size: int) -> ArenaMapping:
        """Map the arena's segments read-only, each at its offset (the caller keeps and closes the
        descriptors); refused unless each is sealed and they cover `size` bytes."""
        if not fds:
            raise ValueError("no arena segments")
        sizes = [_check_sealed(fd) for fd in fds]
        segment = sizes[0]
        if any(n != segment for n in sizes[:-1]) or sizes[-1] > segment or sum(sizes) < size:
            raise ValueError(f"segments of {sizes} bytes do not make an arena of {size}")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        mm = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            for i, fd in enumerate(fds):
                _map_fixed(base + i * segment, min(segment, size - i * segment), fd, writable=False)
        except BaseException:
            mm.close()
            raise
        return cls(mm, _name(fds[0]), size, segment, identity(fds[0]))

    def grant(self, index: int, fd: int) -> None:
        """Map segment `index` read-write from `fd` (the caller closes it) over its read-only view."""
        seg = self.segment
        if not seg or not 0 <= index * seg < self.size:
            raise ValueError(f"no segment {index} in this arena")
        if _check_sealed(fd) < min(seg, self.size - index * seg):
            raise ValueError(f"segment {index} is shorter than the arena says")
        _map_fixed(self.tensor.data_ptr() + index * seg, min(seg, self.size - index * seg), fd, writable=True)
        self._writable.add(index)

    def grant_soon(self, index: int, fd: int) -> None:
        """`grant(index, fd)` in this mapping's thread, which closes `fd`; `settle` waits for it."""
        if self._mapper is None:
            self._mapper = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-grant")

        def run() -> None:
            try:
                self.grant(index, fd)
            finally:
                os.close(fd)

        self._pending[index] = self._mapper.submit(run)

    def settle(self, index: int) -> bool:
        """Wait until a `grant_soon` of segment `index` was mapped (its error raised here); whether
        there was one."""
        future = self._pending.pop(index, None)
        if future is None:
            return False
        future.result()
        return True

    def writable(self, offset: int, size: int) -> bool:
        """Whether this process may write `[offset, offset+size)` (segments granted to it)."""
        seg = self.segment
        if not seg:
            return True
        last = (offset + max(size, 1) - 1) // seg
        return all(i in self._writable for i in range(offset // seg, last + 1))

    def segment_of(self, offset: int) -> int:
        return offset // self.segment if self.segment else 0

    @classmethod
    def from_fd(cls, fd: int, size: int) -> ArenaMapping:
        """Map the arena's memfd (the caller keeps and closes `fd`); refused unless its size is
        sealed and at least `size`."""
        actual = _check_sealed(fd)
        if actual < size:
            raise ValueError(f"arena is {actual} bytes, expected {size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(mm, _name(fd), size, identity=identity(fd))

    def region(self, offset: int, size: int) -> torch.Tensor:
        self._check(offset, size)
        return self.tensor[offset : offset + size]

    def write(self, offset: int, src: int, size: int) -> None:
        """Copy `size` bytes from address `src` (memory the caller owns and keeps alive) into
        the arena at `offset`; PermissionError outside the segments this process may write."""
        self._check(offset, size)
        if not self.writable(offset, size):
            raise PermissionError(f"extent {offset}+{size} is in a segment this process may not write")
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
        if self._mapper is not None:  # nothing may map into the range once it is unmapped
            self._mapper.shutdown(wait=True)
            self._mapper = None
        self._pending.clear()
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()


Identity = tuple[int, int]


def identity(fd: int) -> Identity:
    """The (device, inode) of the file behind `fd`: two memfds never share one while both exist."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _name(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}").removeprefix("/memfd:").removesuffix(" (deleted)")

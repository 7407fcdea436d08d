"""Sealed memory: regions an engine hands the sidecar as memfd descriptors, checked, then mapped.

The sidecar copies into and out of an engine's memory only when the engine proved it owns it and
cannot pull it away: the region must be a memfd (never a file of some other program), sealed
against shrinking and growing (so a truncation cannot SIGBUS the sidecar mid-copy) and against
further seal changes, and at least as large as declared. The sidecar maps it itself.

State: `SealedRegions` holds the mappings by name (names are chosen by the engine, unguessable,
and never replaced), with their holder (the engine instance that shared them), so a holder's
regions go when it is gone (its last lifeline closed). It is
touched by the event loop only (the lifeline server's callbacks, the device's `open`).

Primitives in call order: `seal(fd)` (engine side, for tests and the arena), `open_sealed(fd,
nbytes)`, `SealedRegions.add(holder, name, fd, nbytes)`, `.get(name)`, `.drop(holder)`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
#: the seals a region must carry: its size is fixed for good
REQUIRED_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
MAX_REGIONS = 4096
MAX_REGIONS_PER_HOLDER = 1024


class SealError(ValueError):
    """A descriptor that is not a sealed memfd of the declared size."""


def seal(fd: int) -> None:
    """Fix the size of a memfd created with MFD_ALLOW_SEALING, for good."""
    fcntl.fcntl(fd, F_ADD_SEALS, REQUIRED_SEALS)


def check_sealed(fd: int, nbytes: int) -> int:
    """Raise SealError unless `fd` is a memfd sealed against size changes, of >= nbytes bytes.
    Returns its size."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        info = os.fstat(fd)
    except OSError as exc:
        raise SealError(f"cannot inspect descriptor: {exc.strerror}") from None
    if not target.startswith("/memfd:") or not stat.S_ISREG(info.st_mode):
        raise SealError("the region must be a memfd, not a file")
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise SealError(f"cannot read the region's seals: {exc.strerror}") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise SealError("the region must be sealed against shrinking, growing and unsealing")
    if nbytes <= 0 or info.st_size < nbytes:
        raise SealError(f"the region has {info.st_size} bytes, {nbytes} declared")
    return info.st_size


def open_sealed(fd: int, nbytes: int) -> mmap.mmap:
    """Check `fd` (check_sealed) and map all of it, shared and writable. The caller keeps the fd."""
    size = check_sealed(fd, nbytes)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise SealError(f"cannot map the region: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class Region:
    holder: object
    mm: mmap.mmap


class SealedRegions:
    """Mapped sealed regions by name; the device opens tensor handles inside them."""

    def __init__(self, max_regions: int = MAX_REGIONS, per_holder: int = MAX_REGIONS_PER_HOLDER) -> None:
        self._regions: dict[str, Region] = {}
        self._max = max_regions
        self._per_holder = per_holder

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, holder: object, name: str, fd: int, nbytes: int) -> None:
        """Map a region a holder shared; always closes `fd`. SealError if refused."""
        try:
            if name in self._regions:
                raise SealError(f"a region named {name!r} is already shared")
            if len(self._regions) >= self._max:
                raise SealError(f"{self._max} regions are shared already")
            if sum(1 for r in self._regions.values() if r.holder == holder) >= self._per_holder:
                raise SealError(f"one holder may share at most {self._per_holder} regions")
            self._regions[name] = Region(holder, open_sealed(fd, nbytes))
        finally:
            os.close(fd)

    def get(self, name: str) -> mmap.mmap:
        found = self._regions.get(name)
        if found is None:
            raise SealError(f"no region named {name!r} was shared over a lifeline")
        return found.mm

    def drop(self, holder: object) -> int:
        """Forget a holder's regions (views already opened keep their mapping). Returns how many."""
        names = [n for n, r in self._regions.items() if r.holder == holder]
        for name in names:
            del self._regions[name]
        return len(names)

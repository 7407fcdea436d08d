"""Sealed memory: regions an engine hands the sidecar as memfd descriptors, checked, then mapped.

The sidecar copies into and out of an engine's memory only when the engine proved it owns it and
cannot pull it away: the region must be a memfd (never a file of some other program), sealed
against shrinking and growing (so a truncation cannot SIGBUS the sidecar mid-copy) and against
further seal changes, and at least as large as declared. The sidecar maps what was declared, no
more (a sparse memfd of 2^48 bytes costs it the declared bytes of address space only).

State: `SealedRegions` holds the mappings by (holder, name): the holder is the engine instance
that shared them over its lifeline, and only that instance's REGISTER_KV_CACHE finds them (a name
is visible in the sidecar's /proc/<pid>/maps, so it is no secret). Names are chosen by the engine
and never replaced within one holder; another holder's region of the same name is another region.
Bounded: regions in all and per holder, bytes per region, per holder and in all (refusals name
the `transfers.*` setting). A holder's regions go when it is gone (its last lifeline closed). It
is touched by the event loop only (the lifeline server's callbacks, the device's `open`).

Primitives in call order: `seal(fd)` (engine side, for tests and the arena), `open_sealed(fd,
nbytes)`, `SealedRegions.add(holder, name, fd, nbytes)`, `.get(holder, name)`,
`.check_covered(holder, name, spans)` (REGISTER_KV_CACHE: the planes cover the region),
`.drop(holder)`.
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
#: defaults of the byte bounds (settings: transfers.max_region_bytes[_per_instance|_total])
MAX_REGION_BYTES = 64 << 30
MAX_HOLDER_BYTES = 256 << 30
MAX_TOTAL_BYTES = 1 << 40


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
    """Check `fd` (check_sealed) and map its first `nbytes` (what was declared: never more),
    shared and writable. The caller keeps the fd."""
    check_sealed(fd, nbytes)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise SealError(f"cannot map the region: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class Region:
    mm: mmap.mmap
    size: int


@dataclass(frozen=True, slots=True)
class RegionLimits:
    """The bounds of the shared regions (settings: transfers.max_region*)."""

    max_regions: int = MAX_REGIONS
    per_holder: int = MAX_REGIONS_PER_HOLDER
    max_bytes: int = MAX_REGION_BYTES
    holder_bytes: int = MAX_HOLDER_BYTES
    total_bytes: int = MAX_TOTAL_BYTES


class SealedRegions:
    """Mapped sealed regions by (holder, name); the device opens tensor handles inside them."""

    def __init__(self, limits: RegionLimits | None = None) -> None:
        self.limits = limits or RegionLimits()
        self._regions: dict[tuple[object, str], Region] = {}
        self._per_holder: dict[object, tuple[int, int]] = {}  # holder -> (regions, bytes)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def mapped_bytes(self) -> int:
        return self._bytes

    def add(self, holder: object, name: str, fd: int, nbytes: int) -> None:
        """Map a region a holder shared; always closes `fd`. SealError if refused."""
        try:
            self._check_room(holder, name, nbytes)
            self._regions[holder, name] = Region(open_sealed(fd, nbytes), nbytes)
            count, used = self._per_holder.get(holder, (0, 0))
            self._per_holder[holder] = (count + 1, used + nbytes)
            self._bytes += nbytes
        finally:
            os.close(fd)

    def _check_room(self, holder: object, name: str, nbytes: int) -> None:
        lim = self.limits
        if (holder, name) in self._regions:
            raise SealError(f"a region named {name!r} is already shared")
        if len(self._regions) >= lim.max_regions:
            raise SealError(f"{lim.max_regions} regions are shared already")
        count, used = self._per_holder.get(holder, (0, 0))
        if count >= lim.per_holder:
            raise SealError(f"one holder may share at most {lim.per_holder} regions")
        if nbytes > lim.max_bytes:
            raise SealError(f"a region of {nbytes} bytes: transfers.max_region_bytes={lim.max_bytes}")
        if used + nbytes > lim.holder_bytes:
            raise SealError(
                f"this engine instance shares {used} bytes already, {nbytes} more pass "
                f"transfers.max_region_bytes_per_instance={lim.holder_bytes}"
            )
        if self._bytes + nbytes > lim.total_bytes:
            raise SealError(
                f"{self._bytes} bytes are shared already, {nbytes} more pass "
                f"transfers.max_region_bytes_total={lim.total_bytes}"
            )

    def _region(self, holder: object, name: str) -> Region:
        found = self._regions.get((holder, name))
        if found is None:
            raise SealError(f"no region named {name[:128]!r} was shared over this engine instance's lifeline")
        return found

    def get(self, holder: object, name: str) -> mmap.mmap:
        """The mapping of `holder`'s region `name` (never another holder's). SealError if none."""
        return self._region(holder, name).mm

    def check_covered(self, holder: object, name: str, spans: list[tuple[int, int]]) -> None:
        """SealError unless the byte spans [start, end) of the planes registered in the region,
        which must not overlap, cover all of it but less than a page: a region is no larger than
        the layout registered in it needs."""
        size = self._region(holder, name).size
        covered, end = 0, 0
        for start, stop in sorted(spans):
            if start < end:
                raise SealError(f"KV planes overlap in region {name[:128]!r}")
            covered += stop - start
            end = stop
        if size - covered >= mmap.PAGESIZE:
            raise SealError(
                f"the KV planes registered in region {name[:128]!r} use {covered} of its {size} "
                "bytes: a region must be what its planes need (the planes must cover it)"
            )

    def drop(self, holder: object) -> int:
        """Forget a holder's regions (views already opened keep their mapping). Returns how many."""
        names = [key for key in self._regions if key[0] == holder]
        for key in names:
            self._bytes -= self._regions.pop(key).size
        self._per_holder.pop(holder, None)
        return len(names)

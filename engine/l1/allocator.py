"""Address-space allocator for the L1 arena.

State: the free extents of `[0, capacity)`, kept coalesced (no two free extents touch), and the
allocated extents. Offsets and sizes are multiples of `alignment`. Only the event loop touches it.

Primitives: `allocate(size) -> offset | None` (first fit, lowest address first; None when no free
extent is large enough), `allocate_in(size, lo, hi)` (the same within `[lo, hi)`: one write domain's
segment, engine/l1/domains.py), `free(offset)`, `check()` (raises if any invariant is broken), usage figures.

Free extents: a sorted list of start offsets (bisect) plus start->size and end->start maps, so
freeing coalesces with both neighbours in O(log n) lookups. Allocation walks the sorted starts; with
the uniform chunk sizes of one engine layout the first free extent almost always fits.
"""

from __future__ import annotations

import bisect


class AllocatorError(Exception):
    """A caller broke the allocator's contract (double free, unknown offset). A bug, never input."""


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        if self.capacity <= 0:
            raise ValueError("capacity smaller than one aligned unit")
        self._starts: list[int] = [0]
        self._free_size: dict[int, int] = {0: self.capacity}
        self._free_end: dict[int, int] = {self.capacity: 0}
        self._allocated: dict[int, int] = {}
        self._used = 0

    # --- figures -------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def free_extents(self) -> int:
        return len(self._starts)

    def largest_free(self) -> int:
        return max(self._free_size.values(), default=0)

    def aligned(self, size: int) -> int:
        a = self.alignment
        return (size + a - 1) & ~(a - 1)

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    # --- primitives ----------------------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        if size <= 0:
            raise AllocatorError(f"allocation of {size} bytes")
        need = self.aligned(size)
        if need > self.capacity - self._used:
            return None
        for idx, start in enumerate(self._starts):
            have = self._free_size[start]
            if have < need:
                continue
            del self._free_end[start + have]
            del self._free_size[start]
            if have == need:
                del self._starts[idx]
            else:
                rest = start + need
                self._starts[idx] = rest
                self._free_size[rest] = have - need
                self._free_end[rest + have - need] = rest
            self._allocated[start] = need
            self._used += need
            return start
        return None

    def allocate_in(self, size: int, lo: int, hi: int) -> int | None:
        """First fit of `size` bytes lying wholly within `[lo, hi)` (aligned bounds); None if none."""
        need = self.aligned(size)
        starts, sizes = self._starts, self._free_size
        idx = max(bisect.bisect_right(starts, lo) - 1, 0)
        while idx < len(starts):
            start = starts[idx]
            if start >= hi:
                return None
            end = start + sizes[start]
            pos = max(start, lo)
            if min(end, hi) - pos >= need:
                self._carve(idx, start, end, pos, need)
                return pos
            idx += 1
        return None

    def _carve(self, idx: int, start: int, end: int, pos: int, need: int) -> None:
        """Allocate `[pos, pos+need)` out of the free extent `[start, end)` (the `idx`-th)."""
        del self._free_size[start]
        del self._free_end[end]
        del self._starts[idx]
        if pos > start:
            self._add_free(start, pos)
        if pos + need < end:
            self._add_free(pos + need, end)
        self._allocated[pos] = need
        self._used += need

    def _add_free(self, start: int, end: int) -> None:
        bisect.insort(self._starts, start)
        self._free_size[start] = end - start
        self._free_end[end] = start

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise AllocatorError(f"free of unallocated offset {offset}")
        self._used -= size
        start, end = offset, offset + size
        left = self._free_end.pop(start, None)
        if left is not None:  # merge with the free extent ending where this one starts
            start = left
            del self._free_size[left]
            idx = bisect.bisect_left(self._starts, left)
            del self._starts[idx]
        right_size = self._free_size.pop(end, None)
        if right_size is not None:  # merge with the free extent starting where this one ends
            del self._free_end[end + right_size]
            idx = bisect.bisect_left(self._starts, end)
            del self._starts[idx]
            end += right_size
        bisect.insort(self._starts, start)
        self._free_size[start] = end - start
        self._free_end[end] = start

    def check(self) -> None:
        """Raise AllocatorError unless every invariant holds."""
        a = self.alignment
        if self._starts != sorted(self._free_size):
            raise AllocatorError("free start list out of sync")
        if {s + n: s for s, n in self._free_size.items()} != self._free_end:
            raise AllocatorError("free end map out of sync")
        extents = sorted(
            [(s, n, "free") for s, n in self._free_size.items()]
            + [(s, n, "used") for s, n in self._allocated.items()]
        )
        pos = 0
        prev_kind = ""
        for start, size, kind in extents:
            if start != pos:
                raise AllocatorError(f"gap or overlap at {pos}..{start}")
            if size <= 0 or start % a or size % a:
                raise AllocatorError(f"bad extent {start}+{size}")
            if kind == "free" and prev_kind == "free":
                raise AllocatorError(f"uncoalesced free extents at {start}")
            pos = start + size
            prev_kind = kind
        if pos != self.capacity:
            raise AllocatorError(f"extents cover {pos} of {self.capacity} bytes")
        if sum(self._allocated.values()) != self._used:
            raise AllocatorError("used bytes out of sync")

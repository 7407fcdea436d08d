"""The slab adapter's slots: which are free, which are being read, and the work on one slot that
runs in the adapter's I/O executor (a blob written with both headers; a blob read back and its
slot's header checked against the index).

State: `SlotSpace` (event loop only) keeps each file's free slots (lowest first at start), the
count of reads in flight per slot, the slots freed while being read (`draining`: free once their
last reader is done), and the number of slots taken by writes in flight. A slot is always in
exactly one of: the index (the adapter's), a write in flight, draining, free.

Primitives in call order:
  SlotSpace.reset(slots_per_file, used)     at start: every slot not in `used` is free
  take(file) -> slot | None                 a free slot of `file` for a write (None: none free)
  written()                                 that write ended (indexed or released)
  reading(ref) / read_done(ref)             a read of the slot starts / ends
  release(ref)                              the index no longer needs the slot
  write_and_sync(io, files, writes, fsync)  the writes of a batch, then one fdatasync per file
  write_blob(file, w)                       (executor) both headers and the payload, one write
  read_blob(file, key, ref, size, out)      (executor) Placed(header) or the whole blob; StaleSlot
                                            when the slot's header does not name `key` at the
                                            indexed generation and lengths
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from storage.codec import EncodedBlob, blob_header
from storage.inflight import Placed
from storage.slab import headers as fmt
from storage.slab.file import SlabFile


class StaleSlot(Exception):
    """The slot no longer holds what the index says (rewritten, zeroed or torn)."""


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a key's blob lies (the index's value): file number, slot, generation, header length."""

    file: int
    slot: int
    generation: int
    head_len: int


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """One blob to write: its key, the slot taken for it, its generation."""

    key: str
    blob: EncodedBlob
    ref: SlotRef


class SlotSpace:
    def __init__(self) -> None:
        self._free: list[deque[int]] = []
        self._readers: dict[tuple[int, int], int] = {}
        self._draining: set[tuple[int, int]] = set()
        self.writing = 0

    def reset(self, slots_per_file: list[int], used: set[tuple[int, int]]) -> None:
        self._free = [deque(s for s in range(n) if (f, s) not in used) for f, n in enumerate(slots_per_file)]

    def has_free(self, file: int) -> bool:
        return bool(self._free[file])

    def take(self, file: int) -> int | None:
        free = self._free[file]
        if not free:
            return None
        self.writing += 1
        return free.popleft()

    def written(self) -> None:
        self.writing -= 1

    def reading(self, ref: SlotRef) -> None:
        place = (ref.file, ref.slot)
        self._readers[place] = self._readers.get(place, 0) + 1

    def read_done(self, ref: SlotRef) -> None:
        place = (ref.file, ref.slot)
        left = self._readers.pop(place) - 1
        if left:
            self._readers[place] = left
        elif place in self._draining:
            self._draining.discard(place)
            self._free[ref.file].append(ref.slot)

    def release(self, ref: SlotRef) -> None:
        place = (ref.file, ref.slot)
        if self._readers.get(place):
            self._draining.add(place)
        else:
            self._free[ref.file].append(ref.slot)


def write_blob(file: SlabFile, w: SlotWrite) -> None:
    """In an executor thread: the slot header, the blob's header and its payload into the slot."""
    head_len = len(w.blob.header)
    checksum = blob_header.read_header(w.blob.header).payload_checksum
    slot_head = fmt.pack_slot(
        generation=w.ref.generation, blob_len=w.blob.nbytes, blob_head_len=head_len,
        digest=fmt.key_digest(w.key), payload_checksum=checksum, file_id=file.file_id, slot=w.ref.slot,
    )  # fmt: skip
    file.write_slot(w.ref.slot, slot_head + w.blob.header, blob_header.as_bytes_view(w.blob.payload))


async def write_and_sync(
    io: Callable[..., Awaitable[Any]], files: list[SlabFile], writes: list[SlotWrite], *, fsync: bool
) -> list[BaseException | None]:
    """Each write's outcome, run through `io` (the adapter's executor): None when written (and,
    with `fsync`, its file synced: one fdatasync per file after all its writes), else why not."""
    outcomes: list[BaseException | None] = list(
        await asyncio.gather(*(io(write_blob, files[w.ref.file], w) for w in writes), return_exceptions=True)
    )
    if fsync:
        touched = sorted({w.ref.file for w, exc in zip(writes, outcomes, strict=True) if exc is None})
        synced = await asyncio.gather(*(io(files[f].sync) for f in touched), return_exceptions=True)
        failed = {f: exc for f, exc in zip(touched, synced, strict=True) if isinstance(exc, BaseException)}
        outcomes = [
            exc if exc is not None else failed.get(w.ref.file)
            for w, exc in zip(writes, outcomes, strict=True)
        ]
    return outcomes


def read_blob(
    file: SlabFile, key: str, ref: SlotRef, size: int, out: memoryview | None
) -> Placed | bytes | memoryview:
    """In an executor thread: the slot's blob, or its payload in out (Placed) when it is raw and
    exactly len(out) long."""
    area = fmt.payload_offset(ref.head_len)
    payload_len = size - ref.head_len
    if out is None or payload_len != out.nbytes:
        head, blob = file.read_blob(ref.slot, area, ref.head_len, payload_len)
        check_head(head, file, key, ref, size)
        return blob
    head = file.read_into(ref.slot, area, out)
    check_head(head, file, key, ref, size)
    blob_head = head[fmt.SLOT_HEADER_SIZE : fmt.SLOT_HEADER_SIZE + ref.head_len]
    if blob_header.fits_in_place(blob_head, out.nbytes):
        return Placed(blob_head)
    return blob_head + bytes(out)


def check_head(head: bytes, file: SlabFile, key: str, ref: SlotRef, size: int) -> None:
    """StaleSlot unless the slot's header names `key` at the indexed generation and lengths."""
    found = fmt.parse_slot(head, file.file_id, ref.slot)
    if found is None:
        raise StaleSlot(f"{file.path} slot {ref.slot}: no valid slot header")
    if (found.generation, found.blob_len, found.blob_head_len) != (ref.generation, size, ref.head_len):
        raise StaleSlot(f"{file.path} slot {ref.slot}: holds generation {found.generation}, "
                        f"the index says {ref.generation}")  # fmt: skip
    if found.digest != fmt.key_digest(key):
        raise StaleSlot(f"{file.path} slot {ref.slot}: holds another key")

"""The slab adapter's index on disk: the checkpoint file, and how start-up merges it with the scan.

Stateless functions; save/load are blocking (the adapter's I/O executor), merge is pure.

The checkpoint (JSON, written to a temp file, fsync-ed, renamed over the old one, directory
fsync-ed: it is the old one or the new one after a crash, never half of either) holds the slot
size, the next generation and the entries key -> (file id, slot, generation, blob length, blob
header length) in recency order, least recently used first. It is a hint, never trusted alone:
start-up scans every slot's head (storage/slab/file.py), and an entry is kept only where the slot
still holds that key at that generation and length. So a stale checkpoint (slots rewritten,
deleted or torn since) costs nothing but its own entries, and a missing or unreadable one only the
recency order (slots it does not name follow in generation order).

Primitives in call order:
  load_checkpoint(path, slot_bytes) -> Checkpoint | None    None: absent, unreadable, or another format
  scanned(file_ids, scans) -> found                         what the slots' heads say
  merge(found, checkpoint) -> Merged                        the index at start, oldest first
  placed(merged, file_ids) / checkpoint_of(held, ...)       the index in the adapter's terms and back
  Checkpointer.due(submit)                                  after a change: is a checkpoint due?
  save_checkpoint(path, checkpoint)

Also here: SlabStartup (what the adapter's start found) and default_capacity(config).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from storage.fsio import sync_directory
from storage.slab import headers as fmt
from storage.slab.config import SlabAdapterConfig
from storage.slab.file import ScanResult
from storage.slab.slots import SlotRef

log = structlog.get_logger("kvdepot.storage.slab")

FORMAT = "kvdepot-slab-index"
VERSION = 1


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """Where one key's blob lies: file (its id, hex), slot, generation, lengths."""

    key: str
    file_id: str
    slot: int
    generation: int
    blob_len: int
    head_len: int

    @property
    def place(self) -> tuple[str, int]:
        return (self.file_id, self.slot)


@dataclass(slots=True)
class Checkpoint:
    slot_bytes: int
    next_generation: int
    entries: list[SlotEntry] = field(default_factory=list)


@dataclass(slots=True)
class Merged:
    entries: list[SlotEntry]
    """The index, least recently used first: one entry per key, its newest generation."""
    superseded: list[SlotEntry]
    """Older generations of keys found again in newer slots: their slots are free."""
    stale: int
    """Checkpoint entries the slots no longer confirm."""
    next_generation: int


def placed(merged: Merged, file_ids: list[str]) -> tuple[list[tuple[str, SlotRef, int]], list[SlotRef]]:
    """The merged index in the adapter's terms (files by number, in `file_ids`' order): (key, where,
    blob length) oldest first, and the slots of superseded generations (free once zeroed)."""
    number = {file_id: i for i, file_id in enumerate(file_ids)}

    def ref(e: SlotEntry) -> SlotRef:
        return SlotRef(number[e.file_id], e.slot, e.generation, e.head_len)

    return [(e.key, ref(e), e.blob_len) for e in merged.entries], [ref(e) for e in merged.superseded]


def checkpoint_of(
    held: Iterable[tuple[str, SlotRef, int]], file_ids: list[str], slot_bytes: int, next_generation: int
) -> Checkpoint:
    """What to checkpoint of the adapter's index: each (key, where, blob length), oldest first."""
    entries = [
        SlotEntry(key, file_ids[ref.file], ref.slot, ref.generation, size, ref.head_len)
        for key, ref, size in held
    ]
    return Checkpoint(slot_bytes, next_generation, entries)


def load_checkpoint(path: str, slot_bytes: int) -> Checkpoint | None:
    try:
        with open(path, "rb") as f:
            data: Any = orjson.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("slab_checkpoint_unreadable", path=path, error=str(exc))
        return None
    try:
        if data["format"] != FORMAT or data["version"] != VERSION or data["slot_bytes"] != slot_bytes:
            log.warning("slab_checkpoint_ignored", path=path, reason="other format or slot size")
            return None
        entries = [
            SlotEntry(str(k), str(f), int(s), int(g), int(b), int(h)) for k, f, s, g, b, h in data["entries"]
        ]
        return Checkpoint(slot_bytes, int(data["next_generation"]), entries)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("slab_checkpoint_unreadable", path=path, error=repr(exc))
        return None


def save_checkpoint(path: str, checkpoint: Checkpoint) -> None:
    body = orjson.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "slot_bytes": checkpoint.slot_bytes,
            "next_generation": checkpoint.next_generation,
            "entries": [
                [e.key, e.file_id, e.slot, e.generation, e.blob_len, e.head_len] for e in checkpoint.entries
            ],
        }
    )
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    sync_directory(os.path.dirname(os.path.abspath(path)))


def scanned(file_ids: list[str], scans: list[ScanResult]) -> list[SlotEntry]:
    """The valid slots the scans of the files (ids in hex, in the same order) found, as entries."""
    return [
        SlotEntry(s.key, file_id, s.slot, s.header.generation, s.header.blob_len, s.header.blob_head_len)
        for file_id, scan in zip(file_ids, scans, strict=True)
        for s in scan.slots
    ]


def merge(found: list[SlotEntry], checkpoint: Checkpoint | None) -> Merged:
    """The index from what the scan found in the slots, ordered by the checkpoint where it agrees."""
    newest: dict[str, SlotEntry] = {}
    superseded: list[SlotEntry] = []
    for entry in found:
        held = newest.get(entry.key)
        if held is None:
            newest[entry.key] = entry
        elif entry.generation > held.generation:
            superseded.append(held)
            newest[entry.key] = entry
        else:
            superseded.append(entry)
    ordered: list[SlotEntry] = []
    placed: set[str] = set()
    stale = 0
    next_generation = max((e.generation for e in found), default=0) + 1
    if checkpoint is not None:
        next_generation = max(next_generation, checkpoint.next_generation)
        for hint in checkpoint.entries:
            current = newest.get(hint.key)
            if current is None or current != hint or hint.key in placed:
                stale += 1
                continue
            ordered.append(current)
            placed.add(hint.key)
    rest = sorted((e for e in newest.values() if e.key not in placed), key=lambda e: e.generation)
    return Merged(ordered + rest, superseded, stale, next_generation)


@dataclass(frozen=True, slots=True)
class SlabStartup:
    """What the adapter's start() found."""

    files: int
    slots: int
    blobs: int
    bytes: int
    empty_slots: int
    invalid_slots: int
    superseded: int
    checkpoint_used: bool
    stale_checkpoint_entries: int
    seconds: float

    @classmethod
    def found(
        cls, scans: list[ScanResult], merged: Merged, *, checkpoint_used: bool, blobs: int, nbytes: int,
        started: float,
    ) -> SlabStartup:  # fmt: skip
        """The report of a start that began at `started` (time.perf_counter) and holds `blobs`."""
        return cls(
            files=len(scans),
            slots=sum(scan.empty + scan.invalid + len(scan.slots) for scan in scans),
            blobs=blobs,
            bytes=nbytes,
            empty_slots=sum(scan.empty for scan in scans),
            invalid_slots=sum(scan.invalid for scan in scans),
            superseded=len(merged.superseded),
            checkpoint_used=checkpoint_used,
            stale_checkpoint_entries=merged.stale,
            seconds=time.perf_counter() - started,
        )


def default_capacity(config: SlabAdapterConfig) -> int:
    """The capacity before start: config.capacity_gb, else every slot of the configured files."""
    if config.capacity_gb is not None:
        return int(config.capacity_gb * (1 << 30))
    return (
        max(1, len(config.paths)) * fmt.slot_count(config.size_bytes, config.slot_bytes) * config.slot_bytes
    )


class Checkpointer:
    """When to write a checkpoint (event loop only): after a change, at most every `interval_s`,
    one at a time (they share the temp file; a change meanwhile is written by the next one)."""

    def __init__(self, interval_s: float, clock: Callable[[], float], name: str) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._name = name
        self._last = clock()
        self._job: concurrent.futures.Future[None] | None = None
        self.written = 0

    def due(self, submit: Callable[[], concurrent.futures.Future[None]]) -> None:
        """Call `submit` (which starts a checkpoint write) when one is due."""
        now = self._clock()
        if now - self._last < self._interval_s or (self._job is not None and not self._job.done()):
            return
        self._last = now
        self._job = submit()
        self._job.add_done_callback(self._done)

    def _done(self, job: concurrent.futures.Future[None]) -> None:
        if job.cancelled():
            return
        exc = job.exception()
        if exc is None:
            self.written += 1
        else:
            log.warning("slab_checkpoint_failed", adapter=self._name, error=repr(exc))

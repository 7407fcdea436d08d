"""DiskAdapter: the local-disk L2. Crash-safe files, an in-memory index rebuilt from them at start.

State (event loop only): the index key -> (file, size) in least-recently-used order (`_held`,
which reports every change to the owner's accounting, storage/holdings.py), bytes reserved by
writes in flight, the capacity, and the store in flight per key. Every file operation runs in the
I/O executor passed in (storage/disk/files.py, storage/disk/dirs.py); the loop never touches a file.

Placement: a key's blake3 digest picks one of the directories (config.paths, or the default
directory) and one of its 256 two-hex-digit subdirectories. Each write gets a fresh file name, so
a write never races an unlink of an older file of the same key; the index says which file is
current, and at start the newest file of a key wins and the others are deleted.

Primitives in call order:
  start()          per directory: create it, flock it (one adapter per directory), then scan every
                   subdirectory in parallel: temp files (a crash mid-write) are removed, each blob's
                   header is read and checked (no payload reads), files whose header or length is
                   wrong are deleted and counted; the index is ordered by file mtime. `startup`
                   reports what was found.
  store(items)     room is made first (LRU eviction, files unlinked), then the blob is written to a
                   temp file (0600), fsync-ed (config.fsync) and renamed into place, the directory
                   fsync-ed (config.fsync); the index is updated when the rename is done. A
                   store of a key already being written waits for that write and shares its result.
                   NO_SPACE: larger than the capacity, no room left by writes in flight, or the
                   filesystem is full.
  contains(keys)   the index alone (no file access, no recency change)
  load(keys)       reads the file (recency refreshed). A file that vanished or whose size differs
                   from the index is a MISS, dropped from the index (and deleted when wrong).
                   The bytes are not checked here: the caller runs codec.decode_into.
  load_into(keys, outs, check)
                   as load, but a raw blob of the right size has its payload read straight into
                   out (preadv; through the bounce buffer under O_DIRECT); a file that ends early is
                   a MISS like a wrong size, and so is one longer than any blob for out (not read:
                   deleted and counted). With the caller's `check` (codec.BlobCheck), the I/O thread
                   that read a blob checks it at once (verify_in_place, or decode_into for a blob
                   not read in place): OK results say `checked`, a failed check is a MISS carrying
                   its IntegrityError. A cancelled load_into waits for its reads (and checks)
  delete(keys)     drops index entries and unlinks their files
  set_capacity(n)  evicts down to n
  evict_salt(salt, nbytes)
                   drops the tenant's least recently used index entries (the index's order: write
                   or load), enough for nbytes, then unlinks their files
Pins (`bind_pins`, storage/common.py): eviction for capacity or quota skips the keys pins hold; a
store that finds no other room is NO_SPACE.
  close()          waits (bounded) for file operations already running, releases the directory
                   locks, and shuts the executor down when this adapter owns it

Recency survives a restart only as file mtimes (write times): loads do not touch files.
The owner's accounting, bound before start(), is told of every blob the scan indexed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import blake3
import structlog

from app.errors import IntegrityError
from storage.base import MISS, OK, BuildContext, LoadResult, OpResult, Status
from storage.codec import BlobCheck, EncodedBlob, blob_header
from storage.common import AdapterCore
from storage.disk import dirs as disk_dirs
from storage.disk.config import DiskAdapterConfig
from storage.disk.dirs import BLOB_SUFFIX, SUBDIRS, ScanReport
from storage.disk.files import BadFile, BlobFiles
from storage.inflight import CLOSE_WAIT_S, ExecutorJobs, Placed, gather_all, settled

log = structlog.get_logger("kvdepot.storage.disk")

T = TypeVar("T")
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class DiskStartup:
    """What start() found on disk."""

    blobs: int
    bytes: int
    temp_removed: int
    corrupt_removed: int
    duplicates_removed: int
    seconds: float


class DiskAdapter(AdapterCore[str]):
    """`_held` maps each key to its current file's path."""

    kind = "disk"
    honours_pins = True

    def __init__(
        self,
        config: DiskAdapterConfig,
        default_dir: Path,
        executor: ThreadPoolExecutor,
        *,
        owns_executor: bool = False,
        sync_fd: Callable[[int], None] = os.fsync,
    ) -> None:
        super().__init__(config.name, int(config.capacity_gb * (1 << 30)))
        self.config = config
        self.dirs = [str(p) for p in config.paths] or [str(default_dir)]
        self.startup: DiskStartup | None = None
        self._executor = executor
        self._owns_executor = owns_executor
        self._files = BlobFiles(fsync=config.fsync == "always", direct=config.o_direct, sync_fd=sync_fd)
        self._reserved = 0
        self._writes: dict[str, asyncio.Future[OpResult]] = {}
        self._jobs = ExecutorJobs(executor)
        self._lock_fds: list[int] = []

    @property
    def direct_fallback(self) -> str | None:
        """Why O_DIRECT was turned off (the filesystem refused it), or None."""
        return self._files.direct_fallback

    def path_for(self, key: str) -> str:
        """A fresh file name for a new blob of `key`."""
        digest = blake3.blake3(key.encode("utf-8")).hexdigest()
        root = self.dirs[int(digest[-16:], 16) % len(self.dirs)]
        return os.path.join(root, digest[:2], f"{digest[:40]}-{secrets.token_hex(6)}{BLOB_SUFFIX}")

    def keys_lru(self) -> list[str]:
        """Keys from least to most recently used."""
        return self._held.keys()

    def path_of(self, key: str) -> str | None:
        """The current file of `key`, None when it is not indexed."""
        return self._held.get(key)

    def held_per_salt(self) -> dict[str, tuple[int, int]]:
        """Per tenant (as the bound `salt_of` says): bytes and blobs indexed. A scan, for tests."""
        return self._held.per_salt()

    # --- executor ------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._jobs.submit(fn, *args)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._submit(fn, *args))

    # --- start and close -----------------------------------------------------------------------

    async def _start(self) -> None:
        started = time.perf_counter()
        try:
            for root in self.dirs:
                self._lock_fds.append(await self._io(disk_dirs.prepare, root))
            reports = await asyncio.gather(
                *(self._io(disk_dirs.scan, os.path.join(root, sub)) for root in self.dirs for sub in SUBDIRS)
            )
        except BaseException:
            await self._release_locks()
            raise
        merged = ScanReport()
        for report in reports:
            merged.blobs.extend(report.blobs)
            merged.temp_removed += report.temp_removed
            merged.corrupt_removed += report.corrupt_removed
        merged.blobs.sort(key=lambda blob: blob.mtime)
        stale: list[str] = []
        for blob in merged.blobs:  # oldest first: a later file of the same key replaces it
            previous = self._held.put(blob.key, blob.path, blob.size)
            if previous is not None:
                stale.append(previous.value)
        if stale:
            await self._io(self._files.remove, stale)
        await self._evict_to(self._capacity)
        self._stats.integrity_failures += merged.corrupt_removed
        self.startup = DiskStartup(
            blobs=len(self._held),
            bytes=self._held.bytes,
            temp_removed=merged.temp_removed,
            corrupt_removed=merged.corrupt_removed,
            duplicates_removed=len(stale),
            seconds=time.perf_counter() - started,
        )
        log.info("disk_l2_started", adapter=self.name, dirs=self.dirs, **asdict(self.startup))

    async def _close(self) -> None:
        await self._jobs.wait(CLOSE_WAIT_S)
        await self._release_locks()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _release_locks(self) -> None:
        while self._lock_fds:
            disk_dirs.release(self._lock_fds.pop())  # close(2) of a lock file: never blocks

    # --- operations ----------------------------------------------------------------------------

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        return list(await asyncio.gather(*(self._store_one(key, blob) for key, blob in items)))

    async def _store_one(self, key: str, blob: EncodedBlob) -> OpResult:
        in_flight = self._writes.get(key)
        if in_flight is not None:
            return await asyncio.shield(in_flight)
        done = asyncio.get_running_loop().create_future()
        self._writes[key] = done
        result = OpResult.error("store interrupted")
        try:
            result = await self._write(key, blob)
            return result
        finally:
            del self._writes[key]
            done.set_result(result)

    async def _write(self, key: str, blob: EncodedBlob) -> OpResult:
        size = blob.nbytes
        if size > self._capacity:
            return OpResult(Status.NO_SPACE, f"blob of {size} bytes exceeds capacity {self._capacity}")
        # Reserved before making room: writes that run together each make room for their own blob
        # (reserved after, one write's room was taken by the next, and a full tier refused it).
        self._reserved += size
        try:
            await self._evict_to(self._capacity - self._reserved)
            if self._held.bytes + self._reserved > self._capacity:
                return OpResult(Status.NO_SPACE, "no room: capacity held by writes in flight")
            path = self.path_for(key)
            await self._io(self._files.write_atomic, path, blob.segments)
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                return OpResult(Status.NO_SPACE, f"filesystem full: {exc}")
            return OpResult.error(f"write failed: {exc}")
        finally:
            self._reserved -= size
        previous = self._held.put(key, path, size)
        if previous is not None:
            await self._io(self._files.remove, [previous.value])
        return OK

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        return [OK if key in self._held else MISS for key in keys]

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        return list(await asyncio.gather(*(self._load_one(key) for key in keys)))

    async def _load_into(self, keys: list[str], outs: list[memoryview]) -> list[LoadResult]:
        return await gather_all(self._load_one(key, out) for key, out in zip(keys, outs, strict=True))

    async def _load_checked(
        self, keys: list[str], outs: list[memoryview], check: BlobCheck
    ) -> list[LoadResult]:
        check = check.beside(self.config.io_threads)  # checks run in as many threads at once
        return await gather_all(self._load_one(key, out, check) for key, out in zip(keys, outs, strict=True))

    async def _load_one(
        self, key: str, out: memoryview | None = None, check: BlobCheck | None = None
    ) -> LoadResult:
        entry = self._held.entry(key)
        if entry is None:
            return LoadResult(Status.MISS)
        self._held.touch(key)
        path = entry.value
        try:
            if out is None:
                data: Placed | bytes | memoryview | None = await self._io(self._files.read, path, entry.size)
            else:
                job = self._submit(self._read_checked, path, entry.size, key, out, check)
                data = await settled(job)
        except IntegrityError as exc:  # the caller's check, run in the reading thread
            return LoadResult.check_failed(exc)
        except BadFile as exc:
            self._stats.integrity_failures += 1
            log.warning("disk_l2_bad_file", adapter=self.name, error=str(exc))
            if self._held.discard(key, entry):
                await self._io(self._files.remove, [path])
            return LoadResult(Status.MISS)
        except OSError as exc:
            return LoadResult.error(f"read failed: {exc}")
        if data is None:
            self._held.discard(key, entry)  # vanished: forgotten unless a newer write replaced it
            return LoadResult(Status.MISS)
        if isinstance(data, Placed):
            return LoadResult.placed(data.header, checked=check is not None)
        return LoadResult(Status.OK, data, checked=check is not None)

    def _read_checked(
        self, path: str, size: int, key: str, out: memoryview, check: BlobCheck | None
    ) -> Placed | bytes | memoryview | None:
        """In an I/O thread (touches `_files` alone): the blob read into out (read_into), then, with
        a check, checked right there while its bytes are fresh in this core's caches: a payload
        read in place verified in out, any other blob decoded into out. IntegrityError if it fails."""
        data = self._files.read_into(path, size, blob_header.header_size(key), out)
        if data is not None and check is not None:
            if isinstance(data, Placed):
                check(key, data.header, out, True)
            else:
                check(key, data, out, False)
        return data

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        results, paths = self._forget_each(keys)
        if paths:
            await self._io(self._files.remove, paths)
        return results

    async def _capacity_changed(self, capacity_bytes: int) -> None:
        if not self.closed:
            await self._evict_to(capacity_bytes - self._reserved)

    async def _evict_salt(self, salt: str, nbytes: int) -> int:
        paths: list[str] = []
        freed = 0
        for key in self._held.oldest(salt, nbytes, self._kept):
            entry = self._held.pop(key, evicted=True)
            assert entry is not None
            self._count_eviction(entry.size)
            freed += entry.size
            paths.append(entry.value)
        if paths:
            await self._io(self._files.remove, paths)
        return freed

    # --- bookkeeping ---------------------------------------------------------------------------

    async def _evict_to(self, limit: int) -> None:
        """Evict least recently used blobs (not those pins hold) until at most `limit` bytes are
        held, or only pinned blobs are left."""
        paths: list[str] = []
        held = self._held
        for key in held.oldest(None, held.bytes - limit, self._kept):
            entry = held.pop(key, evicted=True)
            assert entry is not None
            self._count_eviction(entry.size)
            paths.append(entry.value)
        if paths:
            await self._io(self._files.remove, paths)


def default_dir(config: DiskAdapterConfig, data_dir: Path) -> Path:
    """<data_dir>/l2-disk, or <data_dir>/l2-disk-<name> for a name other than "disk" (two disk
    adapters never share a directory by default)."""
    return data_dir / ("l2-disk" if config.name == "disk" else f"l2-disk-{config.name}")


def build(config: DiskAdapterConfig, context: BuildContext) -> DiskAdapter:
    """The registry's builder (storage/registry.py): files under config.paths or `default_dir`,
    io_threads threads for the file I/O."""
    executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvdepot-l2-{config.name}")
    return DiskAdapter(config, default_dir(config, context.data_dir), executor, owns_executor=True)

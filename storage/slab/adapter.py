"""SlabAdapter: the slab-file L2. Preallocated files (or raw block devices) cut into fixed slots,
one blob per slot, written and read with O_DIRECT: no file per chunk, no filesystem metadata on the
hot path.

State (event loop only): the index key -> SlotRef in least-recently-used order (`_held`, which
reports every change to the owner's accounting, storage/holdings.py), the free, read and written
slots (storage/slab/slots.py), the next generation, the store in flight per key, the checkpoint
schedule. Every file operation runs in the I/O executor passed in (storage/slab/files.py, which
owns the open files and the checkpoint writes); the loop never touches a file.

Placement: a key's digest picks its file (keys are sharded over config.paths); a write takes a
free slot of that file, evicting that file's least recently used blobs when it has none, and the
least recently used of all while the slots in use reach the capacity. Each write gets a new
generation; the index moves to the new slot once the write (and, with fsync "always", the
fdatasync of its batch) is done, and the old slot is zeroed, then freed (so that a later delete
cannot bring the older generation back after a crash).

Primitives in call order:
  start()          open (or create, preallocate, format) each path, scan every slot's head, merge
                   with the checkpoint (newest valid generation per key); ConfigError, naming the
                   adapter and path, for a foreign, damaged or wrongly sized file. `startup` reports
  store(items)     a slot each (ERROR: larger than a slot; NO_SPACE: none to be had), headers and
                   payload in one O_DIRECT write from the caller's memory, one fdatasync per file
                   per batch (config.fsync), then the index. A store of a key being written waits
                   for that write and shares its result
  contains(keys)   the index alone
  load(keys) / load_into(keys, outs)
                   the slot's header must name the key at the indexed generation and lengths (else
                   a MISS, counted, forgotten); load_into reads a raw payload straight into out
                   (aligned; else through a bounce buffer), refuses unread a blob longer than any
                   for out, and never returns while its reads may still write into out
  delete(keys) / evict_salt(salt, nbytes)
                   entries dropped, their slots' heads zeroed (durable), then freed
  set_capacity(n)  evicts down to n // slot_bytes slots
  close()          waits (bounded) for I/O in flight, checkpoints the index, closes the files

Checkpoints: at most every config.checkpoint_s after a change, and at close. Capacity evictions
do not zero their slots (rewritten soon): after a crash such a blob may come back, with its bytes.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import structlog

from storage.base import MISS, OK, BuildContext, LoadResult, OpResult, Status
from storage.codec import EncodedBlob, blob_header
from storage.common import AdapterCore
from storage.inflight import Placed, gather_all
from storage.slab import headers as fmt
from storage.slab import index
from storage.slab.config import SlabAdapterConfig
from storage.slab.file import SlotReadError
from storage.slab.files import SlabFiles
from storage.slab.slots import SlotRef, SlotSpace, SlotWrite, StaleSlot, read_blob, write_and_sync

log = structlog.get_logger("kvdepot.storage.slab")

T = TypeVar("T")


class SlabAdapter(AdapterCore[SlotRef]):
    kind = "slab"

    def __init__(
        self,
        config: SlabAdapterConfig,
        default_path: Path,
        checkpoint_path: Path,
        executor: ThreadPoolExecutor,
        *,
        owns_executor: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config.name, index.default_capacity(config))
        self.config = config
        self.paths = [str(p) for p in config.paths] or [str(default_path)]
        self.checkpoint_path = str(checkpoint_path)
        self.startup: index.SlabStartup | None = None
        self.files = SlabFiles(
            config.name, self.paths, self.checkpoint_path, executor, owns_executor=owns_executor,
            checkpointer=index.Checkpointer(config.checkpoint_s, clock, config.name),
        )  # fmt: skip
        self._space = SlotSpace()
        self._total_slots = 0
        self._next_generation = 1
        self._writes: dict[str, asyncio.Future[OpResult]] = {}

    @property
    def checkpoints(self) -> int:
        """Checkpoints written since start."""
        return self.files.checkpointer.written

    def keys_lru(self) -> list[str]:
        """Keys from least to most recently used."""
        return self._held.keys()

    def slot_of(self, key: str) -> tuple[str, int, int] | None:
        """(file path, byte offset of its slot, payload offset within the slot) of `key`, for tests."""
        held = self._held.entry(key)
        if held is None:
            return None
        ref = held.value
        file = self.files[ref.file]
        return file.path, file.offset(ref.slot), fmt.payload_offset(ref.head_len)

    # --- start and close -----------------------------------------------------------------------

    async def _start(self) -> None:
        started = time.perf_counter()
        cfg = self.config
        scans, checkpoint = await self.files.open(cfg.size_bytes, cfg.slot_bytes)
        files = self.files.files
        file_ids = [f.file_id.hex() for f in files]
        merged = index.merge(index.scanned(file_ids, scans), checkpoint)
        entries, older = index.placed(merged, file_ids)
        for key, ref, size in entries:
            self._held.put(key, ref, size)
        used = {(ref.file, ref.slot) for _, ref, _ in entries} | {(ref.file, ref.slot) for ref in older}
        self._space.reset([f.slots for f in files], used)
        self._zero_later(older)  # older generations of indexed keys: free once zeroed
        self._total_slots = sum(f.slots for f in files)
        if cfg.capacity_gb is None:
            self._capacity = self._total_slots * cfg.slot_bytes
        self._next_generation = merged.next_generation
        self._evict_to(self._budget())
        self.startup = index.SlabStartup.found(
            scans, merged, checkpoint_used=checkpoint is not None, blobs=len(self._held),
            nbytes=self._held.bytes, started=started,
        )  # fmt: skip
        self._stats.integrity_failures += self.startup.invalid_slots
        log.info("slab_l2_started", adapter=self.name, paths=self.paths, **asdict(self.startup))

    async def wait_io(self) -> None:
        """Wait until no file operation (a checkpoint included) is running."""
        await self.files.wait_io()

    async def _close(self) -> None:
        await self.files.close(self._snapshot if self._started else None)

    # --- checkpoints ---------------------------------------------------------------------------

    def _snapshot(self) -> index.Checkpoint:
        held = []
        for key in self._held:
            entry = self._held.entry(key)
            assert entry is not None
            held.append((key, entry.value, entry.size))
        file_ids = [f.file_id.hex() for f in self.files.files]
        return index.checkpoint_of(held, file_ids, self.config.slot_bytes, self._next_generation)

    def _changed(self) -> None:
        """The index or its order changed: checkpoint it when the last one is old enough."""
        if not self._closed:
            self.files.checkpoint_soon(self._snapshot)

    # --- slots ---------------------------------------------------------------------------------

    def _budget(self) -> int:
        return min(self._total_slots, self._capacity // self.config.slot_bytes)

    def _evict(self, key: str) -> None:
        held = self._held.pop(key, evicted=True)
        assert held is not None
        self._count_eviction(held.size)
        self._space.release(held.value)

    def _evict_to(self, slots: int) -> None:
        while len(self._held) + self._space.writing > slots and len(self._held):
            self._evict(next(iter(self._held)))

    def _oldest_in(self, file: int) -> str | None:
        for key in self._held:
            held = self._held.entry(key)
            if held is not None and held.value.file == file:
                return key
        return None

    def _take_slot(self, file: int) -> int | None:
        self._evict_to(self._budget() - 1)
        if len(self._held) + self._space.writing >= self._budget():
            return None
        while not self._space.has_free(file):
            oldest = self._oldest_in(file)
            if oldest is None:
                return None
            self._evict(oldest)
        return self._space.take(file)

    # --- operations ----------------------------------------------------------------------------

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        results: list[OpResult | None] = [None] * len(items)
        waits: list[tuple[int, asyncio.Future[OpResult]]] = []
        mine: list[tuple[int, str, EncodedBlob]] = []
        loop = asyncio.get_running_loop()
        for i, (key, blob) in enumerate(items):
            in_flight = self._writes.get(key)
            if in_flight is not None:
                waits.append((i, in_flight))
                continue
            self._writes[key] = loop.create_future()
            mine.append((i, key, blob))
        written: list[OpResult] = [OpResult.error("store interrupted")] * len(mine)
        try:
            written = await self._write_batch([(key, blob) for _, key, blob in mine])
        finally:
            for (i, key, _), result in zip(mine, written, strict=True):
                results[i] = result
                self._writes.pop(key).set_result(result)
        for i, fut in waits:
            results[i] = await asyncio.shield(fut)
        self._changed()
        return [r if r is not None else OpResult.error("store lost") for r in results]

    async def _write_batch(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        slot_bytes = self.config.slot_bytes
        results: list[OpResult] = [OpResult.error("store interrupted")] * len(items)
        plan: list[tuple[int, SlotWrite]] = []
        for i, (key, blob) in enumerate(items):
            if fmt.slot_need(len(blob.header), blob.payload.nbytes) > slot_bytes:
                results[i] = OpResult.error(
                    f"blob of {blob.nbytes} bytes does not fit a slot of {slot_bytes} bytes"
                )
                continue
            digest = fmt.key_digest(key)
            file = int.from_bytes(digest[:8], "little") % len(self.files)
            slot = self._take_slot(file)
            if slot is None:
                results[i] = OpResult(Status.NO_SPACE, "no free slot: every slot is being written or read")
                continue
            ref = SlotRef(file, slot, self._next_generation, len(blob.header))
            plan.append((i, SlotWrite(key, blob, ref)))
            self._next_generation += 1
        outcomes: list[BaseException | None] = []
        try:
            writes = [w for _, w in plan]
            outcomes = await write_and_sync(
                self.files.run, self.files.files, writes, fsync=self.config.fsync == "always"
            )
        finally:
            outcomes += [asyncio.CancelledError()] * (len(plan) - len(outcomes))
            for (i, w), exc in zip(plan, outcomes, strict=True):
                self._space.written()
                if exc is not None:
                    self._space.release(w.ref)
                    results[i] = OpResult.error(f"write failed: {exc!r}")
                    continue
                previous = self._held.put(w.key, w.ref, w.blob.nbytes)
                if previous is not None:  # zeroed: a later delete must not bring this one back
                    self._zero_later([previous.value])
                results[i] = OK
        return results

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        return [OK if key in self._held else MISS for key in keys]

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        results = await gather_all(self._load_one(key) for key in keys)
        self._changed()
        return results

    async def _load_into(self, keys: list[str], outs: list[memoryview]) -> list[LoadResult]:
        results = await gather_all(self._load_one(key, out) for key, out in zip(keys, outs, strict=True))
        self._changed()
        return results

    async def _load_one(self, key: str, out: memoryview | None = None) -> LoadResult:
        held = self._held.entry(key)
        if held is None:
            return LoadResult(Status.MISS)
        ref = held.value
        if out is not None and held.size > blob_header.header_size(key) + out.nbytes:
            return LoadResult.too_long(f"slab blob of {held.size} bytes, a blob for this chunk has at most "
                                       f"{blob_header.header_size(key) + out.nbytes}")  # fmt: skip
        self._held.touch(key)
        self._space.reading(ref)
        try:
            data = await self.files.run(read_blob, self.files[ref.file], key, ref, held.size, out)
        except StaleSlot as exc:
            self._stats.integrity_failures += 1
            log.warning("slab_l2_stale_slot", adapter=self.name, error=str(exc))
            if self._held.discard(key, held):
                self._space.release(ref)
            return LoadResult(Status.MISS)
        except (OSError, SlotReadError) as exc:
            return LoadResult.error(f"read failed: {exc!r}")
        finally:
            self._space.read_done(ref)
        if isinstance(data, Placed):
            return LoadResult.placed(data.header)
        return LoadResult.hit(data)

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        results, refs = self._forget_each(keys)
        await self._zero(refs)
        self._changed()
        return results

    async def _zero(self, refs: list[SlotRef]) -> None:
        """Zero the slots' heads (so they stay empty after a crash); each is freed once zeroed."""
        await asyncio.gather(*(asyncio.shield(job) for job in self._zero_later(refs)), return_exceptions=True)

    def _zero_later(self, refs: list[SlotRef]) -> list[asyncio.Future[None]]:
        """As _zero without waiting: each slot is freed once its head is zeroed (or failed to be)."""
        jobs = []
        for ref in refs:
            try:
                job = asyncio.wrap_future(self.files.submit(self.files[ref.file].invalidate, ref.slot))
            except RuntimeError:  # the executor is shut down: the adapter is closing
                self._space.release(ref)
                continue
            job.add_done_callback(functools.partial(self._zeroed, ref))
            jobs.append(job)
        return jobs

    def _zeroed(self, ref: SlotRef, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("slab_l2_zero_failed", adapter=self.name, error=repr(fut.exception()))
        self._space.release(ref)

    async def _capacity_changed(self, capacity_bytes: int) -> None:
        if self._started and not self.closed:
            self._evict_to(self._budget())
            self._changed()

    async def _evict_salt(self, salt: str, nbytes: int) -> int:
        refs: list[SlotRef] = []
        freed = 0
        for key in self._held.oldest(salt, nbytes):
            held = self._held.pop(key, evicted=True)
            assert held is not None
            self._count_eviction(held.size)
            freed += held.size
            refs.append(held.value)
        await self._zero(refs)
        self._changed()
        return freed


def default_path(config: SlabAdapterConfig, data_dir: Path) -> Path:
    """<data_dir>/l2-slab, or <data_dir>/l2-slab-<name> for a name other than "slab"."""
    return data_dir / ("l2-slab" if config.name == "slab" else f"l2-slab-{config.name}")


def checkpoint_path(config: SlabAdapterConfig, data_dir: Path) -> Path:
    """The index checkpoint: <data_dir>/l2-slab[-<name>].index."""
    return data_dir / f"{default_path(config, data_dir).name}.index"


def build(config: SlabAdapterConfig, context: BuildContext) -> SlabAdapter:
    """The registry's builder (storage/registry.py): slab files config.paths or `default_path`,
    io_threads threads."""
    executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvdepot-l2-{config.name}")
    data_dir = context.data_dir
    default, checkpoint = default_path(config, data_dir), checkpoint_path(config, data_dir)
    return SlabAdapter(config, default, checkpoint, executor, owns_executor=True)

"""MockAdapter: an in-memory L2 with capacity, simulated bandwidth and latency, and injected faults.

For tests and benchmarks of everything above storage/. State (event loop only): key -> blob bytes
in least-recently-used order (`_held`, which reports every change to the owner's accounting),
capacity, and a seeded RNG, so a given seed and call sequence always injects the same faults.

Simulation, per batch: sleep `latency_ms`, plus bytes moved / `bandwidth_gbps` (read as 10**9
bytes per second) when set. Faults, per key, drawn in key order:
  - error_rate    the key's result is ERROR (nothing is stored, loaded or deleted for it)
  - corrupt_rate  a load returns the blob with one byte flipped, which codec.decode_into rejects
  - hang          every operation waits forever; close() ends them with ERROR results

Primitives in call order: store, contains, load, load_into, delete, usage, set_capacity,
evict_salt, close (AdapterCore). Room is made on store by evicting least-recently-used blobs; a blob
larger than the whole capacity is NO_SPACE (and what the key held before is gone). Loads refresh
recency; contains does not. evict_salt forgets the tenant's least recently used blobs (no faults,
no simulated time). close() drops every blob.

load_into behaves as a real tier's: after the same simulation and faults as load, a blob whose
header says raw with a payload of len(out) (blob_header.fits_in_place) has its payload copied into out
(on the loop: this is a test double) and answers with its header; a value longer than any blob for
the out is too_long (counted, deleted, MISS: storage/common.py); any other blob comes back whole.
`authenticate` (config) is read by the controllers: they then sign what they store here and check
the MAC of what they load, as for Redis.
A corrupted blob is caught either way: by codec.verify_in_place when read in place, else by
codec.decode_into.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import TypeVar

from storage.base import MISS, OK, BuildContext, LoadResult, OpResult, Status
from storage.codec import EncodedBlob, blob_header
from storage.common import AdapterCore
from storage.mock.config import MockAdapterConfig

INJECTED = "injected fault"

R = TypeVar("R", OpResult, LoadResult)


class MockAdapter(AdapterCore[bytes]):
    kind = "mock"

    def __init__(self, config: MockAdapterConfig) -> None:
        super().__init__(config.name, int(config.capacity_gb * (1 << 30)))
        self.config = config
        self._rng = random.Random(config.seed)

    # --- simulation ----------------------------------------------------------------------------

    async def _simulate(self, nbytes: int) -> None:
        if self.config.hang:
            await asyncio.Event().wait()  # until close() cancels it
        delay = self.config.latency_ms / 1000.0
        if self.config.bandwidth_gbps:
            delay += nbytes / (self.config.bandwidth_gbps * 1e9)
        if delay > 0:
            await asyncio.sleep(delay)

    def _fails(self) -> bool:
        return self.config.error_rate > 0 and self._rng.random() < self.config.error_rate

    def _corrupts(self) -> bool:
        return self.config.corrupt_rate > 0 and self._rng.random() < self.config.corrupt_rate

    # --- primitives ----------------------------------------------------------------------------

    async def _store(self, items: list[tuple[str, EncodedBlob]]) -> list[OpResult]:
        await self._simulate(sum(blob.nbytes for _, blob in items))
        results: list[OpResult] = []
        for key, blob in items:
            if self._fails():
                results.append(OpResult.error(INJECTED))
                continue
            if blob.nbytes > self._capacity:
                self._held.pop(key)
                results.append(OpResult(Status.NO_SPACE, f"blob of {blob.nbytes} bytes exceeds capacity"))
                continue
            previous = self._held.entry(key)
            self._evict_to(self._capacity - blob.nbytes + (0 if previous is None else previous.size), key)
            self._held.put(key, blob.to_bytes(), blob.nbytes)
            results.append(OK)
        return results

    async def _contains(self, keys: list[str]) -> list[OpResult]:
        await self._simulate(0)
        return self._per_key(keys, lambda key: OK if key in self._held else MISS, OpResult.error)

    async def _load(self, keys: list[str]) -> list[LoadResult]:
        await self._simulate(sum(len(self._held.get(key) or b"") for key in keys))
        return self._per_key(keys, self._load_one, LoadResult.error)

    def _load_one(self, key: str) -> LoadResult:
        data = self._held.get(key)
        if data is None:
            return LoadResult(Status.MISS)
        self._held.touch(key)
        if data and self._corrupts():
            flipped = bytearray(data)
            flipped[self._rng.randrange(len(flipped))] ^= 0xFF
            data = bytes(flipped)
        return LoadResult.hit(data)

    async def _load_into(self, keys: list[str], outs: list[memoryview]) -> list[LoadResult]:
        results = await self._load(keys)
        for i, (key, out, result) in enumerate(zip(keys, outs, results, strict=True)):
            if not result.ok or result.data is None:
                continue
            blob = memoryview(result.data)
            head_len = blob_header.header_size(key)
            if blob.nbytes > head_len + out.nbytes:
                results[i] = LoadResult.too_long(
                    f"a value of {blob.nbytes} bytes for a {out.nbytes}-byte chunk"
                )
            elif blob.nbytes == head_len + out.nbytes and blob_header.fits_in_place(
                blob[:head_len], out.nbytes
            ):
                out[:] = blob[head_len:]
                results[i] = LoadResult.placed(bytes(blob[:head_len]))
        return results

    async def _delete(self, keys: list[str]) -> list[OpResult]:
        await self._simulate(0)
        return self._per_key(keys, lambda key: MISS if self._held.pop(key) is None else OK, OpResult.error)

    def _per_key(self, keys: list[str], answer: Callable[[str], R], error: Callable[[str], R]) -> list[R]:
        """`answer(key)` for each key in order, or an injected ERROR when the injector draws one."""
        return [error(INJECTED) if self._fails() else answer(key) for key in keys]

    async def _capacity_changed(self, capacity_bytes: int) -> None:
        self._evict_to(capacity_bytes)

    async def _close(self) -> None:
        self._held.clear()

    # --- bookkeeping ---------------------------------------------------------------------------

    def keys_lru(self) -> list[str]:
        """Keys from least to most recently used (tests assert eviction order with it)."""
        return self._held.keys()

    def held_per_salt(self) -> dict[str, tuple[int, int]]:
        """Per tenant (as the bound `salt_of` says): bytes and blobs held. A scan, for tests."""
        return self._held.per_salt()

    def _evict_to(self, limit: int, keep: str | None = None) -> None:
        """Evict least recently used blobs until at most `limit` bytes are held; `keep` (the key
        being stored again) is not evicted: its bytes are replaced, not added."""
        held = self._held
        kept = 1 if keep is not None and keep in held else 0
        while held.bytes > limit and len(held) > kept:
            oldest = next(iter(held))
            if oldest == keep:
                held.touch(keep)
                continue
            entry = held.pop(oldest, evicted=True)
            assert entry is not None
            self._count_eviction(entry.size)


def build(config: MockAdapterConfig, context: BuildContext) -> MockAdapter:
    """The registry's builder (storage/registry.py): memory only, no executor."""
    return MockAdapter(config)

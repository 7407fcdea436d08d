"""Tiny factories for real engine objects (no mocks): an arena (a sealed memfd), an L1 cache, an engine,
an engine with its L2 machinery (tiers, write-behind, prefetch), the control plane's
administration of an engine. Built by app/main's builders, so they are wired as the service is."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from app.settings import AdapterConfig, L1Settings, L2Settings
from app.wiring import build_admin, build_cache, build_engine, build_l2
from engine.admin import Administration
from engine.answers import StorePolicy
from engine.events import EventBus
from engine.facade import CacheEngine
from engine.keys import KVLayout, Namespace, ObjectKey
from engine.l1.arena import SealedArena, SharedArena
from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l2.store_queue import StoreQueue
from engine.tenants.ledger import TenantLedger
from kvdepot_connector.protocol import encode_tokens
from storage.auth import BlobKeys
from storage.base import L2Adapter
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def small_layout(chunk_size: int = 16, num_layers: int = 2, head_dim: int = 32) -> KVLayout:
    """A layout whose chunk is 2*layers*heads*head_dim*chunk*2 bytes (4 KiB by default)."""
    return KVLayout(
        dtype="float16", num_layers=num_layers, num_kv_heads=1, head_dim=head_dim, block_size=chunk_size,
        kind="test", chunk_size=chunk_size,
    )  # fmt: skip


def key(n: int, salt: str = "") -> ObjectKey:
    return ObjectKey(Namespace("model", b"\x00" * 8), salt, n.to_bytes(32, "little"))


def tokens(n: int, start: int = 0) -> bytes:
    return encode_tokens(list(range(start, start + n)))


def seq(n_chunks: int, which: int, chunk_size: int = 16) -> bytes:
    """`n_chunks` chunks of token sequence `which`: sequences of one `which` share their prefixes,
    those of different ones (under 10^4 tokens) share nothing."""
    return tokens(n_chunks * chunk_size, start=which * 10_000)


@contextmanager
def arena(size: int) -> Iterator[SharedArena]:
    a = SealedArena.create_sealed(size, f"test{uuid.uuid4().hex[:8]}", populate=False)
    try:
        yield a
    finally:
        a.close()


def make_cache(capacity: int, *, alignment: int = 4096, high: float = 1.0, low: float = 1.0) -> L1Cache:
    return build_cache(l1_settings(alignment=alignment, high=high, low=low), capacity)


def l1_settings(
    *, chunk_size: int = 16, alignment: int = 4096, read_lease_s: float = 20.0, write_lease_s: float = 10.0,
    high: float = 1.0, low: float = 1.0, max_request_share: float = 1.0,
) -> L1Settings:  # fmt: skip
    """Settings for tiny test arenas; one request may take all of L1 unless a test says otherwise."""
    return L1Settings(
        chunk_size=chunk_size, alignment=alignment, read_lease_s=read_lease_s, write_lease_s=write_lease_s,
        high_watermark=high, low_watermark=low, max_request_share=max_request_share,
    )  # fmt: skip


def reserve(cache: L1Cache, k: ObjectKey, size: int, now: float) -> L1Object | None:
    """`cache.try_reserve`, with None for either refusal."""
    got = cache.try_reserve(k, size, now)
    return got if isinstance(got, L1Object) else None


@contextmanager
def engine(
    capacity: int, *, chunk_size: int = 16, read_lease_s: float = 20.0, write_lease_s: float = 10.0,
    high: float = 1.0, low: float = 1.0, max_request_share: float = 1.0, events: EventBus | None = None,
) -> Iterator[tuple[CacheEngine, FakeClock]]:  # fmt: skip
    """An engine without L2 over a `capacity`-byte arena, publishing on `events` (None: a disabled
    bus), on a fake clock."""
    clock = FakeClock()
    l1 = l1_settings(
        chunk_size=chunk_size,
        read_lease_s=read_lease_s,
        write_lease_s=write_lease_s,
        high=high,
        low=low,
        max_request_share=max_request_share,
    )
    with arena(capacity) as a:
        cache = build_cache(l1, a.size, events=events)
        yield build_engine(l1, arena=a, cache=cache, clock=clock), clock


def admin(eng: CacheEngine) -> Administration:
    """Quota (kept in memory) and L2 administration of `eng`, as the control plane has it."""
    return build_admin(eng)


def build_mock(config: AdapterConfig) -> L2Adapter:
    """The in-memory mock adapter of a `MockAdapterConfig` (what l2_engine builds by default)."""
    assert isinstance(config, MockAdapterConfig)
    return MockAdapter(config)


@asynccontextmanager
async def l2_engine(
    capacity: int, adapters: Sequence[AdapterConfig],
    build: Callable[[AdapterConfig], L2Adapter] = build_mock,
    *, chunk_size: int = 16, store_policy: StorePolicy = "all", store_workers: int = 1,
    ledger: TenantLedger | None = None, events: EventBus | None = None, keys: BlobKeys | None = None,
) -> AsyncIterator[tuple[CacheEngine, FakeClock]]:  # fmt: skip
    """An engine whose L1 writes go behind to `adapters` (built by `build`, started, accounted in
    the engine's tenant ledger, a fresh one unless given), with `store_workers` write-behind workers
    running; `engine.l2.store.wait_idle` tells when what was committed has been written. `keys`:
    the deployment's blob keys (tiers with `authenticate` sign and check with them)."""
    clock = FakeClock()
    executor = ThreadPoolExecutor(1, thread_name_prefix="test-codec")
    l1 = l1_settings(chunk_size=chunk_size)
    l2 = L2Settings(store_policy=store_policy, prefetch_deadline_ms=10_000, prefetch_max_inflight=8)
    with arena(capacity) as a:
        queue = StoreQueue(l2.store_queue_depth)
        ledger = ledger if ledger is not None else TenantLedger()
        cache = build_cache(l1, a.size, ledger, shedder=queue, events=events)
        parts = build_l2(
            l2, cache=cache, queue=queue, arena=a, build=build, executor=executor, clock=clock, keys=keys
        )
        eng = build_engine(l1, arena=a, cache=cache, l2=parts, clock=clock)
        store, prefetch, tiers = parts.store, parts.prefetch, parts.tiers
        loop = asyncio.get_running_loop()
        workers = [
            loop.create_task(store.run_worker(), name=f"test-l2-store-{i}") for i in range(store_workers)
        ]
        try:
            for config in adapters:
                await tiers.add(config)
            yield eng, clock
        finally:
            for worker in workers:
                worker.cancel()
            if workers:
                await asyncio.wait(workers)
            await prefetch.close()
            await tiers.close()
            executor.shutdown(wait=True)
        for worker in workers:
            if not worker.cancelled():
                worker.result()  # a worker that crashed fails the test with its exception

"""The builders: how the engine's parts are wired from their settings.

`Service.build` (app/main.py) and tests/factories.py both use them, so tests run the same wiring as
the service. Each builder takes the settings part it needs and the objects built before it.

Builders in call order:
  build_lifeline(data_dir, regions, sessions)        the lifeline server: one per data-plane session
  build_events(events)                               the one event bus (engine/events.py)
  subscribe_events(bus, subscribers)                 its subscribers, before its dispatcher runs
  build_cache(l1, capacity, ledger, shedder, events) L1: allocator, LRU, watermarks, leases
  build_l2(l2, cache=, queue=, arena=, build=, ...)  tiers, write-behind, prefetch (no adapter yet)
  build_engine(l1, arena=, cache=, l2=)              the data-plane facade
  build_admin(engine, quota_file, executor)          quotas and L2 administration
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

from api.dataplane.sessions import Session, SessionTable
from api.dataplane.workers import WorkerWatch
from api.lifeline import Lifeline, LifelineRefused, LifelineServer, SharedRegion
from app.settings import AdapterConfig, DataPlaneSettings, EventSettings, L1Settings, L2Settings
from engine.admin import Administration
from engine.events import EventBus, Subscriber
from engine.facade import CacheEngine
from engine.l1.allocator import ExtentAllocator
from engine.l1.arena import SealedArena, SharedArena
from engine.l1.cache import L1Cache
from engine.l1.domains import WriteDomains
from engine.l1.eviction import make_policy
from engine.l1.fences import ReleaseFences
from engine.l1.room import Shedder
from engine.l2.layouts import codec_options
from engine.l2.parts import L2Parts
from engine.l2.prefetch import PrefetchController
from engine.l2.store import StoreController
from engine.l2.store_queue import StoreQueue
from engine.l2.tiers import L2Tiers
from engine.tenants.labels import LABEL_FILE, LabelRegistry
from engine.tenants.ledger import TenantLedger
from engine.tenants.registry import QuotaRegistry
from gpu.sealed import SealedRegions, SealError
from storage.auth import BlobKeys
from storage.base import L2Adapter


def build_lifeline(
    data_dir: Path, regions: SealedRegions, sessions: SessionTable,
    offer: Callable[[], Sequence[tuple[str, int]]] | None = None,
    on_shared: Callable[[], None] | None = None, *, workers: WorkerWatch | None = None,
    arena: SealedArena | None = None, domains: WriteDomains | None = None,
    fences: ReleaseFences | None = None,
) -> LifelineServer:  # fmt: skip
    """The lifeline server at `<data_dir>/lifeline.sock`. A client process connects it with the
    token its data-plane session's HELLO reply handed out (random, used once), and the lifeline
    then holds that session: when it closes, the session ends (`sessions.end`). The server offers
    the descriptors `offer()` names (the arena's memfd); sealed regions a client shares land in
    `regions` under its engine instance, and go when the instance's last session ends; then
    `on_shared()` runs (the sidecar is about to be asked to copy into them). `workers` learns
    each lifeline's pid and heartbeats. With `arena` and `domains` (write domains), the offer is
    every segment read-only ("arena:<i>"), and each lifeline of an engine instance is granted
    ("write:<i>", read-write) the segments its instance writes: those it has at hello, and each new
    one at once (before the STORE reply naming it). With `fences`, every lifeline is offered the
    release-fence words read-only too ("fences": engine/l1/fences.py)."""

    def on_fds(line: Lifeline, shared: list[SharedRegion]) -> None:
        assert isinstance(line.holder, Session)
        for i, region in enumerate(shared):
            try:
                regions.add(line.holder.instance, region.name, region.fd, region.size)
            except SealError as exc:
                for rest in shared[i + 1 :]:
                    os.close(rest.fd)
                raise LifelineRefused(f"{region.name}: {exc}") from None
        if shared and on_shared is not None:
            on_shared()

    def on_closed(line: Lifeline) -> None:
        if isinstance(line.holder, Session):
            sessions.end(line.holder)

    def on_hello(line: Lifeline) -> None:
        if workers is not None and isinstance(line.holder, Session):
            workers.held(line.holder, line.pid)
        if domains is not None and arena is not None and isinstance(line.holder, Session):
            domains.note_process(line.holder.instance, line.pid)
            _grant(line, arena, domains.writable(line.holder.instance))

    def on_heartbeat(line: Lifeline) -> None:
        if workers is not None and isinstance(line.holder, Session):
            workers.beat(line.holder)

    sessions.on_instance_gone.append(regions.drop)
    if domains is not None and arena is not None:
        sessions.on_instance_gone.append(domains.gone)
    server = LifelineServer(
        data_dir / "lifeline.sock", authenticate=sessions.hold, on_fds=on_fds, on_closed=on_closed,
        offer=_offered(offer, arena, domains, fences), on_hello=on_hello, on_heartbeat=on_heartbeat,
    )  # fmt: skip
    if domains is not None and arena is not None:
        _grant_new_segments(server, arena, domains)
    return server


def _offered(
    offer: Callable[[], Sequence[tuple[str, int]]] | None, arena: SealedArena | None,
    domains: WriteDomains | None, fences: ReleaseFences | None,
) -> Callable[[object], Sequence[tuple[str, int]]] | None:  # fmt: skip
    """What every lifeline is offered at hello: with write domains each segment read-only, else
    what `offer()` names; and the release fences read-only, when there are some."""
    extra = [] if fences is None else [("fences", fences.readonly_fd)]
    if domains is not None and arena is not None:
        segments = [(f"arena:{i}", arena.readonly_fd(i)) for i in range(arena.segments)] + extra
        return lambda _holder: segments
    if offer is not None:
        return lambda _holder: [*offer(), *extra]
    return None


def _grant_new_segments(server: LifelineServer, arena: SealedArena, domains: WriteDomains) -> None:
    """A segment that joins an instance's write domain is granted at once to each of its lifelines."""

    def on_grant(instance: str, index: int) -> None:
        for line in list(server.lines):
            if isinstance(line.holder, Session) and line.holder.instance == instance:
                _grant(line, arena, [index])

    domains.on_grant = on_grant


def _grant(line: Lifeline, arena: SealedArena, segments: Sequence[int]) -> None:
    """Hand `line` the read-write descriptors of `segments`."""
    if segments:
        line.grant([(f"write:{i}", arena.segment_fd(i)) for i in segments])


def build_events(events: EventSettings) -> EventBus:
    """The sidecar's one event bus: given to the cache, which the engine and L2 parts share."""
    return EventBus(capacity=events.capacity, enabled=events.enabled, linger_s=events.linger_ms / 1000)


def subscribe_events(bus: EventBus, subscribers: Sequence[Subscriber]) -> None:
    """Subscribers join the bus here, at wiring time, before its dispatcher runs."""
    for callback in subscribers:
        bus.subscribe(callback)


def build_cache(
    l1: L1Settings, capacity: int, ledger: TenantLedger | None = None, shedder: Shedder | None = None,
    events: EventBus | None = None, *, domains: WriteDomains | None = None,
) -> L1Cache:  # fmt: skip
    """An L1 cache over `capacity` bytes of arena, evicting by `l1.eviction`, reporting into
    `ledger` (a fresh one if None), letting go of chunks queued for write-behind through `shedder`
    when it has no other room, publishing on `events` (None: a disabled bus), placing each writer's
    objects in its write domain's segments (`domains`; None: the arena is one segment)."""
    return L1Cache(
        ExtentAllocator(capacity, l1.alignment), make_policy(l1.eviction), high_watermark=l1.high_watermark,
        low_watermark=l1.low_watermark, write_lease_s=l1.write_lease_s, ledger=ledger, shedder=shedder,
        quarantine_max_bytes=l1.quarantine_max_bytes, events=events, domains=domains,
        quarantine_total_max_bytes=l1.quarantine_total_max_bytes,
    )  # fmt: skip


def build_l2(
    l2: L2Settings, *, cache: L1Cache, queue: StoreQueue, arena: SharedArena,
    build: Callable[[AdapterConfig], L2Adapter],
    executor: Executor, drain_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
    keys: BlobKeys | None = None,
) -> L2Parts:  # fmt: skip
    """The L2 machinery (no adapter attached yet): tiers building adapters with `build` and
    reporting into the cache's ledger, write-behind of what `queue` holds (the queue the cache was
    given as its shedder) and prefetch, running codecs in `executor`; blobs of tiers that
    authenticate are signed and checked with `keys`. They publish on the cache's event bus."""
    events = cache.events
    tiers = L2Tiers(build, drain_timeout_s=drain_timeout_s, ledger=cache.ledger, events=events)
    store = StoreController(
        cache=cache, arena=arena, tiers=tiers, queue=queue, policy=l2.store_policy,
        codec_options=functools.partial(codec_options, fp8_values=l2.fp8_values, lz4=l2.lz4),
        executor=executor, keys=keys, events=events,
    )  # fmt: skip
    prefetch = PrefetchController(
        cache=cache, arena=arena, tiers=tiers, deadline_s=l2.prefetch_deadline_ms / 1000,
        max_inflight=l2.prefetch_max_inflight, executor=executor, clock=clock, keys=keys, events=events,
    )  # fmt: skip
    return L2Parts(tiers=tiers, store=store, prefetch=prefetch)


def build_engine(
    l1: L1Settings, *, arena: SharedArena, cache: L1Cache, l2: L2Parts | None = None,
    clock: Callable[[], float] = time.monotonic, data_plane: DataPlaneSettings | None = None,
) -> CacheEngine:  # fmt: skip
    dp = data_plane or DataPlaneSettings()
    return CacheEngine(
        arena=arena, cache=cache, chunk_size=l1.chunk_size, read_lease_s=l1.read_lease_s, l2=l2, clock=clock,
        max_request_share=l1.max_request_share, max_registrations=dp.max_registrations,
        max_registrations_per_instance=dp.max_registrations_per_instance,
        registration_idle_s=dp.session_idle_s, events=cache.events,
    )  # fmt: skip


def build_admin(
    engine: CacheEngine, quota_file: Path | None = None, executor: Executor | None = None,
    allowed_roots: list[Path] | None = None,
) -> Administration:  # fmt: skip
    """Quota and L2 administration of `engine`; quotas saved to `quota_file` (None: in memory);
    disk adapters only under `allowed_roots` (None: anywhere)."""
    quotas = QuotaRegistry(engine.tenants, quota_file, executor)
    label_file = None if quota_file is None else quota_file.parent / LABEL_FILE
    labels = LabelRegistry(engine.tenants, label_file, executor if label_file is not None else None)
    return Administration(
        engine.tenants, quotas, engine.l2, allowed_roots=allowed_roots, labels=labels,
        fit_l1=engine.cache.fit_quota,
    )  # fmt: skip

"""Wiring: builds every component from the settings, runs them on one event loop, stops them.

`Service.build()` does everything that can fail on bad settings (the data dir and its lock, the
admin token file, shared memory, data plane and HTTP binds) and raises ConfigError with one line;
`Service.run()` starts the background tasks through the supervisor, serves until SIGTERM/SIGINT
(or `request_stop()`), then stops accepting, drains for `shutdown_timeout_s`, cancels the rest,
releases the arena and the data dir's lock and returns 0.
The engine's parts are wired by the builders of app/wiring.py (shared with tests/factories.py).
Nothing imports this module but the CLI and tests.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from api.audit import AuditLog
from api.dataplane.server import DataPlaneServer
from api.http.context import ControlContext
from api.lifeline import LifelineServer
from api.metrics_events import EventMetrics
from app import __version__
from app.datadir import DataDirLock, with_admin_token
from app.errors import ConfigError
from app.executors import Executors
from app.fleet_member import DirectoryMember
from app.kv_events import KvEvents
from app.loop_lag import LoopLag
from app.planes import build_control_plane, build_data_plane, build_observers
from app.serving import QuietUvicorn, bind_listener
from app.settings import Settings
from app.supervisor import Supervisor
from app.tracing import Tracing
from app.wiring import (
    build_admin,
    build_cache,
    build_engine,
    build_events,
    build_l2,
    build_lifeline,
    subscribe_events,
)
from engine.admin import Administration
from engine.events import EventBus, Subscriber
from engine.facade import CacheEngine
from engine.l1.arena import SealedArena, instance_id
from engine.l1.domains import WriteDomains
from engine.l1.fences import ReleaseFences
from engine.l2.parts import L2Parts
from engine.l2.reconcile import run_reconcile
from engine.l2.store_queue import StoreQueue
from engine.purge import PURGE_FILE, PurgeJobs
from engine.tenants.labels import LABEL_FILE, LabelRegistry
from engine.tenants.ledger import TenantLedger
from engine.tenants.registry import QUOTA_FILE, QuotaRegistry
from storage.auth import KEY_FILE, BlobKeys
from storage.registry import build_adapter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = structlog.get_logger("kvdepot")


class Service:
    def __init__(self, settings: Settings, *, span_exporter: SpanExporter | None = None) -> None:
        """`span_exporter`: spans go there (tests: the SDK's in-memory exporter), whether or not
        `tracing.otlp_endpoint` is set."""
        self.settings = settings
        self._span_exporter = span_exporter
        self.supervisor = Supervisor()
        self._started_at = time.monotonic()
        self._stop = asyncio.Event()
        self.arena: SealedArena | None = None
        self.fences: ReleaseFences | None = None
        self.engine: CacheEngine | None = None
        self.dataplane: DataPlaneServer | None = None
        self.lifeline: LifelineServer | None = None
        self.http_server: QuietUvicorn | None = None
        self.http_socket: socket.socket | None = None
        self.l2: L2Parts | None = None
        self.control: ControlContext | None = None
        self.admin: Administration | None = None
        #: purge and clear jobs, built with the control plane
        self.purge: PurgeJobs | None = None
        #: the KV-event publisher and its inventory (kv_events.endpoint set), bound at build
        self.kv_events: KvEvents | None = None
        #: the one event bus, built at start (app/wiring.build_events); subscribers: event_subscribers
        self.events: EventBus | None = None
        #: spans of each engine request over OTLP (tracing.otlp_endpoint set), a bus subscriber
        self.tracing: Tracing | None = None
        self.loop_lag: LoopLag | None = None
        self.event_metrics: EventMetrics | None = None
        self._lock: DataDirLock | None = None
        self._executors: Executors | None = None
        self._key_id = ""

    # --- ServiceHealth -------------------------------------------------------------------------

    def uptime_s(self) -> float:
        return time.monotonic() - self._started_at

    def components(self) -> dict[str, str]:
        failures = self.supervisor.failures()
        running = set(self.supervisor.running())
        out = {"l1": "running" if self.arena is not None and not self.arena.closed else "stopped"}
        names = ["dataplane", "lease-reaper", "http", "worker-watch"]
        if self.settings.events.enabled:
            names.append("events")
        names += [f"l2-store-{i}" for i in range(self.settings.l2.store_concurrency)]
        for name in names:
            out[name] = "failed" if name in failures else ("running" if name in running else "stopped")
        if self.dataplane is not None and out["dataplane"] == "running" and not self.dataplane.running:
            out["dataplane"] = "starting"
        if self.http_server is not None and out["http"] == "running" and not self.http_server.started:
            out["http"] = "starting"
        return out

    def not_ready(self) -> dict[str, str]:
        reasons = {name: state for name, state in self.components().items() if state != "running"}
        reasons.update(self.supervisor.failures())
        if self._stop.is_set():
            reasons["service"] = "stopping"
        return reasons

    # --- lifecycle -----------------------------------------------------------------------------

    def build(self) -> None:
        s = self.settings
        try:
            s.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"data_dir: cannot create {s.data_dir}: {exc.strerror}") from None
        # Only one sidecar per data dir; holding its lock, whatever a dead predecessor left is ours.
        self._lock = DataDirLock.acquire(s.data_dir)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """The steps in order, each using what the ones before it built."""
        s = self.settings = with_admin_token(self.settings)
        ex = self._executors = Executors()
        quota_file = s.data_dir / QUOTA_FILE
        ledger = TenantLedger(
            allowlist=s.tenants.allowlist, quotas=QuotaRegistry.load(quota_file),
            labels=LabelRegistry.load(s.data_dir / LABEL_FILE),
        )  # fmt: skip
        domains = self._build_arena(ex)
        keys = self._build_engine(ledger, domains, quota_file, ex)
        assert self.engine is not None
        obs = build_observers(s, self.engine, keys, self._span_exporter)
        self.event_metrics, self.kv_events, self.tracing = obs.event_metrics, obs.kv_events, obs.tracing
        self.loop_lag = obs.loop_lag
        self._key_id = keys.signer.key_id.hex()  # named to the directory, which hashes tenants alike
        registry = obs.registry
        assert self.arena is not None
        audit = AuditLog()  # the control plane's mutations and the data plane's CLEARs
        plane = build_data_plane(s, self.engine, registry=registry, audit=audit, executor=ex.transfer)
        server = self.dataplane = plane.server
        self.lifeline = build_lifeline(
            s.data_dir, plane.regions, server.sessions, on_shared=server.prepare_transfers,
            workers=server.workers, arena=self.arena, domains=domains,  # segments, not one memfd
            fences=self.fences,
        )  # fmt: skip
        server.bind()
        self.http_socket = bind_listener(s.http.host, s.http.port)
        assert self.admin is not None
        assert self.events is not None
        control = build_control_plane(
            s, self.engine, admin=self.admin, l2=self.l2, events=self.events,
            inventory=None if self.kv_events is None else self.kv_events.inventory, registry=registry,
            audit=audit, workers=plane.workers, health=self, executor=ex.state,
        )  # fmt: skip
        self.purge, self.pins, self.control = control.purge, control.pins, control.control
        subscribe_events(self.events, self.event_subscribers())
        self.http_server = control.http_server

    def _build_arena(self, ex: Executors) -> WriteDomains:
        """The L1 arena and its write domains."""
        s = self.settings
        # A sealed memfd: nothing in /dev/shm to clean after a crash; clients get its descriptor.
        # Write domains: segments of one writer each (engine/l1/domains.py).
        arena = self.arena = SealedArena.create_sealed(
            s.l1.size_bytes, instance_id(s.data_dir), populate=s.l1.populate,
            segment_bytes=min(s.l1.segment_mb << 20, s.l1.size_bytes // 16),
        )  # fmt: skip
        # Engines leave the sidecar a segment for its L2 loads (reserve).
        return WriteDomains(
            arena.size, arena.segment_bytes, zero=arena.zero, reserve=int(bool(s.l2.adapters)),
            scrubber=ex.scrub,
        )  # fmt: skip

    def _build_engine(
        self, ledger: TenantLedger, domains: WriteDomains, quota_file: Path, ex: Executors
    ) -> BlobKeys:
        """The event bus, L1, the L2 parts (no adapter yet), the facade and its administration;
        the deployment's blob keys."""
        s = self.settings
        assert self.arena is not None
        store_queue = StoreQueue(s.l2.store_queue_depth)  # L1 lets go of queued chunks when full
        # One bus for every component: the cache carries it to the engine and the L2 parts.
        events = self.events = build_events(s.events)
        cache = build_cache(
            s.l1, self.arena.size, ledger, shedder=store_queue, events=events, domains=domains
        )
        # A reader checks these words after its copy instead of waiting for its RELEASE's answer.
        cache.fences = self.fences = ReleaseFences(self.arena.size, self.arena.segment_bytes)
        data_dir = s.data_dir
        keys = BlobKeys.from_settings([k.get_secret_value() for k in s.l2.auth_keys], data_dir / KEY_FILE)
        self.l2 = build_l2(
            s.l2, cache=cache, queue=store_queue, arena=self.arena,
            build=lambda config: build_adapter(config, data_dir, keys),
            executor=ex.codec, drain_timeout_s=s.shutdown_timeout_s * 10, keys=keys,
        )  # fmt: skip
        self.engine = build_engine(s.l1, arena=self.arena, cache=cache, l2=self.l2, data_plane=s.data_plane)
        roots = s.l2.allowed_roots or [s.data_dir]
        self.admin = build_admin(self.engine, quota_file, ex.state, roots)
        return keys

    def event_subscribers(self) -> list[Subscriber]:
        """The event bus's subscribers, called once everything is built and before the bus runs
        (the KV-event publisher and the span builder join here)."""
        subscribers: list[Subscriber] = []
        if self.event_metrics is not None:
            subscribers.append(self.event_metrics.on_events)
        if self.kv_events is not None:
            subscribers.append(self.kv_events.publisher.on_events)
        if self.tracing is not None:
            subscribers.append(self.tracing.subscriber)
        return subscribers

    async def _start_l2(self) -> None:
        assert self.l2 is not None
        assert self.admin is not None
        for config in self.settings.l2.adapters:
            await self.admin.add_adapter(config)  # ConfigError naming the adapter when it cannot
        for i in range(self.settings.l2.store_concurrency):
            self.supervisor.start(f"l2-store-{i}", self.l2.store.run_worker(), drain=False)
        self.supervisor.start("l2-reconcile", run_reconcile(self.l2.tiers), drain=False)

    @property
    def http_port(self) -> int:
        if self.http_socket is None:
            raise RuntimeError("build() first")
        port: int = self.http_socket.getsockname()[1]
        return port

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        if self.engine is None or self.dataplane is None or self.http_server is None:
            raise RuntimeError("build() first")
        if self.http_socket is None:
            raise RuntimeError("build() first")
        s = self.settings
        await self._start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Everything built so far lives as long as the process: keep it out of the collector's
        # full passes, which otherwise stall the loop for tens of milliseconds now and then.
        gc.collect()
        gc.freeze()
        self._start_tasks()
        log.info(
            "kvdepot_started", version=__version__, http=f"http://{s.http.host}:{self.http_port}",
            data_plane=s.data_plane_url, l1_bytes=self.engine.cache.allocator.capacity,
            arena=self.engine.arena.name, chunk_size=s.l1.chunk_size,
            admin_token="set" if s.http.admin_token is not None else "none",
        )  # fmt: skip
        try:
            await self._stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            log.info("kvdepot_stopping", drain_timeout_s=s.shutdown_timeout_s)
            self.dataplane.stop()
            self.http_server.should_exit = True
            await self._shutdown_l2(s.shutdown_timeout_s)
            await self.supervisor.stop(s.shutdown_timeout_s)
            if self.events is not None:
                self.events.flush()  # what was published last reaches the subscribers
            self.close()
            log.info("kvdepot_stopped", uptime_s=round(self.uptime_s(), 3))
        return 0

    async def _start(self) -> None:
        """The L2 adapters and their workers, the purges a restart interrupted, the lifeline's
        listener; on failure what was built is closed."""
        try:
            await self._start_l2()
            if self.purge is not None:  # purges a restart interrupted go on (a tiny file, at start)
                self.purge.resume(PurgeJobs.load(self.settings.data_dir / PURGE_FILE))
            if self.lifeline is not None:
                try:
                    self.lifeline.start()
                except OSError as exc:
                    raise ConfigError(
                        f"data_dir: cannot listen on {self.lifeline.path}: {exc.strerror or exc}"
                    ) from None
        except BaseException:
            await self._shutdown_l2(0)
            self.close()
            raise

    def _start_tasks(self) -> None:
        """The background tasks, through the supervisor."""
        s, start = self.settings, self.supervisor.start
        assert self.engine is not None
        assert self.dataplane is not None
        assert self.http_server is not None
        assert self.http_socket is not None
        if self.loop_lag is not None:
            start("loop-lag", self.loop_lag.run(), drain=False)
        if self.kv_events is not None:
            self.kv_events.start()
        if self.events is not None and self.events.enabled:
            start("events", self.events.run(), drain=False)
        if self.tracing is not None:
            start("tracing-sweep", self.tracing.run_sweeper(), drain=False)
        start("dataplane", self.dataplane.serve())
        start("lease-reaper", self.engine.run_reaper(s.l1.reap_interval_s), drain=False)
        start("pin-sweeper", self.pins.run_sweeper(), drain=False)
        start("http", self.http_server.serve(sockets=[self.http_socket]))
        if s.fleet.directory_url is not None and self.kv_events is not None:
            member = DirectoryMember(s, self.engine, self.kv_events, self._key_id, self.http_port)
            start("directory-member", member.run(), drain=False)
        if self.dataplane.workers is not None:
            f = s.fleet
            sweep_s = min(f.heartbeat_s, f.worker_timeout_s / 4)
            start("worker-watch", self.dataplane.workers.run(sweep_s), drain=False)

    async def _shutdown_l2(self, drain_s: float) -> None:
        """Give write-behind up to `drain_s` to finish, then stop prefetches and close adapters."""
        if self.purge is not None:
            await self.purge.close()
        if self.l2 is None:
            return
        if not await self.l2.store.wait_idle(drain_s):
            log.warning("l2_writes_abandoned", pending=self.l2.store.depth)
        await self.l2.prefetch.close()
        await self.l2.tiers.close()

    def _on_signal(self, sig: int) -> None:
        log.info("signal_received", signal=signal.Signals(sig).name)
        self._stop.set()

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()  # after the bus's last flush (run): what it delivered is exported
            self.tracing = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        if self.dataplane is not None:
            self.dataplane.close()
            self.dataplane = None
        if self.http_socket is not None:
            self.http_socket.close()
            self.http_socket = None
        if self._executors is not None:  # the scrubber's memset ends before the arena is unmapped
            self._executors.close()
            self._executors = None
        if self.arena is not None:
            self.arena.close()
        if self.fences is not None:
            self.fences.close()
            self.fences = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


async def serve(settings: Settings) -> int:
    service = Service(settings)
    service.build()
    return await service.run()

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
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog
import uvicorn
from pydantic import SecretStr

from api.dataplane.server import DataPlaneServer
from api.http.app import create_app
from api.http.audit import AuditLog
from api.http.context import ControlContext
from api.lifeline import LifelineServer
from api.metrics import DataPlaneMetrics, PinCollector, build_registry
from api.metrics_events import EventMetrics
from api.metrics_workers import WorkerCollector
from app import __version__
from app.datadir import DataDirLock, admin_token_from_file
from app.errors import ConfigError
from app.fleet_member import DirectoryMember
from app.kv_events import KvEvents, build_kv_events
from app.serving import QuietUvicorn, bind_listener, guarded_http
from app.settings import Settings
from app.supervisor import Supervisor
from app.tracing import Tracing, build_tracing
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
from engine.l2.parts import L2Parts
from engine.l2.reconcile import run_reconcile
from engine.l2.store_queue import StoreQueue
from engine.pins.service import PIN_FILE, PinService
from engine.purge import PURGE_FILE, PurgeJobs
from engine.status import StatusReader
from engine.tenants.labels import LABEL_FILE, LabelRegistry
from engine.tenants.ledger import TenantLedger
from engine.tenants.registry import QUOTA_FILE, QuotaRegistry
from engine.workers import WorkerRegistry
from gpu.presence import cuda_may_be_present
from gpu.sealed import RegionLimits, SealedRegions
from storage.auth import KEY_FILE, BlobKeys
from storage.factory import build_adapter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from engine.transfers import KVTransfers

log = structlog.get_logger("kvdepot")


def with_admin_token(settings: Settings) -> Settings:
    """`settings` with the admin token of `http.admin_token_file` in `http.admin_token` (read, or
    generated on first start) when only the file is set; otherwise `settings` unchanged."""
    http = settings.http
    if http.admin_token is not None or http.admin_token_file is None:
        return settings
    token = SecretStr(admin_token_from_file(http.admin_token_file))
    return settings.model_copy(update={"http": http.model_copy(update={"admin_token": token})})


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
        self.event_metrics: EventMetrics | None = None
        self._lock: DataDirLock | None = None
        self._codec_executor: ThreadPoolExecutor | None = None
        self._transfer_executor: ThreadPoolExecutor | None = None
        self._scrub_executor: ThreadPoolExecutor | None = None
        self._state_executor: ThreadPoolExecutor | None = None
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
        s = self.settings = with_admin_token(self.settings)
        quota_file = s.data_dir / QUOTA_FILE
        ledger = TenantLedger(
            allowlist=s.tenants.allowlist, quotas=QuotaRegistry.load(quota_file),
            labels=LabelRegistry.load(s.data_dir / LABEL_FILE),
        )  # fmt: skip
        # A sealed memfd: nothing in /dev/shm to clean after a crash; clients get its descriptor.
        # Write domains: segments of one writer each (engine/l1/domains.py).
        self.arena = SealedArena.create_sealed(
            s.l1.size_bytes, instance_id(s.data_dir), populate=s.l1.populate,
            segment_bytes=min(s.l1.segment_mb << 20, s.l1.size_bytes // 16),
        )  # fmt: skip
        # A segment an engine instance left is zeroed in this thread, off the event loop.
        self._scrub_executor = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-scrub")
        domains = WriteDomains(
            self.arena.size, self.arena.segment_bytes, zero=self.arena.zero,
            reserve=int(bool(s.l2.adapters)), scrubber=self._scrub_executor,
        )  # engines leave the sidecar a segment for its L2 loads
        store_queue = StoreQueue(s.l2.store_queue_depth)  # L1 lets go of queued chunks when full
        # One bus for every component: the cache carries it to the engine and the L2 parts.
        events = self.events = build_events(s.events)
        cache = build_cache(
            s.l1, self.arena.size, ledger, shedder=store_queue, events=events, domains=domains
        )
        # Checksums over whole chunks and copies of loaded blobs into the arena run here.
        self._codec_executor = ThreadPoolExecutor(2, thread_name_prefix="kvdepot-codec")
        data_dir = s.data_dir
        keys = BlobKeys.from_settings([k.get_secret_value() for k in s.l2.auth_keys], data_dir / KEY_FILE)
        self.l2 = build_l2(
            s.l2, cache=cache, queue=store_queue, arena=self.arena,
            build=lambda config: build_adapter(config, data_dir, keys),
            executor=self._codec_executor, drain_timeout_s=s.shutdown_timeout_s * 10, keys=keys,
        )  # fmt: skip
        self.engine = build_engine(
            s.l1, arena=self.arena, cache=cache, l2=self.l2, data_plane=s.data_plane
        )
        # quotas.json writes (fsync) run here, one at a time.
        self._state_executor = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-state")
        roots = s.l2.allowed_roots or [s.data_dir]
        admin = self.admin = build_admin(self.engine, quota_file, self._state_executor, roots)
        registry = build_registry(self.engine, s.tenants.metrics_top_n)
        #: histograms from the bus (load latency, hit ratio, reuse distance, age at eviction)
        self.event_metrics = (
            EventMetrics(registry, chunk_size=s.l1.chunk_size, max_tracked=s.events.tracked_chunks)
            if s.events.enabled
            else None
        )
        # Tenants appear in KV events hashed with the deployment key (kv_events.salt=hashed).
        self.kv_events = build_kv_events(s.kv_events, self.engine, keys.signer.key, registry)
        self.tracing = build_tracing(
            s.tracing, f"{socket.gethostname()}/{instance_id(s.data_dir)}", registry, self._span_exporter
        )
        self._key_id = keys.signer.key_id.hex()  # named to the directory, which hashes tenants alike
        t = s.transfers  # engines' sealed regions: by (instance, name), bytes bounded
        regions = SealedRegions(RegionLimits(
            max_bytes=t.max_region_bytes, holder_bytes=t.max_region_bytes_per_instance,
            total_bytes=t.max_region_bytes_total,
        ))  # fmt: skip
        f = s.fleet
        workers = WorkerRegistry(
            timeout_s=f.worker_timeout_s, heartbeat_s=f.heartbeat_s, dead_kept=f.dead_kept
        )
        registry.register(WorkerCollector(workers))
        lifeline_path = (s.data_dir / "lifeline.sock").resolve()
        # Waits on copy completion (and the making of the copies' machinery) run here.
        self._transfer_executor = ThreadPoolExecutor(2, thread_name_prefix="kvdepot-transfer")
        # The sidecar's own copies need torch: built now where a GPU may be (its arena pinned
        # before the first engine comes), else when an engine first shares its KV cache.
        transfers = self._build_transfers(regions) if cuda_may_be_present() else None
        audit = AuditLog()  # the control plane's mutations and the data plane's CLEARs
        self.dataplane = DataPlaneServer(
            self.engine,
            audit=audit,
            url=s.data_plane_url,
            max_frame_bytes=s.data_plane.max_frame_bytes,
            max_tokens=s.data_plane.max_tokens,
            metrics=DataPlaneMetrics(registry),
            transfers=transfers,
            make_transfers=lambda: self._make_transfers(regions),
            max_sessions=s.data_plane.max_sessions,
            session_idle_s=s.data_plane.session_idle_s,
            lifeline_path=str(lifeline_path),
            workers=workers,
        )
        arena = self.arena
        self.lifeline = build_lifeline(
            s.data_dir, regions, self.dataplane.sessions, on_shared=self.dataplane.prepare_transfers,
            workers=self.dataplane.workers, arena=arena, domains=domains,  # segments, not one memfd
        )  # fmt: skip
        self.dataplane.bind()
        self.http_socket = bind_listener(s.http.host, s.http.port)
        self.purge = PurgeJobs(
            self.engine, None if self.l2 is None else self.l2.tiers, events,
            path=s.data_dir / PURGE_FILE, executor=self._state_executor,
        )  # fmt: skip
        # Prefix pins: bound to L1 and the L2 tiers now; those saved before a restart hold again.
        self.pins = PinService(
            self.engine, s.pins, path=s.data_dir / PIN_FILE, executor=self._state_executor
        )
        self.pins.restore()
        registry.register(PinCollector(self.pins))
        self.control = ControlContext(
            pins=self.pins,
            audit=audit,
            settings=s,
            admin=admin,
            status=StatusReader(self.engine, admin),
            health=self,
            registry=registry,
            events=events,
            inventory=None if self.kv_events is None else self.kv_events.inventory,
            workers=workers,
            purge=self.purge,
        )
        subscribe_events(events, self.event_subscribers())
        config = uvicorn.Config(
            create_app(self.control),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(s.shutdown_timeout_s)),
            http=guarded_http(s.http),  # header/body deadlines, connection cap (api/http/connections.py)
        )
        self.http_server = QuietUvicorn(config)

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

    def _build_transfers(self, regions: SealedRegions) -> KVTransfers:
        """The sidecar's own copies (engines that share their KV cache): CUDA where there is a GPU,
        the CPU stub otherwise (opening the sealed regions clients share over their lifelines).
        Imports torch; may run in the transfer executor (`_make_transfers`)."""
        from engine.transfers import KVTransfers
        from gpu.device import default_device
        from gpu.transfer import TransferEngine

        assert self.engine is not None
        assert self._transfer_executor is not None
        device = default_device(regions)
        device.pin(self.engine.arena.tensor_all)
        log.info("transfers_ready", device=device.kind)
        return KVTransfers(
            self.engine, TransferEngine(device, self._transfer_executor), self.settings.transfers,
            regions=regions,
        )

    async def _make_transfers(self, regions: SealedRegions) -> KVTransfers:
        """`_build_transfers` off the loop: importing torch takes seconds the data plane goes on."""
        assert self._transfer_executor is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._transfer_executor, self._build_transfers, regions)

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
        if (
            self.engine is None
            or self.dataplane is None
            or self.http_server is None
            or self.http_socket is None
        ):
            raise RuntimeError("build() first")
        s = self.settings
        try:
            await self._start_l2()
            if self.purge is not None:  # purges a restart interrupted go on (a tiny file, at start)
                self.purge.resume(PurgeJobs.load(s.data_dir / PURGE_FILE))
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
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Everything built so far lives as long as the process: keep it out of the collector's
        # full passes, which otherwise stall the loop for tens of milliseconds now and then.
        gc.collect()
        gc.freeze()
        if self.kv_events is not None:
            self.kv_events.start()
        if self.events is not None and self.events.enabled:
            self.supervisor.start("events", self.events.run(), drain=False)
        if self.tracing is not None:
            self.supervisor.start("tracing-sweep", self.tracing.run_sweeper(), drain=False)
        self.supervisor.start("dataplane", self.dataplane.serve())
        self.supervisor.start("lease-reaper", self.engine.run_reaper(s.l1.reap_interval_s), drain=False)
        self.supervisor.start("pin-sweeper", self.pins.run_sweeper(), drain=False)
        self.supervisor.start("http", self.http_server.serve(sockets=[self.http_socket]))
        if s.fleet.directory_url is not None and self.kv_events is not None:
            member = DirectoryMember(s, self.engine, self.kv_events, self._key_id, self.http_port)
            self.supervisor.start("directory-member", member.run(), drain=False)
        if self.dataplane.workers is not None:
            f = s.fleet
            sweep_s = min(f.heartbeat_s, f.worker_timeout_s / 4)
            self.supervisor.start("worker-watch", self.dataplane.workers.run(sweep_s), drain=False)
        log.info(
            "kvdepot_started",
            version=__version__,
            http=f"http://{s.http.host}:{self.http_port}",
            data_plane=s.data_plane_url,
            l1_bytes=self.engine.cache.allocator.capacity,
            arena=self.engine.arena.name,
            chunk_size=s.l1.chunk_size,
            admin_token="set" if s.http.admin_token is not None else "none",
        )
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
        for executor in (self._codec_executor, self._transfer_executor, self._scrub_executor):
            if executor is not None:  # the scrubber's memset ends before the arena is unmapped
                executor.shutdown(wait=True, cancel_futures=True)
        self._codec_executor = self._transfer_executor = self._scrub_executor = None
        if self._state_executor is not None:
            self._state_executor.shutdown(wait=True)
            self._state_executor = None
        if self.arena is not None:
            self.arena.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


async def serve(settings: Settings) -> int:
    service = Service(settings)
    service.build()
    return await service.run()

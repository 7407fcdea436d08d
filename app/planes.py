"""The service's parts around the engine, for `Service._build` (app/main.py): the observers (metrics
registry, event histograms, KV-event publisher, tracing), the data plane (the engines' sealed
regions, the worker registry, the ZMQ server, the sidecar's own copies) and the control plane
(purge jobs, prefix pins, the control context, the HTTP server). The engine's parts they serve are
app/wiring.py's.

State: none of its own; `TransferMaker` keeps what the sidecar's own copies are built from (the
engine, the transfer executor, the limits, the sealed regions). Called on the event loop's thread
at build; `TransferMaker.make` runs the build in the transfer executor, off the loop.

Builders in call order:
  build_observers(settings, engine, keys, span_exporter) -> Observers
  build_data_plane(settings, engine, registry=, audit=, executor=)
                           -> DataPlane (the server built; the lifeline, then its bind, are the caller's)
  build_control_plane(settings, engine, admin=, ..., executor=)
                           -> ControlPlane (pins restored; the HTTP server serves the sockets it is given)
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import uvicorn
from prometheus_client import CollectorRegistry

from api.audit import AuditLog
from api.dataplane.server import DataPlaneServer
from api.http.app import create_app
from api.http.context import ControlContext, ServiceHealth
from api.metrics import DataPlaneMetrics, PinCollector, build_registry
from api.metrics_events import EventMetrics
from api.metrics_workers import WorkerCollector
from app.kv_events import KvEvents, build_kv_events
from app.logs import LogCollector
from app.loop_lag import LoopLag
from app.serving import QuietUvicorn, guarded_http
from app.settings import Settings
from app.tracing import Tracing, build_tracing
from engine.admin import Administration
from engine.events import EventBus
from engine.facade import CacheEngine
from engine.l1.arena import instance_id
from engine.l2.parts import L2Parts
from engine.pins.service import PIN_FILE, PinService
from engine.purge import PURGE_FILE, PurgeJobs
from engine.status import StatusReader
from engine.transfer_limits import TransferLimits
from engine.workers import WorkerRegistry
from gpu.presence import cuda_may_be_present
from gpu.sealed import RegionLimits, SealedRegions
from storage.auth import BlobKeys

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from api.kvevents.inventory import Inventory
    from engine.transfers import KVTransfers

log = structlog.get_logger("kvdepot")


@dataclass(frozen=True, slots=True)
class DataPlane:
    server: DataPlaneServer
    """Built, not bound: the lifeline server (app/wiring.build_lifeline) is built on its sessions first."""
    regions: SealedRegions
    workers: WorkerRegistry


@dataclass(frozen=True, slots=True)
class ControlPlane:
    purge: PurgeJobs
    pins: PinService
    control: ControlContext
    http_server: QuietUvicorn


@dataclass(frozen=True, slots=True)
class Observers:
    registry: CollectorRegistry
    event_metrics: EventMetrics | None
    """Histograms from the bus (load latency, hit ratio, reuse distance, age at eviction)."""
    kv_events: KvEvents | None
    tracing: Tracing | None
    loop_lag: LoopLag


class TransferMaker:
    """The sidecar's own copies (engines that share their KV cache): CUDA where there is a GPU,
    the CPU stub otherwise (opening the sealed regions clients share over their lifelines)."""

    def __init__(
        self, engine: CacheEngine, executor: ThreadPoolExecutor, limits: TransferLimits,
        regions: SealedRegions,
    ) -> None:  # fmt: skip
        self._engine = engine
        self._executor = executor
        self._limits = limits
        self._regions = regions

    def build(self) -> KVTransfers:
        """Imports torch; may run in the transfer executor (`make`)."""
        from engine.transfers import KVTransfers
        from gpu.device import default_device
        from gpu.transfer import TransferEngine

        device = default_device(self._regions)
        device.pin(self._engine.arena.tensor_all)
        log.info("transfers_ready", device=device.kind)
        return KVTransfers(
            self._engine, TransferEngine(device, self._executor), self._limits, regions=self._regions
        )

    async def make(self) -> KVTransfers:
        """`build` off the loop: importing torch takes seconds the data plane goes on."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.build)


def build_observers(
    s: Settings, engine: CacheEngine, keys: BlobKeys, span_exporter: SpanExporter | None
) -> Observers:
    """The metrics registry, the bus's histograms, the KV-event publisher (bound), tracing; the
    publisher is closed again when tracing cannot be built."""
    registry = build_registry(engine, s.tenants.metrics_top_n)
    registry.register(LogCollector())
    event_metrics = (
        EventMetrics(registry, chunk_size=s.l1.chunk_size, max_tracked=s.events.tracked_chunks)
        if s.events.enabled
        else None
    )
    # Tenants appear in KV events hashed with the deployment key (kv_events.salt=hashed).
    kv_events = build_kv_events(s.kv_events, engine, keys.signer.key, registry)
    try:
        tracing = build_tracing(
            s.tracing, f"{socket.gethostname()}/{instance_id(s.data_dir)}", registry, span_exporter
        )
    except BaseException:
        if kv_events is not None:
            kv_events.close()
        raise
    return Observers(registry, event_metrics, kv_events, tracing, LoopLag(registry))


def build_data_plane(
    s: Settings, engine: CacheEngine, *, registry: CollectorRegistry, audit: AuditLog,
    executor: ThreadPoolExecutor,
) -> DataPlane:  # fmt: skip
    """The ZMQ server, its worker registry and the engines' sealed regions; `executor`: the
    transfer executor (waits on copy completion, and the making of the copies' machinery)."""
    t = s.transfers  # engines' sealed regions: by (instance, name), bytes bounded
    regions = SealedRegions(RegionLimits(
        max_bytes=t.max_region_bytes, holder_bytes=t.max_region_bytes_per_instance,
        total_bytes=t.max_region_bytes_total,
    ))  # fmt: skip
    f = s.fleet
    workers = WorkerRegistry(timeout_s=f.worker_timeout_s, heartbeat_s=f.heartbeat_s, dead_kept=f.dead_kept)
    registry.register(WorkerCollector(workers))
    lifeline_path = (s.data_dir / "lifeline.sock").resolve()
    maker = TransferMaker(engine, executor, t, regions)
    # The sidecar's own copies need torch: built now where a GPU may be (its arena pinned
    # before the first engine comes), else when an engine first shares its KV cache.
    transfers = maker.build() if cuda_may_be_present() else None
    dp = s.data_plane
    server = DataPlaneServer(
        engine, audit=audit, url=s.data_plane_url, max_frame_bytes=dp.max_frame_bytes,
        max_tokens=dp.max_tokens, metrics=DataPlaneMetrics(registry), transfers=transfers,
        make_transfers=maker.make, max_sessions=dp.max_sessions, session_idle_s=dp.session_idle_s,
        lifeline_path=str(lifeline_path), workers=workers,
    )  # fmt: skip
    return DataPlane(server, regions, workers)


def build_control_plane(
    s: Settings, engine: CacheEngine, *, admin: Administration, l2: L2Parts | None, events: EventBus,
    inventory: Inventory | None, registry: CollectorRegistry, audit: AuditLog, workers: WorkerRegistry,
    health: ServiceHealth, executor: Executor,
) -> ControlPlane:  # fmt: skip
    """Purge jobs, prefix pins (restored), the control context and its HTTP server; `executor`:
    the state executor (the state files' writes, one at a time)."""
    purge = PurgeJobs(
        engine, None if l2 is None else l2.tiers, events, path=s.data_dir / PURGE_FILE, executor=executor
    )
    # Prefix pins: bound to L1 and the L2 tiers now; those saved before a restart hold again.
    pins = PinService(engine, s.pins, path=s.data_dir / PIN_FILE, executor=executor)
    pins.restore()
    registry.register(PinCollector(pins))
    control = ControlContext(
        pins=pins, audit=audit, settings=s, admin=admin, status=StatusReader(engine, admin),
        health=health, registry=registry, events=events, inventory=inventory, workers=workers,
        purge=purge,
    )  # fmt: skip
    config = uvicorn.Config(
        create_app(control), log_config=None, access_log=False, lifespan="off",
        timeout_graceful_shutdown=max(1, int(s.shutdown_timeout_s)),
        http=guarded_http(s.http),  # header/body deadlines, connection cap (httpkit/connections.py)
    )  # fmt: skip
    return ControlPlane(purge, pins, control, QuietUvicorn(config))

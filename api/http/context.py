"""What the control plane is given by app/main: passed explicitly, stored on `app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry

from api.audit import AuditLog
from api.kvevents.inventory import Inventory
from app.settings import Settings
from engine.admin import Administration
from engine.events import EventBus
from engine.pins.service import PinService
from engine.purge import PurgeJobs
from engine.status import StatusReader
from engine.workers import WorkerRegistry


class ServiceHealth(Protocol):
    def not_ready(self) -> dict[str, str]:
        """Component name -> reason, for every component that is not ready. Empty = ready."""
        ...

    def components(self) -> dict[str, str]:
        """Component name -> state, for /status."""
        ...

    def uptime_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ControlContext:
    """The settings, quota and L2 administration, engine status snapshots, health, metrics, and the
    sidecar's event bus (routes that subscribe or report on it)."""

    settings: Settings
    admin: Administration
    status: StatusReader
    health: ServiceHealth
    registry: CollectorRegistry
    events: EventBus | None = None
    inventory: Inventory | None = None
    """The KV events' resync listing (None when kv_events is off)."""
    workers: WorkerRegistry | None = None
    purge: PurgeJobs | None = None
    """Purge and clear jobs (engine/purge.py)."""
    pins: PinService | None = None
    """Prefix pins (engine/pins/)."""
    audit: AuditLog = field(default_factory=AuditLog)
    """The recent mutating calls (api/audit.py): GET /audit."""

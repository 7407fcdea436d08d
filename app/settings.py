"""Settings: one immutable object, built once at start-up, never at import.

Sources, highest precedence first: command-line flags (passed as init values), environment
variables (`KVDEPOT_` prefix, `__` between nested names, e.g. `KVDEPOT_L1__SIZE_GB=4`), an optional
TOML file (`--config`), then the defaults below. Every field is documented and bounded; unknown keys
are errors. Components receive only the part they need (`settings.l1`, `settings.http`, ...).

A layer's config types live with that layer and are composed here: `l2` is engine/l2/config.py,
whose adapters are any of those storage/registry.py lists (`AdapterConfig`, re-exported below for
the wiring and the control plane; each family's config is storage/<family>/config.py).

State: the models only; immutable once built, safe from any thread. Building them from flags, the
environment and the file, and the one-line description of what is invalid, is app/settings_load.py
(load_settings), run once by the CLI at start-up.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.kvevents.config import KvEventsSettings
from api.tracing.config import TracingSettings
from engine.l2.config import L2Settings
from engine.pins.config import PinSettings
from engine.transfer_limits import TransferLimits
from storage.registry import AdapterConfig

__all__ = [
    "AdapterConfig",
    "DataPlaneSettings",
    "EventSettings",
    "HttpSettings",
    "KvEventsSettings",
    "L1Settings",
    "L2Settings",
    "LoggingSettings",
    "Settings",
    "TenantSettings",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class HttpSettings(BaseModel):
    """The HTTP control plane (FastAPI on uvicorn, same event loop as the data plane)."""

    model_config = _FROZEN

    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token required by mutating endpoints and by what shows tenants; "
        "unset = no token needed (loopback only, see allow_unauthenticated). Never empty.",
    )
    admin_token_file: Path | None = Field(
        None,
        description="File holding the admin token (first line), used when admin_token is unset; "
        "created with a random token (mode 0600) at first start. Its path is logged, never the token.",
    )
    allow_unauthenticated: bool = Field(
        False, description="Serve a non-loopback host without an admin token (every mutation open)."
    )
    max_body_bytes: int = Field(
        64 * 1024, ge=1024, le=64 << 20, description="Larger request bodies are refused (413) unread."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="A request's headers must all arrive within this long of the connection's opening "
        "(or of the first byte of a kept-alive connection's next request); past it: 408, closed.",
    )  # fmt: skip
    body_timeout_s: float = Field(
        60.0, gt=0, le=86_400,
        description="A request's body must all arrive within this long of its headers (what is left of "
        "a body answered unread, within this long of the answer); past it: 408 or closed.",
    )  # fmt: skip
    max_connections: int = Field(
        1024, ge=1, le=1_000_000,
        description="Client connections open at once; past it a new one is answered 503 and closed.",
    )  # fmt: skip

    @field_validator("admin_token")
    @classmethod
    def _check_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value().strip():
            raise ValueError("must not be empty (leave it unset for no token)")
        return token

    @model_validator(mode="after")
    def _check_exposure(self) -> HttpSettings:
        tokenless = self.admin_token is None and self.admin_token_file is None
        if tokenless and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host} is not loopback and no admin token is set: set http.admin_token "
                "or http.admin_token_file, or http.allow_unauthenticated=true to serve it open"
            )
        return self


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class DataPlaneSettings(BaseModel):
    """The ZMQ data plane the engine-side connector talks to."""

    model_config = _FROZEN

    url: str | None = Field(
        None,
        max_length=200,
        description="ZMQ URL (ipc:// or tcp://). Default: ipc://<data_dir>/dataplane.sock.",
    )
    max_frame_bytes: int = Field(
        16 * 1024 * 1024, ge=4096, le=1 << 30, description="Frames larger than this are refused."
    )
    max_tokens: int = Field(
        1 << 20, ge=1, le=1 << 24, description="Largest token sequence accepted in one operation."
    )
    max_sessions: int = Field(
        4096, ge=1, le=1 << 20,
        description="Connections that said HELLO at once; when full, one idle for session_idle_s "
        "makes room, else HELLO is refused.",
    )  # fmt: skip
    session_idle_s: float = Field(
        600.0, gt=0, le=86400, description="A session silent this long may be closed to make room."
    )
    max_registrations: int = Field(
        1024, ge=1, le=1 << 16,
        description="Engine registrations in all; when full, one idle for session_idle_s is dropped "
        "(its engine registers again), else REGISTER is refused.",
    )  # fmt: skip
    max_registrations_per_instance: int = Field(
        64, ge=1, le=1 << 16, description="Engine registrations of one engine instance."
    )
    allow_remote: bool = Field(
        False,
        description="Bind a tcp:// url on a host that is not loopback (0.0.0.0, an interface's address, "
        "a host name): the data plane has no authentication of its own, only socket permissions.",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("ipc://", "tcp://")):
            raise ValueError("must start with ipc:// or tcp://")
        return url

    @model_validator(mode="after")
    def _check_exposure(self) -> DataPlaneSettings:
        if self.url is None or not self.url.startswith("tcp://") or self.allow_remote:
            return self
        host = self.url[len("tcp://") :].rpartition(":")[0].strip("[]")
        if not is_loopback(host):
            raise ValueError(
                f"url {self.url} is not loopback: any host that reaches it may talk to the data plane, "
                "which has no authentication of its own; bind tcp://127.0.0.1:<port> or ipc://, or set "
                "data_plane.allow_remote=true"
            )
        return self


class L1Settings(BaseModel):
    """The CPU-memory tier: one shared-memory arena and the objects in it."""

    model_config = _FROZEN

    size_gb: float = Field(1.0, gt=0, le=4096, description="Arena size in GiB (shared memory).")
    chunk_size: int = Field(256, ge=16, le=16384, description="Tokens per cached chunk.")
    alignment: int = Field(4096, ge=64, le=1 << 21, description="Alignment of every object in bytes.")
    high_watermark: float = Field(
        0.95, gt=0, le=1, description="Eviction starts when usage would cross this fraction."
    )
    low_watermark: float = Field(
        0.85, gt=0, le=1, description="Eviction frees down to this fraction of the arena."
    )
    write_lease_s: float = Field(
        30.0, gt=0, le=3600, description="A write reservation not committed within this is reclaimed."
    )
    read_lease_s: float = Field(
        60.0, gt=0, le=3600, description="A read lock not released within this is reclaimed."
    )
    reap_interval_s: float = Field(0.5, gt=0, le=60, description="How often expired leases are reclaimed.")
    max_request_share: float = Field(
        0.5, gt=0, le=1,
        description="Most of L1 one STORE may reserve when its tenant has no L1 quota (at least one "
        "chunk); the chunks beyond are refused as no_space.",
    )  # fmt: skip
    populate: bool = Field(True, description="Reserve the arena's pages at start (fails early if short).")
    eviction: Literal["lru", "s3fifo", "arc"] = Field(
        "lru",
        description="Which ready objects go first when L1 makes room: least recently used (lru), "
        "S3-FIFO (a small FIFO for new chunks, a main FIFO with reinsertion, a ghost queue) or an "
        "ARC-like recency/frequency split with ghost lists (arc).",
    )  # fmt: skip
    quarantine_max_bytes: int | None = Field(
        None, ge=0, le=1 << 50,
        description="Bytes one engine instance may hold quarantined (expired write reservations, kept "
        "until the writer's lifeline closes) plus in flight (its clients' write reservations not yet "
        "committed: any may end up quarantined); a reservation past it is refused as no_space; "
        "null: 1/2 of L1 (what one STORE may take, l1.max_request_share).",
    )  # fmt: skip
    quarantine_total_max_bytes: int | None = Field(
        None, ge=0, le=1 << 50,
        description="The same, summed over every engine instance: stalled writers never hold more "
        "than this of L1 (the rest keeps serving hits); null: 3/4 of L1.",
    )  # fmt: skip
    segment_mb: int = Field(
        64, ge=1, le=1 << 20,
        description="Write-domain segment size in MiB: each segment is one sealed memfd, written by "
        "one engine instance (or the sidecar) only and mapped read-only by the others; at most "
        "1/16 of the arena (and at least 1/64); a larger chunk spans consecutive segments of its writer.",
    )  # fmt: skip

    @field_validator("low_watermark")
    @classmethod
    def _check_low(cls, low: float, info: ValidationInfo) -> float:
        high = info.data.get("high_watermark")
        if high is not None and low > high:
            raise ValueError(f"must not exceed high_watermark ({high})")
        return low

    @field_validator("alignment")
    @classmethod
    def _check_alignment(cls, alignment: int) -> int:
        if alignment & (alignment - 1):
            raise ValueError("must be a power of two")
        return alignment

    @property
    def size_bytes(self) -> int:
        return int(self.size_gb * (1 << 30))

    @property
    def quarantine_cap(self) -> int:
        """`quarantine_max_bytes`, or 1/2 of L1 when unset."""
        return self.size_bytes // 2 if self.quarantine_max_bytes is None else self.quarantine_max_bytes


class LoggingSettings(BaseModel):
    """Structured logs (structlog)."""

    model_config = _FROZEN

    level: Literal["debug", "info", "warning", "error"] = Field("info")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: JSON lines unless stdout is a terminal."
    )


class TenantSettings(BaseModel):
    """Tenants (cache_salt) and quotas."""

    model_config = _FROZEN

    allowlist: bool = Field(
        False, description="Salts without a quota store nothing (QUOTA); off: they share freely."
    )
    metrics_top_n: int = Field(
        20, ge=0, le=1000, description="Tenants holding the most bytes labelled by name; the rest 'other'."
    )


class EventSettings(BaseModel):
    """The event bus (engine/events.py): what happens in the cache, for subscribers (KV events)."""

    model_config = _FROZEN

    enabled: bool = Field(True, description="Publish events; false: publishing is a no-op.")
    capacity: int = Field(
        65536, ge=16, le=1 << 24,
        description="Events queued for the dispatcher; when full the newest are dropped (counted).",
    )  # fmt: skip
    linger_ms: float = Field(
        2.0, ge=0, le=1000, description="After a wake-up the dispatcher waits this long to batch events."
    )
    tracked_chunks: int = Field(
        65536, ge=16, le=1 << 24,
        description="Chunk store times kept (each for the reuse distance and per tier for the age at "
        "eviction histograms); past it the oldest are forgotten (counted).",
    )  # fmt: skip


class FleetSettings(BaseModel):
    """The worker registry: engine client processes' heartbeats and liveness (engine/workers.py),
    and the registration with a fleet directory (app/fleet_member.py)."""

    model_config = _FROZEN

    heartbeat_s: float = Field(
        2.0, ge=0.05, le=60, description="How often each client process heartbeats over its lifeline."
    )
    worker_timeout_s: float = Field(
        10.0, ge=0.2, le=3600,
        description="A client silent this long is suspect: its read locks go, its reservations are "
        "quarantined. At least twice heartbeat_s.",
    )  # fmt: skip
    dead_kept: int = Field(256, ge=0, le=100_000, description="Dead workers kept for GET /workers.")
    directory_url: str | None = Field(
        None, max_length=1024, pattern=r"^https?://",
        description="A fleet directory (`kvdepot directory`) to register with and heartbeat; needs "
        "kv_events.endpoint. Unset: no registration.",
    )  # fmt: skip
    directory_token: SecretStr | None = Field(
        None, description="This sidecar's directory credential: HMAC-SHA256(directory secret, instance "
        "id) in hex. It registers this id only, and GET /inventory accepts it (the directory's resync).",
    )  # fmt: skip
    directory_heartbeat_s: float = Field(2.0, ge=0.1, le=600, description="Registration heartbeat period.")
    directory_timeout_s: float = Field(2.0, gt=0, le=60, description="Deadline of one registration POST.")
    instance_id: str | None = Field(
        None, max_length=128, pattern=r"^[A-Za-z0-9._:@/-]+$",
        description="This sidecar's id in the directory; unset: <host name>:<http port>.",
    )  # fmt: skip
    advertise_url: str | None = Field(
        None, max_length=1024, pattern=r"^https?://",
        description="This sidecar's HTTP URL as the directory reaches it; unset: http://<http.host>:<port>.",
    )  # fmt: skip
    engine_url: str | None = Field(
        None, max_length=1024, pattern=r"^https?://",
        description="The engine this sidecar serves (its OpenAI URL), told to the directory for routers.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> FleetSettings:
        if self.worker_timeout_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"fleet.worker_timeout_s ({self.worker_timeout_s}) must be at least twice "
                f"fleet.heartbeat_s ({self.heartbeat_s}): one late heartbeat must not make a worker suspect"
            )
        return self


class Settings(BaseSettings):
    """Everything kvdepot can be told. Frozen once built."""

    model_config = SettingsConfigDict(
        env_prefix="KVDEPOT_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        case_sensitive=False,
    )

    data_dir: Path = Field(Path("kvdepot-data"), description="Sockets, disk L2 and persisted state.")
    shutdown_timeout_s: float = Field(3.0, gt=0, le=600, description="Drain time before cancelling.")
    http: HttpSettings = Field(default_factory=HttpSettings)
    data_plane: DataPlaneSettings = Field(default_factory=DataPlaneSettings)
    l1: L1Settings = Field(default_factory=L1Settings)
    l2: L2Settings = Field(default_factory=L2Settings)
    tenants: TenantSettings = Field(default_factory=TenantSettings)
    pins: PinSettings = Field(default_factory=PinSettings)
    transfers: TransferLimits = Field(default_factory=TransferLimits)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)

    @property
    def data_plane_url(self) -> str:
        return self.data_plane.url or f"ipc://{self.data_dir.resolve()}/dataplane.sock"

    @model_validator(mode="after")
    def _check_kv_events(self) -> Settings:
        if self.kv_events.endpoint is not None and not self.events.enabled:
            raise ValueError("kv_events.endpoint needs events.enabled=true (KV events come from the bus)")
        if self.tracing.otlp_endpoint is not None and not self.events.enabled:
            raise ValueError("tracing.otlp_endpoint needs events.enabled=true (spans come from the bus)")
        if self.fleet.directory_url is not None and self.kv_events.endpoint is None:
            raise ValueError("fleet.directory_url needs kv_events.endpoint (the directory reads the events)")
        return self

    def summary(self) -> dict[str, Any]:
        """The settings without secrets, for /status."""
        out = self.model_dump(mode="json")
        out["http"]["admin_token"] = "***" if self.http.admin_token else None
        out["data_plane"]["url"] = self.data_plane_url
        if self.kv_events.curve_secret_key is not None:
            out["kv_events"]["curve_secret_key"] = "***"
        return out

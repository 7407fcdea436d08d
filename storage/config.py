"""Adapter configs: what each L2 adapter can be told, defined beside the adapters that read it.

Role: one frozen pydantic model per adapter kind (disk, slab, redis, mock) and `AdapterConfig`, their
union discriminated by `type`. app/settings.py composes them into `L2Settings`; the HTTP control
plane parses `POST /l2/adapters` bodies with the same union. Every field is documented and bounded;
unknown keys are errors.

State: none (immutable models). Imports nothing else from the package.

Primitives: DiskAdapterConfig / SlabAdapterConfig / RedisAdapterConfig / MockAdapterConfig, validated
as AdapterConfig
(pydantic picks the model by `type`); AdapterName checks a name (never `l1`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def _adapter_name(name: str) -> str:
    if name == "l1":
        raise ValueError("'l1' is the name of the memory tier in quotas and metrics; choose another")
    return name


AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$"), AfterValidator(_adapter_name)]
"""An L2 adapter's name: its tier in quotas and metrics, hence never `l1`."""


class DiskAdapterConfig(BaseModel):
    """Local-disk L2: crash-safe files, index rebuilt from the files at start."""

    model_config = _FROZEN

    type: Literal["disk"] = "disk"
    name: AdapterName = "disk"
    paths: list[Path] = Field(
        default_factory=list, max_length=64, description="Directories; empty = <data_dir>/l2-disk."
    )
    capacity_gb: float = Field(8.0, gt=0, le=1 << 20, description="LRU eviction keeps usage below this.")
    fsync: Literal["always", "never"] = Field("always", description="fsync each blob before rename.")
    o_direct: bool = Field(False, description="Use O_DIRECT where the filesystem allows it.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads of this adapter's file I/O executor.")
    authenticate: bool = Field(
        True,
        description="Sign blobs with the deployment key (l2.auth_keys or <data_dir>/l2.key) and load "
        "only signed ones: a blob planted in the directory is never served. Files are 0600 either way.",
    )


SLAB_ALIGN = 4096
"""Slab files are read and written with O_DIRECT in units of this many bytes."""


class SlabAdapterConfig(BaseModel):
    """Slab-file L2: preallocated files (or raw block devices) cut into fixed slots, one chunk per
    slot, O_DIRECT I/O, a slot index checkpointed beside the data dir and checked against the slots'
    own headers at start."""

    model_config = _FROZEN

    type: Literal["slab"] = "slab"
    name: AdapterName = "slab"
    paths: list[Path] = Field(
        default_factory=list,
        max_length=64,
        description="Slab files or block devices, keys sharded over them; empty = <data_dir>/l2-slab.",
    )
    size_bytes: int = Field(
        8 << 30,
        ge=3 * SLAB_ALIGN,
        le=1 << 50,
        description="Size of each slab file (a block device: its own size).",
    )
    slot_bytes: int = Field(
        16 << 20,
        ge=2 * SLAB_ALIGN,
        le=1 << 30,
        description="Bytes per slot, a multiple of 4096: one chunk's blob plus 4 KiB of headers.",
    )
    capacity_gb: float | None = Field(
        None, gt=0, le=1 << 20, description="Bytes of slots in use at most (LRU eviction); None = all slots."
    )
    fsync: Literal["always", "never"] = Field("always", description="fdatasync each batch of slot writes.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads of this adapter's I/O executor.")
    checkpoint_s: float = Field(
        30.0, gt=0, le=86_400, description="Least time between two checkpoints of the slot index."
    )
    authenticate: bool = Field(
        True,
        description="Sign blobs with the deployment key (l2.auth_keys or <data_dir>/l2.key) and load "
        "only signed ones: a slot planted in the file is never served.",
    )

    @model_validator(mode="after")
    def _aligned(self) -> SlabAdapterConfig:
        if self.slot_bytes % SLAB_ALIGN:
            raise ValueError(f"slot_bytes must be a multiple of {SLAB_ALIGN}")
        if self.size_bytes % SLAB_ALIGN:
            raise ValueError(f"size_bytes must be a multiple of {SLAB_ALIGN}")
        if self.size_bytes < SLAB_ALIGN + self.slot_bytes:
            raise ValueError("size_bytes must hold at least one slot (and the 4 KiB superblock)")
        return self


class RedisAdapterConfig(BaseModel):
    """Redis or Valkey L2, shared by many sidecars."""

    model_config = _FROZEN

    type: Literal["redis"] = "redis"
    name: AdapterName = "redis"
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        max_length=1024,
        description="redis:// or rediss:// URL; a Redis Cluster may list several seed nodes "
        "(redis://h1:p1,h2:p2/0).",
    )
    cluster: bool | Literal["auto"] = Field(
        "auto",
        description="Redis Cluster mode (slot-aware routing): true, false, or auto (asks the first "
        "seed that answers for INFO cluster). Cluster mode needs database 0.",
    )
    key_prefix: str = Field("kvdepot:", max_length=128, description="Namespace of every key.")
    ttl_s: int | None = Field(None, ge=1, le=10 * 365 * 86400, description="Expiry of stored blobs.")
    timeout_s: float = Field(2.0, gt=0, le=300, description="Socket timeout of one command.")
    max_connections: int = Field(16, ge=1, le=1024, description="Connection pool size.")
    capacity_gb: float | None = Field(None, gt=0, description="Reported capacity (Redis evicts itself).")
    bulk_min_kib: int | None = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Values of at least this many KiB move over blocking sockets in the adapter's "
        "threads, read straight into L1; None: everything through redis-py (rediss:// always is).",
    )
    authenticate: bool = Field(
        True,
        description="Sign blobs with the deployment key (l2.auth_keys or <data_dir>/l2.key) and load "
        "only blobs signed with it: other writers to the Redis cannot plant KV.",
    )
    scope: Literal["fleet", "local"] = Field(
        "fleet",
        description="Tenant usage and l2_bytes quotas: 'fleet' keeps them in this Redis (one figure "
        "and one limit for every sidecar sharing it, storage/redis_fleet.py); 'local' per sidecar.",
    )
    fleet_grace_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Fleet scope: a pending reservation younger than this is never evicted nor "
        "released by reconcile (its write may still be in flight). Must exceed timeout_s; None: "
        "max(10, 2 x timeout_s).",
    )
    reconcile_interval_s: float | None = Field(
        300.0,
        ge=1,
        le=7 * 86400,
        description="Fleet scope: how often the ledger is reconciled with a SCAN of the prefix; "
        "None: only on POST /l2/adapters/{name}/reconcile.",
    )
    scan_keys_per_s: int = Field(
        2000, ge=1, le=1_000_000,
        description="Keys a SCAN of the prefix reads a second, at most: the reconcile, a purge, a clear.",
    )

    @model_validator(mode="after")
    def _check_grace(self) -> RedisAdapterConfig:
        if self.fleet_grace_s is not None and self.fleet_grace_s <= self.timeout_s:
            raise ValueError("fleet_grace_s must exceed timeout_s (a write may last that long)")
        return self

    @property
    def grace_s(self) -> float:
        """fleet_grace_s, or when unset max(10, 2 x timeout_s)."""
        if self.fleet_grace_s is not None:
            return self.fleet_grace_s
        return max(10.0, 2 * self.timeout_s)

    @model_validator(mode="after")
    def _check_cluster(self) -> RedisAdapterConfig:
        parts = urlsplit(self.url)
        seeds = parts.netloc.rpartition("@")[2].split(",")
        if len(seeds) > 1 and self.cluster is False:
            raise ValueError("several seed nodes in url need cluster mode (cluster: true or auto)")
        if len(seeds) > 1 and parts.scheme not in ("redis", "rediss"):
            raise ValueError("seed nodes are listed in redis:// or rediss:// URLs only")
        db = parts.path.strip("/") or "0"
        if self.cluster is True and db != "0":
            raise ValueError(f"Redis Cluster has database 0 only; url selects {db!r}")
        return self


class MockAdapterConfig(BaseModel):
    """In-memory L2 with capacity, simulated bandwidth/latency and fault injection."""

    model_config = _FROZEN

    type: Literal["mock"] = "mock"
    name: AdapterName = "mock"
    capacity_gb: float = Field(1.0, gt=0, le=1024)
    bandwidth_gbps: float | None = Field(None, gt=0, description="Simulated transfer rate.")
    latency_ms: float = Field(0.0, ge=0, le=60_000, description="Simulated latency per batch.")
    error_rate: float = Field(0.0, ge=0, le=1, description="Probability an operation fails.")
    hang: bool = Field(False, description="Operations never complete (until detached).")
    corrupt_rate: float = Field(0.0, ge=0, le=1, description="Probability a load returns flipped bytes.")
    seed: int = Field(0, ge=0, description="Seed of the fault injector.")
    authenticate: bool = Field(False, description="Sign blobs and load only signed ones, as Redis does.")


AdapterConfig = Annotated[
    DiskAdapterConfig | SlabAdapterConfig | RedisAdapterConfig | MockAdapterConfig,
    Field(discriminator="type"),
]

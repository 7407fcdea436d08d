"""The Redis/Valkey adapter's config: the URL (one node or a cluster's seeds), the key prefix,
timeouts and pools, the bulk lane, and the fleet scope (quotas and usage kept in Redis).

Read by storage/redis/ (the adapter, its router, lane and fleet ledger); listed in
storage/registry.py. Its URL may carry credentials: `redacted()` masks them (app/redact.py).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from app.redact import redact_url
from storage.config import AdapterConfigBase, AdapterName

REDIS_IO_THREADS = 4
"""Threads of a Redis adapter's executor (at most max_connections): its bulk lane's."""


class RedisAdapterConfig(AdapterConfigBase):
    """Redis or Valkey L2, shared by many sidecars."""

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
        "and one limit for every sidecar sharing it, storage/redis/fleet.py); 'local' per sidecar.",
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

    def redacted(self) -> RedisAdapterConfig:
        return self.model_copy(update={"url": redact_url(self.url)})

    def shared_location(self) -> str:
        """Its nodes (host:port, lower case, sorted), database and key prefix; never credentials."""
        rest = self.url.split("://", 1)[-1].rsplit("@", 1)[-1]  # user:password@ dropped first
        hosts, _, path = rest.partition("/")
        nodes = [node.lower() for node in hosts.split(",")]
        db = path.split("?", 1)[0] or "0"
        return f"{urlsplit(self.url).scheme}|{','.join(sorted(nodes))}|{db}|{self.key_prefix}"

    def transfer_threads(self) -> int:
        """The bulk lane's threads (and, without a lane, those that join large blobs): one
        connection each, so at most max_connections."""
        return min(REDIS_IO_THREADS, self.max_connections)

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

"""Typed answers of the control plane: what engine/admin.py and engine/status.py hand to api/http.

Frozen, slotted dataclasses, no behaviour; FastAPI builds the OpenAPI schemas of the HTTP answers
from them (api/http declares them as response models). Counters the engine keeps as dataclasses
(`StoreCounters`, `PrefetchCounters`, an adapter's `AdapterStats`, `Usage`, `Health`) appear as
copies taken when the answer is built. Secrets never appear: an adapter's config is the redacted
one (its `redacted()`, storage/config.py: a Redis URL's credentials are `***`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.l2.prefetch import PrefetchCounters
from engine.l2.store_queue import StoreCounters
from engine.tenants.quota import Quota
from storage.base import AdapterStats, Health, Usage
from storage.registry import AdapterConfig

StorePolicy = Literal["all", "first", "seen_twice"]


# --- tenants ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One tenant in one tier (`l1` or an adapter's name): its limit, what it holds, counters."""

    limit_bytes: int | None
    bytes: int
    objects: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    quota_refusals: int


@dataclass(frozen=True, slots=True)
class FleetFigures:
    """One tenant in a shared Redis adapter of fleet scope, as every sidecar on it sees it: the
    fleet l2_bytes quota (null: none; then each sidecar's own applies), the bytes and blobs its
    ledger in Redis holds (storage/redis/fleet.py)."""

    limit_bytes: int | None
    bytes: int
    objects: int


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """A tenant with a quota or usage: its quota (null: none set) and figures per tier (what this
    sidecar holds); `fleet`, per fleet-scope adapter, what the whole fleet holds there."""

    cache_salt: str
    tenant: str
    quota: Quota | None
    tiers: dict[str, TierFigures]
    fleet: dict[str, FleetFigures] = field(default_factory=dict)
    fleet_errors: dict[str, str] = field(default_factory=dict)
    """Fleet-scope adapters that did not answer (their figures are missing; a quota just set was
    not written there)."""


@dataclass(frozen=True, slots=True)
class PinAnswer:
    """A prefix pin (engine/pins/): the chunks of a token prefix kept from eviction in `tiers`."""

    id: str
    cache_salt: str
    tenant: str
    model: str
    chunks: int
    tokens: int
    """The tokens pinned: the full chunks of the token_ids given (a partial last chunk is not)."""
    tiers: list[str]
    ttl_s: int | None
    created_at: float
    expires_at: float | None
    """Unix seconds; null: until deleted."""
    pinned_bytes: dict[str, int]
    """Per tier: what the pin may hold there (chunks times their bytes over every namespace of the
    model), counted against the tenant's pinned_bytes quota."""
    present_chunks: dict[str, int]
    """Per tier: of those chunks (in every namespace of the model), how many the tier holds now."""


@dataclass(frozen=True, slots=True)
class PinList:
    pins: list[PinAnswer]


@dataclass(frozen=True, slots=True)
class ReconcileAnswer:
    """One reconcile of a fleet ledger with a scan of the adapter's prefix."""

    adapter: str
    keys_scanned: int
    tenants: int
    released_bytes: int
    adopted_bytes: int
    ledger_fixed: int


@dataclass(frozen=True, slots=True)
class TenantLabel:
    """A tenant's display name (used instead of its cache_salt in metrics, /status and logs)."""

    cache_salt: str
    label: str


@dataclass(frozen=True, slots=True)
class QuotaList:
    allowlist: bool
    tenants: list[TenantQuota]


@dataclass(frozen=True, slots=True)
class LargeTenant:
    tenant: str
    l1_bytes: int
    l1_limit_bytes: int | None


@dataclass(frozen=True, slots=True)
class TenantsSummary:
    """A few tenant figures for /status; `largest`: the tenants holding the most bytes."""

    allowlist: bool
    quotas: int
    tenants_holding_bytes: int
    quota_refused_chunks: int
    largest: list[LargeTenant]


# --- L2 --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdapterAnswer:
    """An attached L2 adapter: its config (secrets masked), usage, health and counters."""

    name: str
    type: str
    state: Literal["active", "draining"]
    config: AdapterConfig
    usage: Usage
    health: Health
    inflight: int
    stats: AdapterStats


@dataclass(frozen=True, slots=True)
class L2Policy:
    store_policy: StorePolicy
    prefetch_deadline_ms: float
    store_queue_depth: int


@dataclass(frozen=True, slots=True)
class AdapterList:
    """The attached adapters in order; `policy` is null when the sidecar runs without L2."""

    adapters: list[AdapterAnswer]
    policy: L2Policy | None


@dataclass(frozen=True, slots=True)
class L2Status:
    """Adapters, policy and the write-behind / prefetch counters; null parts: no L2 at all."""

    adapters: list[AdapterAnswer]
    policy: L2Policy | None
    store: StoreCounters | None
    prefetch: PrefetchCounters | None


# --- L1 --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: int
    model: str
    kv_rank: int
    layout: str
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class L1Status:
    """The arena, its allocator (and whether its invariants hold), objects, engines, counters."""

    allocator_ok: bool
    allocator_error: str | None
    arena: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    objects_by_state: dict[str, int]
    free_extents: int
    largest_free_bytes: int
    chunk_size: int
    engines: list[EngineInfo]
    locked_requests: int
    counters: dict[str, int]
    quarantined_bytes: int = 0
    """Memory of expired client reservations, kept until their writers are gone (never reused)."""
    quarantined_objects: int = 0
    quarantine_max_bytes: int = 0
    """What one engine instance may hold quarantined before its reservations are refused."""

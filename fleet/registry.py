"""InstanceRegistry: the sidecars the directory knows, their liveness, and their holders in the index.

An instance comes from the configuration (static: never times out) or registers itself (`POST
/v1/instances`, sent again as its heartbeat). A registered instance silent for `timeout_s` leaves
the scores (`live`); what it holds stays indexed (its shared-tier chunks still count for the
instances attached to the same tier) until it is forgotten (`forget`, `DELETE /v1/instances/{id}`,
or `sweep` once silent `forget_after` times `timeout_s`: its place is free again).
A registration that changes the instance's event endpoints restarts its subscription (the caller
asks `register`'s answer). Endpoints (URL, event endpoints, engine URL) are the instance's own: a
static instance's never change (they are the configuration's, where the sidecars' token goes), a
live registered instance's change only under its own credential (`own`; Conflict otherwise).

Bounds: `max_instances`, 64 media per instance, `max_chunks` per instance over all its media
(`room`; what the ingest drops past it is counted in `capped`).

Holders: every medium an instance announces (`CPU` for L1, the L2 adapter's name upper-cased) is a
holder in the ChunkIndex with its own bit; `tier_of(medium)` says whether it counts as L1, local L2
or shared L2 (by the fingerprint of the shared tier the instance registered for that medium).

State: id -> Instance, its tracker, load and holder bits. Event loop only.

Primitives in call order: register(spec, now, own=) -> Registered -> holder_bit(inst, medium) ...
  room(inst) ... live(now) -> [Instance] ... sweep(now) -> [id] / forget(id).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.errors import Conflict, Overloaded
from fleet.index import ChunkIndex
from fleet.spec import InstanceSpec
from fleet.stream import StreamTracker


class Tier(enum.Enum):
    L1 = "l1"
    LOCAL_L2 = "local_l2"
    SHARED_L2 = "shared_l2"


class Registered(enum.Enum):
    NEW = "new"
    UPDATED = "updated"
    """The subscription's endpoints changed: restart it."""
    REFRESHED = "refreshed"


@dataclass(slots=True)
class Instance:
    spec: InstanceSpec
    static: bool
    last_seen: float
    tracker: StreamTracker = field(default_factory=StreamTracker)
    holders: dict[str, int] = field(default_factory=dict)
    """medium -> bit in the index."""
    shared: dict[str, str] = field(default_factory=dict)
    """medium -> shared tier fingerprint."""
    registered_at: float = 0.0

    @property
    def id(self) -> str:
        return self.spec.id

    def tier_of(self, medium: str) -> Tier:
        if medium == self.spec.l1_medium:
            return Tier.L1
        return Tier.SHARED_L2 if medium in self.shared else Tier.LOCAL_L2

    def mask(self) -> int:
        out = 0
        for bit in self.holders.values():
            out |= 1 << bit
        return out


class InstanceRegistry:
    def __init__(
        self, index: ChunkIndex, *, timeout_s: float, max_instances: int, max_chunks: int = 1 << 20,
        forget_after: float = 4.0,
    ) -> None:  # fmt: skip
        self.index = index
        self.timeout_s = timeout_s
        self.max_instances = max_instances
        self.max_chunks = max_chunks
        self.forget_after = forget_after
        self.capped = 0
        """Chunks announced past an instance's max_chunks, dropped."""
        self.forgotten = 0
        """Instances forgotten by `sweep` (silent too long)."""
        self.instances: dict[str, Instance] = {}
        self.version = 0
        """Bumped whenever an instance's holders or shared tiers change (score caches key on it)."""

    def __len__(self) -> int:
        return len(self.instances)

    def register(
        self, spec: InstanceSpec, now: float, *, static: bool = False, own: bool = True
    ) -> Registered:
        """`own`: the registrant presented this instance's own credential (or is the configuration);
        without it a live or static instance's endpoints stay as they are (Conflict)."""
        inst = self.instances.get(spec.id)
        if inst is None:
            if len(self.instances) >= self.max_instances:
                raise Overloaded(f"the directory holds {self.max_instances} instances (max_instances)")
            inst = self.instances[spec.id] = Instance(spec, static, now, registered_at=now)
            self._set_tiers(inst)
            return Registered.NEW
        if not static and _endpoints(inst.spec) != _endpoints(spec):
            if inst.static:
                raise Conflict(f"instance {spec.id!r} is configured: its endpoints are the configuration's")
            if not own and self.alive(inst, now):
                raise Conflict(
                    f"instance {spec.id!r} is live with other endpoints: only its own credential moves "
                    "them (or DELETE it first)"
                )
        old = inst.spec
        inst.spec = spec
        inst.last_seen = now
        inst.static = inst.static or static
        if old.tiers != spec.tiers:
            self._set_tiers(inst)
        if (old.events_endpoint, old.replay_endpoint, old.url) != (
            spec.events_endpoint, spec.replay_endpoint, spec.url,
        ):  # fmt: skip
            return Registered.UPDATED
        return Registered.REFRESHED

    def _set_tiers(self, inst: Instance) -> None:
        inst.shared = {t.medium: t.shared for t in inst.spec.tiers if t.shared is not None}
        self.version += 1

    def holder_bit(self, inst: Instance, medium: str) -> int:
        bit = inst.holders.get(medium)
        if bit is None:
            if len(inst.holders) >= 64:
                raise Overloaded(f"instance {inst.id} announces more than 64 media")
            bit = inst.holders[medium] = self.index.holder((inst.id, medium))
            self.version += 1
        return bit

    def alive(self, inst: Instance, now: float) -> bool:
        return inst.static or now - inst.last_seen <= self.timeout_s

    def live(self, now: float) -> list[Instance]:
        return [i for i in self.instances.values() if self.alive(i, now)]

    def room(self, inst: Instance) -> int:
        """Chunks the instance may still have indexed (max_chunks less what its holders hold)."""
        counts = self.index.counts
        return self.max_chunks - sum(counts.get(bit, 0) for bit in inst.holders.values())

    def sweep(self, now: float) -> list[str]:
        """Forget the registered instances silent `forget_after` times `timeout_s`; their ids."""
        limit = self.forget_after * self.timeout_s
        gone = [i.id for i in self.instances.values() if not i.static and now - i.last_seen > limit]
        for instance_id in gone:
            self.forget(instance_id)
        self.forgotten += len(gone)
        return gone

    def forget(self, instance_id: str) -> Instance | None:
        inst = self.instances.pop(instance_id, None)
        if inst is not None:
            self.index.drop_holders((inst.id, medium) for medium in inst.holders)
            self.version += 1
        return inst

    def get(self, instance_id: str) -> Instance | None:
        return self.instances.get(instance_id)


def _endpoints(spec: InstanceSpec) -> tuple[str | None, ...]:
    return (spec.url, spec.events_endpoint, spec.replay_endpoint, spec.engine_url)

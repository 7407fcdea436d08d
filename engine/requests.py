"""Per-request read locks: the chunks a LOOKUP found, held for the request until it reads them.

State: (engine id, request id) -> the locked objects in chunk order and the lease deadline; a
bounded record of requests whose lease expired (so a late RELEASE learns its copy is unsafe).
Owned by the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.l1.lifecycle import L1Object

RequestId = tuple[int, str]


@dataclass(slots=True)
class RequestLocks:
    objects: list[L1Object]
    deadline: float


@dataclass(slots=True)
class RequestTable:
    expired_memory: int = 4096
    locks: dict[RequestId, RequestLocks] = field(default_factory=dict)
    expired: OrderedDict[RequestId, None] = field(default_factory=OrderedDict)

    def take(self, rid: RequestId) -> RequestLocks | None:
        return self.locks.pop(rid, None)

    def put(self, rid: RequestId, entry: RequestLocks) -> None:
        self.locks[rid] = entry
        self.expired.pop(rid, None)

    def mark_expired(self, rid: RequestId) -> None:
        self.expired[rid] = None
        while len(self.expired) > self.expired_memory:
            self.expired.popitem(last=False)

    def was_expired(self, rid: RequestId) -> bool:
        return rid in self.expired

    def forget(self, rid: RequestId) -> None:
        self.expired.pop(rid, None)

    def due(self, now: float) -> list[RequestId]:
        return [rid for rid, entry in self.locks.items() if entry.deadline <= now]

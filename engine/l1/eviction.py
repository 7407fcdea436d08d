"""Eviction policies for L1: which ready objects go first when room must be made.

A policy only orders objects; the cache decides when to evict (watermarks, tenant quotas) and skips
anything that is not evictable (reserved, read-locked). Policies are told of every insert, access
and removal. `candidates` iterates the live order without copying it (an eviction looks at a few
objects at the head, not at all of them): callers choose their victims first and remove them
after the iteration ended.

Policies: `lru` (here), `s3fifo` (engine/l1/s3fifo.py), `arc` (engine/l1/arc.py); `make_policy`
builds the one `l1.eviction` names. A policy with ghosts (keys of evicted objects, for a second
chance when they come back) keeps them by ObjectKey, bounded by the number of objects held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from engine.l1.arc import ARCPolicy
from engine.l1.lifecycle import L1Object
from engine.l1.s3fifo import S3FIFOPolicy


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, obj: L1Object) -> None: ...

    def on_access(self, obj: L1Object) -> None: ...

    def on_remove(self, obj: L1Object) -> None: ...

    def candidates(self, salt: str | None = None) -> Iterator[L1Object]:
        """Objects in eviction order (first = evict first); only those of `salt` when given.
        Nothing may be inserted or removed while the iterator is in use."""
        ...


_EMPTY: OrderedDict[int, L1Object] = OrderedDict()


class LRUPolicy:
    """Least recently used first, over all objects, with a per-salt view for tenant quotas."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, L1Object] = OrderedDict()
        self._by_salt: dict[str, OrderedDict[int, L1Object]] = {}

    def on_insert(self, obj: L1Object) -> None:
        self._order[obj.oid] = obj
        self._by_salt.setdefault(obj.key.salt, OrderedDict())[obj.oid] = obj

    def on_access(self, obj: L1Object) -> None:
        if obj.oid in self._order:
            self._order.move_to_end(obj.oid)
            self._by_salt[obj.key.salt].move_to_end(obj.oid)

    def on_remove(self, obj: L1Object) -> None:
        if self._order.pop(obj.oid, None) is not None:
            per_salt = self._by_salt[obj.key.salt]
            per_salt.pop(obj.oid, None)
            if not per_salt:
                del self._by_salt[obj.key.salt]

    def candidates(self, salt: str | None = None) -> Iterator[L1Object]:
        source = self._order if salt is None else self._by_salt.get(salt, _EMPTY)
        return iter(source.values())


POLICIES = ("lru", "s3fifo", "arc")


def make_policy(name: str) -> EvictionPolicy:
    """The policy `l1.eviction` names."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r} (one of {', '.join(POLICIES)})")
    if name == "s3fifo":
        return S3FIFOPolicy()
    if name == "arc":
        return ARCPolicy()
    return LRUPolicy()

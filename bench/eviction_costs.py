"""The cost of an eviction policy's bookkeeping, on real L1Objects and no cache around it.

`measure(name, objects, accesses, rng)`: a policy filled with `objects` ready objects, then
  access_ns   ns per on_access of a random live object (a lookup hit: the hot path)
  churn_ns    ns per new object inserted and one victim taken from candidates() and removed
              (what a full L1 pays per store: the room walks the order, then evicts)
"""

from __future__ import annotations

import random
import time

from engine.keys import Namespace, ObjectKey
from engine.l1.eviction import make_policy
from engine.l1.lifecycle import Event, L1Object

_NS = Namespace("bench", b"\x00" * 8)


def _obj(n: int) -> L1Object:
    o = L1Object(oid=n + 1, key=ObjectKey(_NS, "", n.to_bytes(32, "little")), offset=0, size=4096)
    o.apply(Event.RESERVE)
    o.apply(Event.COMMIT)
    return o


def measure(name: str, objects: int, accesses: int, rng: random.Random) -> dict[str, float]:
    policy = make_policy(name)
    live = [_obj(n) for n in range(objects)]
    for o in live:
        policy.on_insert(o)
    picks = [live[rng.randrange(objects)] for _ in range(accesses)]
    on_access = policy.on_access
    start = time.perf_counter_ns()
    for o in picks:
        on_access(o)
    access_ns = (time.perf_counter_ns() - start) / accesses
    fresh = [_obj(objects + n) for n in range(accesses // 10)]
    start = time.perf_counter_ns()
    for o in fresh:
        policy.on_insert(o)
        victim = next(iter(policy.candidates()))
        victim.apply(Event.EVICT)
        policy.on_remove(victim)
    churn_ns = (time.perf_counter_ns() - start) / len(fresh)
    return {"access_ns": round(access_ns, 1), "churn_ns": round(churn_ns, 1)}

"""ARCPolicy: an ARC-like eviction order for L1 (Megiddo and Modha, FAST'03): chunks used once
(recency, T1) and chunks used again (frequency, T2) in two LRU lists, and an adaptive target `p`
for T1's share, moved by ghost hits.

State: T1 and T2 (oid -> object, least recently used first), over all objects and per salt
(tenant quotas evict a tenant's own chunks); ghost lists B1 and B2 of the ObjectKeys (not oids:
those are reused) evicted from T1 and T2, each at most as long as the objects held (at least
GHOST_MIN); the target `p` (objects, 0..objects held). The cache decides when to evict and how
much, so the lists are not bounded by a capacity `c` as in ARC: c is the number of objects held.
Touched only from the event loop, through the L1 cache, no locks.

  on_insert(obj)      a key in B1 (evicted from T1 too early): p grows, the object goes to T2;
                      a key in B2: p shrinks, to T2; otherwise to T1
  on_access(obj)      T1 -> the end of T2, or to the end of T2 again: O(1)
  candidates([salt])  T1's oldest while T1 holds more than p objects (for a salt: p scaled by
                      the salt's share of the objects), then T2 oldest first, then the rest of T1;
                      a pure iteration, nothing moves
  on_remove(obj)      out of its list; its key joins B1 or B2 when it was EVICTED (a deletion,
                      a clear or a purge is no sign of reuse)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from engine.keys import ObjectKey
from engine.l1.lifecycle import L1Object, ObjectState

GHOST_MIN = 64

_Lists = tuple["OrderedDict[int, L1Object]", "OrderedDict[int, L1Object]"]


class ARCPolicy:
    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[int, L1Object] = OrderedDict()
        self._t2: OrderedDict[int, L1Object] = OrderedDict()
        self._salts: dict[str, _Lists] = {}
        self._b1: OrderedDict[ObjectKey, None] = OrderedDict()
        self._b2: OrderedDict[ObjectKey, None] = OrderedDict()
        #: T1's target size in objects
        self.p = 0.0

    @property
    def ghosts(self) -> int:
        return len(self._b1) + len(self._b2)

    def on_insert(self, obj: L1Object) -> None:
        key = obj.key
        b1, b2 = self._b1, self._b2
        held = len(self._t1) + len(self._t2) + 1
        frequent = True
        if key in b1:
            self.p = min(float(held), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
        else:
            frequent = False
        lists = self._salts.get(key.salt)
        if lists is None:
            lists = self._salts[key.salt] = (OrderedDict(), OrderedDict())
        i = 1 if frequent else 0
        (self._t2 if frequent else self._t1)[obj.oid] = obj
        lists[i][obj.oid] = obj

    def on_access(self, obj: L1Object) -> None:
        oid = obj.oid
        t2 = self._t2
        if oid in t2:
            t2.move_to_end(oid)
            self._salts[obj.key.salt][1].move_to_end(oid)
        elif self._t1.pop(oid, None) is not None:
            t1s, t2s = self._salts[obj.key.salt]
            del t1s[oid]
            t2[oid] = obj
            t2s[oid] = obj

    def on_remove(self, obj: L1Object) -> None:
        oid = obj.oid
        if self._t1.pop(oid, None) is not None:
            ghosts, i = self._b1, 0
        elif self._t2.pop(oid, None) is not None:
            ghosts, i = self._b2, 1
        else:
            return
        salt = obj.key.salt
        lists = self._salts[salt]
        del lists[i][oid]
        if not lists[0] and not lists[1]:
            del self._salts[salt]
        if obj.state is ObjectState.EVICTED:
            ghosts[obj.key] = None
            ghosts.move_to_end(obj.key)
            bound = max(len(self._t1) + len(self._t2), GHOST_MIN)
            while len(ghosts) > bound:
                ghosts.popitem(last=False)
        held = len(self._t1) + len(self._t2)
        if self.p > held:
            self.p = float(held)

    def candidates(self, salt: str | None = None) -> Iterator[L1Object]:
        if salt is None:
            return self._order(self._t1, self._t2, self.p)
        lists = self._salts.get(salt)
        if lists is None:
            return iter(())
        t1, t2 = lists
        held = len(self._t1) + len(self._t2)
        return self._order(t1, t2, self.p * (len(t1) + len(t2)) / held)

    @staticmethod
    def _order(
        t1: OrderedDict[int, L1Object], t2: OrderedDict[int, L1Object], target: float
    ) -> Iterator[L1Object]:
        recent = iter(t1.values())
        left = len(t1)
        while left > target:
            obj = next(recent, None)
            if obj is None:
                break
            left -= 1
            yield obj
        yield from t2.values()
        yield from recent

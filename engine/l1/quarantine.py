"""Quarantine: the memory of client write reservations whose lease expired, kept until the writer
is known gone.

Role: fencing. A writer stalled past its write lease (a GC pause, SIGSTOP, an overloaded worker)
keeps copying at the offsets it was given; a generation check cannot stop those late bytes, so
the extent must not be reused while the writer may live. L1Cache (engine/l1/cache.py) moves such a
reservation to QUARANTINED and hands it here; it frees the memory when the holder session is gone
(its lifeline closed).

State: holder session -> its quarantined objects (with their aligned bytes), bytes per engine
instance, totals. Owned by the event loop (through L1Cache only).

Primitives in call order: `add(obj, nbytes)`, `full(instance)`, `take(holder)` -> what to free.
"""

from __future__ import annotations

from engine.l1.lifecycle import L1Object


class Quarantine:
    def __init__(self, max_bytes: int) -> None:
        #: an instance holding this many quarantined bytes or more is refused new reservations
        self.max_bytes = max_bytes
        self.bytes = 0
        self.objects = 0
        self._held: dict[int, list[tuple[L1Object, int]]] = {}
        self._by_instance: dict[str, int] = {}

    def add(self, obj: L1Object, nbytes: int) -> None:
        self._held.setdefault(obj.holder, []).append((obj, nbytes))
        self._by_instance[obj.owner] = self._by_instance.get(obj.owner, 0) + nbytes
        self.bytes += nbytes
        self.objects += 1

    def of(self, instance: str) -> int:
        """Quarantined bytes written by `instance`'s clients."""
        return self._by_instance.get(instance, 0)

    def full(self, instance: str) -> bool:
        """`instance` holds its share of quarantined memory (or more): refuse it new reservations."""
        held = self._by_instance.get(instance, 0)
        return held > 0 and held >= self.max_bytes

    def take(self, holder: int) -> list[L1Object]:
        """The holder is gone: its quarantined objects, no longer counted (the caller frees them)."""
        taken = self._held.pop(holder, [])
        for obj, nbytes in taken:
            left = self._by_instance[obj.owner] - nbytes
            if left:
                self._by_instance[obj.owner] = left
            else:
                del self._by_instance[obj.owner]
            self.bytes -= nbytes
            self.objects -= 1
        return [obj for obj, _ in taken]

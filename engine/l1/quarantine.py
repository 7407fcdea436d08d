"""Quarantine: the memory of client write reservations whose lease expired, kept until the writer
is known gone or done with it, and the budget that bounds it.

Role: fencing. A writer stalled past its write lease (a GC pause, SIGSTOP, an overloaded worker)
keeps copying at the offsets it was given; a generation check cannot stop those late bytes, so
the extent must not be reused while the writer may live. The fencing (engine/l1/fencing.py) moves such a
reservation to QUARANTINED and hands it here; it frees the memory when the holder session is gone
(its lifeline closed), or, object by object, when the holder itself commits or aborts it late
(it copies into it no more).

Budget: any client reservation may end up quarantined (its writer may stall at any time), so what
is bounded is the exposure: bytes quarantined plus bytes of client reservations in flight (reserved,
not yet committed, aborted or quarantined). An engine instance's exposure stays within `max_bytes`
and everyone's together within `total_max_bytes`: a client reservation that would cross either is
refused (`refuses`), so a store never reserves more than its instance may still quarantine, and
stalled writers, however many instances they are, never hold more than `total_max_bytes` of L1
(the rest keeps serving everyone's hits). At least one reservation is admitted when the exposure
is nil (a cap below one chunk still lets a chunk through). Reservations the sidecar writes itself
(holder 0) are never quarantined and are not counted; they are refused only while their instance
holds `max_bytes` quarantined.

State: holder session -> its quarantined objects (with their aligned bytes), quarantined bytes and
bytes in flight per engine instance, totals. Owned by the event loop (through L1Cache and its fencing only).

Primitives in call order: `refuses(instance, nbytes)`, `reserved(instance, nbytes)`, then
`settled(instance, nbytes)` (committed or aborted) or `add(obj, nbytes)` (quarantined), and
`take(holder[, oids])` -> what to free (the holder is gone, or done with those oids).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.l1.lifecycle import L1Object


class Quarantine:
    def __init__(self, max_bytes: int, total_max_bytes: int | None = None) -> None:
        #: one instance's quarantined bytes plus its client reservations in flight, at most
        self.max_bytes = max_bytes
        #: the same, summed over every instance (None: `max_bytes`)
        self.total_max_bytes = max_bytes if total_max_bytes is None else total_max_bytes
        self.bytes = 0
        self.objects = 0
        #: bytes of client reservations in flight (they may still be quarantined)
        self.in_flight = 0
        self._held: dict[int, list[tuple[L1Object, int]]] = {}
        self._by_instance: dict[str, int] = {}
        self._flying: dict[str, int] = {}

    def add(self, obj: L1Object, nbytes: int) -> None:
        """A client reservation of `nbytes` (counted in flight) is quarantined."""
        self.settled(obj.owner, nbytes)
        self._held.setdefault(obj.holder, []).append((obj, nbytes))
        self._by_instance[obj.owner] = self._by_instance.get(obj.owner, 0) + nbytes
        self.bytes += nbytes
        self.objects += 1

    def of(self, instance: str) -> int:
        """Quarantined bytes written by `instance`'s clients."""
        return self._by_instance.get(instance, 0)

    def exposure(self, instance: str) -> int:
        """`instance`'s quarantined bytes and client reservations in flight."""
        return self._by_instance.get(instance, 0) + self._flying.get(instance, 0)

    def refuses(self, instance: str, nbytes: int) -> bool:
        """Whether a reservation of `nbytes` for `instance` must be refused: a client's (`nbytes`
        > 0) that would take the instance's or everyone's exposure past its cap; the sidecar's own
        (`nbytes` 0) while the instance holds its share quarantined."""
        held = self._by_instance.get(instance, 0)
        if nbytes == 0:
            return held > 0 and held >= self.max_bytes
        mine = held + self._flying.get(instance, 0)
        total = self.bytes + self.in_flight
        return (mine > 0 and mine + nbytes > self.max_bytes) or (
            total > 0 and total + nbytes > self.total_max_bytes
        )

    def full(self, instance: str) -> bool:
        """`instance` holds its share of quarantined memory (or more)."""
        return self.refuses(instance, 0)

    def reserved(self, instance: str, nbytes: int) -> None:
        """A client reservation of `nbytes` for `instance` was made: in flight."""
        self._flying[instance] = self._flying.get(instance, 0) + nbytes
        self.in_flight += nbytes

    def settled(self, instance: str, nbytes: int) -> None:
        """A client reservation in flight ended (committed, aborted, or quarantined by `add`)."""
        left = self._flying.get(instance, 0) - nbytes
        if left > 0:
            self._flying[instance] = left
        else:
            self._flying.pop(instance, None)
        self.in_flight -= nbytes

    def take(self, holder: int, oids: Iterable[int] | None = None) -> list[L1Object]:
        """The holder is gone (`oids` None), or done with `oids` (its late COMMIT or ABORT): those
        of its quarantined objects, no longer counted (the caller frees them)."""
        if oids is None:
            taken = self._held.pop(holder, [])
        else:
            wanted = set(oids)
            held = self._held.get(holder, [])
            taken = [(obj, n) for obj, n in held if obj.oid in wanted]
            if not taken:
                return []
            kept = [(obj, n) for obj, n in held if obj.oid not in wanted]
            if kept:
                self._held[holder] = kept
            else:
                del self._held[holder]
        for obj, nbytes in taken:
            left = self._by_instance[obj.owner] - nbytes
            if left:
                self._by_instance[obj.owner] = left
            else:
                del self._by_instance[obj.owner]
            self.bytes -= nbytes
            self.objects -= 1
        return [obj for obj, _ in taken]

"""Write domains: which writer may write which segment of the L1 arena.

Role: no engine may change bytes it did not write. The arena is cut into segments (engine/l1/arena.py:
one sealed memfd each, mapped read-only by every client); a segment belongs to at most one WRITE
DOMAIN, and only its writers get its read-write descriptor. The domains are the sidecar's own
(`SIDECAR`: prefetched L2 loads, the copies of SAVE_BLOCKS; no engine gets it read-write) and one
per engine instance whose client sessions reserve memory (STORE). An object is allocated only in a
segment of the domain that writes it (a chunk larger than a segment: in consecutive ones, `run`),
so an extent reused in a domain shows only that domain's own old bytes (or zeros): a commit of an
extent its writer never filled cannot expose another instance's bytes.

State: per segment its owner (None: free), its allocated bytes, and the last domain that owned it
(a free segment is zeroed before another domain gets it); per engine instance the pidfds of its
client processes (their lifelines' peers) and whether its sessions are all gone. Owned by the
event loop, through L1Cache and RoomMaker (engine/l1/cache.py, room.py).

A segment enters a domain when the domain first needs room and none of its own segments has it
(`claim`): a free one, or for an engine an empty one of the sidecar's. A mapping cannot be revoked,
so an engine's segment stays its own until every process of the instance has exited (its sessions
ended: `gone`; its processes: pidfds), then, once empty, is free again. Engines together leave
`reserve` segments to the sidecar (one where L2 is configured: its prefetches always find a
place). The writer is told of a segment it may now write (`on_grant`, set by the wiring: its RW
descriptor goes over the instance's lifelines) before the STORE reply naming an offset in it is
sent.

Primitives in call order: `mine(domain)`, `claimable(domain)` (where room may be made), `claim`,
`allocated(offset, size)` / `freed(offset, size)`, `helps(domain)` (victims worth evicting for it),
`note_process(instance, pid)`, `gone(instance)`, `writable(instance)` (segments to offer).
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable
from dataclasses import dataclass

from engine.l1.lifecycle import L1Object

#: the sidecar's own domain (its writes: L2 loads, SAVE_BLOCKS copies)
SIDECAR = ""
MAX_PIDS = 1024


@dataclass(slots=True)
class DomainCounters:
    claimed: int = 0
    zeroed: int = 0
    released: int = 0


class WriteDomains:
    def __init__(
        self, capacity: int, segment_bytes: int, zero: Callable[[int, int], None] | None = None,
        *, reserve: int = 0,
    ) -> None:
        self.segment = segment_bytes
        self.capacity = capacity
        self.n = -(-capacity // segment_bytes)
        self.owner: list[str | None] = [None] * self.n
        self.used = [0] * self.n
        self._last: list[str | None] = [None] * self.n
        self._mine: dict[str, list[int]] = {}
        #: instance -> pid -> pidfd of its lifelines' processes
        self._pids: dict[str, dict[int, int]] = {}
        self._gone: set[str] = set()
        self._zero = zero
        #: segments engines leave to the sidecar's own writes (its L2 loads)
        self.reserve = min(reserve, self.n - 1)
        self.counters = DomainCounters()
        #: called with (instance, segment) when an engine instance may write a segment
        self.on_grant: Callable[[str, int], None] | None = None

    def bounds(self, index: int) -> tuple[int, int]:
        lo = index * self.segment
        return lo, min(lo + self.segment, self.capacity)

    def index(self, offset: int) -> int:
        return offset // self.segment

    def mine(self, domain: str) -> list[int]:
        return self._mine.get(domain, [])

    def writable(self, instance: str) -> list[int]:
        """The segments `instance`'s clients may map read-write (none for the sidecar's domain)."""
        return [] if instance == SIDECAR else list(self.mine(instance))

    def claimable(self, domain: str) -> list[int]:
        """Segments `domain` may take now: free ones, and for an engine the sidecar's empty ones,
        as long as engines leave the sidecar one segment."""
        self._release_orphans()
        free = [i for i in range(self.n) if self.owner[i] is None]
        if domain == SIDECAR:
            return free
        if self._engine_segments() + self.reserve >= self.n:
            return []
        return free + [i for i in self.mine(SIDECAR) if self.used[i] == 0]

    def _engine_segments(self) -> int:
        return sum(len(v) for k, v in self._mine.items() if k != SIDECAR)

    def claim(self, domain: str, index: int) -> None:
        """`domain` owns segment `index` from now (zeroed first when another domain wrote it)."""
        previous = self.owner[index]
        if previous is not None:
            self._mine[previous].remove(index)
        last = self._last[index]
        if last is not None and last != domain and self._zero is not None:
            lo, hi = self.bounds(index)
            self._zero(lo, hi - lo)
            self.counters.zeroed += 1
        self.owner[index] = domain
        self._last[index] = domain
        self._mine.setdefault(domain, []).append(index)
        self.counters.claimed += 1
        if domain != SIDECAR and self.on_grant is not None:
            self.on_grant(domain, index)

    def runs(self, domain: str) -> list[tuple[int, int]]:
        """`domain`'s segments as maximal runs of consecutive ones: (first, last) each."""
        out: list[tuple[int, int]] = []
        for i in sorted(self.mine(domain)):
            if out and out[-1][1] == i - 1:
                out[-1] = (out[-1][0], i)
            else:
                out.append((i, i))
        return out

    def run(self, domain: str, count: int) -> list[int] | None:
        """`count` consecutive empty segments `domain` owns or may claim (a chunk larger than a
        segment spans them), or None."""
        mine = set(self.mine(domain))
        claimable = set(self.claimable(domain))
        streak: list[int] = []
        for i in range(self.n):
            if self.used[i] == 0 and (i in mine or i in claimable):
                streak.append(i)
                if len(streak) < count:
                    continue
                new = sum(1 for j in streak if j not in mine)
                if domain == SIDECAR or self._engine_segments() + new + self.reserve <= self.n:
                    return streak
                streak.pop(0)
            else:
                streak = []
        return None

    def _spans(self, offset: int, size: int) -> list[tuple[int, int]]:
        seg, end, out = self.segment, offset + size, []
        while offset < end:
            i = offset // seg
            stop = min(end, (i + 1) * seg)
            out.append((i, stop - offset))
            offset = stop
        return out

    def allocated(self, offset: int, size: int) -> None:
        for i, n in self._spans(offset, size):
            self.used[i] += n

    def freed(self, offset: int, size: int) -> None:
        for i, n in self._spans(offset, size):
            self.used[i] -= n
            owner = self.owner[i]
            if self.used[i] == 0 and owner in self._gone and not self._alive(owner):
                self._free(i)

    def helps(self, domain: str) -> Callable[[L1Object], bool]:
        """Whether evicting an object may make room `domain` can use: it lies in the domain's own
        segment, one the domain may claim once empty, or one of an instance that is gone."""
        owner, seg, gone = self.owner, self.segment, self._gone
        # The sidecar's segments help an engine only while engines may take one more segment.
        sidecars = domain != SIDECAR and self._engine_segments() + self.reserve < self.n

        def useful(obj: L1Object) -> bool:
            o = owner[obj.offset // seg]
            return o == domain or o in gone or (sidecars and o == SIDECAR)

        return useful

    # --- engine instances' processes ---------------------------------------------------------------

    def note_process(self, instance: str, pid: int) -> None:
        """A process of `instance` holds a lifeline (it may map the instance's segments writable)."""
        self._gone.discard(instance)
        pids = self._pids.setdefault(instance, {})
        if pid in pids:
            return
        if len(pids) >= MAX_PIDS:
            self._prune(instance)
        with contextlib.suppress(OSError):  # already gone
            pids[pid] = os.pidfd_open(pid)

    def gone(self, instance: str) -> None:
        """Every session of `instance` ended: its segments are freed once its processes exited
        and the segments are empty (an instance that never wrote is forgotten at once)."""
        if instance not in self._mine:
            self._drop_pids(instance)
            return
        self._gone.add(instance)
        self._release_orphans()

    def _alive(self, instance: str) -> bool:
        self._prune(instance)
        return bool(self._pids.get(instance))

    def _prune(self, instance: str) -> None:
        """Close the pidfds of exited processes."""
        pids = self._pids.get(instance)
        if not pids:
            return
        poller = select.poll()
        for fd in pids.values():
            poller.register(fd, select.POLLIN)
        dead = {fd for fd, _ in poller.poll(0)}
        for pid, fd in list(pids.items()):
            if fd in dead:
                with contextlib.suppress(OSError):
                    os.close(fd)
                del pids[pid]
        if not pids:
            del self._pids[instance]

    def _drop_pids(self, instance: str) -> None:
        for fd in self._pids.pop(instance, {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _release_orphans(self) -> None:
        for instance in list(self._gone):
            if self._alive(instance):
                continue
            for i in list(self.mine(instance)):
                if self.used[i] == 0:
                    self._free(i)
            if not self.mine(instance):
                self._gone.discard(instance)
                self._mine.pop(instance, None)
                self._drop_pids(instance)

    def _free(self, index: int) -> None:
        owner = self.owner[index]
        if owner is not None:
            self._mine[owner].remove(index)
        self.owner[index] = None
        self.counters.released += 1

    def close(self) -> None:
        for instance in list(self._pids):
            self._drop_pids(instance)
